"""torchrun with the gloo backend on CPU: sharded evaluation equals the single-process result."""

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from clipseg_sparse import load_clip
from clipseg_sparse.runtime.distributed import shard
from clipseg_sparse.evaluation.segmentation import evaluate
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark


def test_shard_partitions_in_order():
    items = list(range(7))
    parts = [shard(items, r, 3) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum(parts, [])) == items


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_two_ranks_equals_one_process(tiny_clip, tmp_path):
    make_benchmark("ade20k", tmp_path / "data", n=5, size=(40, 56))
    weights = tmp_path / "tiny.safetensors"  # identical weights in every process
    save_file({k: v.contiguous() for k, v in tiny_clip.model.state_dict().items()}, weights)
    args = ["eval", "--dataset", "ade20k", "--root", str(tmp_path / "data"), "--model", TINY_CONFIG,
            "--pretrained", str(weights), "--device", "cpu", "--templates", "single",
            "--resolution", "64", "--window", "32", "--stride", "16"]
    env = dict(os.environ, CLIPSEG_SPARSE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    # the single-process reference runs here, through the library, with the same weights and settings
    one = tmp_path / "one.json"
    evaluate(load_clip(TINY_CONFIG, pretrained=str(weights), device="cpu"), "ade20k", tmp_path / "data", templates="single",
             overrides=dict(resolution=64, window=32, stride=16), out=one, progress=False, cache_dir=tmp_path / "cache")
    two = tmp_path / "two.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "clipseg_sparse", *args, "--out", str(two)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["num_images"] == 5
    assert b["metrics"] == a["metrics"] and b["per_class"] == a["per_class"]
    # each rank checkpointed its own shard: 3 + 2 images
    logs = sorted((tmp_path).glob("two.progress.rank*of2.jsonl"))
    assert [len(p.read_text().splitlines()) - 1 for p in logs] == [3, 2]


# -- sweep, segment and fgovd over ranks (torchrun, gloo on CPU), and --shard ---------------------------
RANDOM = ["--pretrained", "none"]  # random weights are seeded inside load_clip: every process builds the same model


def torchrun(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CLIPSEG_SPARSE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "clipseg_sparse", *args], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@contextmanager
def one_thread():
    """The single-process reference on one thread, as each rank runs (OMP_NUM_THREADS=1): sums split over
    several threads round differently, which is not what these tests are about."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def results(folder) -> dict[str, dict]:
    """Result file name -> the parts that must not depend on how the work was split."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        out[path.name] = {"config": r["config"], "metrics": r["metrics"], "per_class": r.get("per_class")}
    return out


@pytest.fixture
def sweep_args(tmp_path):
    make_benchmark("voc21", tmp_path / "data", n=3, size=(40, 48))
    return ["sweep", "--models", TINY_CONFIG, *RANDOM, "--datasets", "voc21", "--root", str(tmp_path / "data"),
            "--sources", "qk,qq,kk", "--templates", "single", "--device", "cpu"]  # fmt: skip


def test_shards_of_a_grid_are_disjoint_and_make_the_whole(sweep_args, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    whole = runner.invoke(app, [*sweep_args, "--out", str(tmp_path / "whole")])
    assert whole.exit_code == 0, whole.output
    first = runner.invoke(app, [*sweep_args, "--out", str(tmp_path / "parts"), "--shard", "1/2"])
    assert first.exit_code == 0 and "sweep: 2 cells: 0 already done, 2 ran" in first.output
    after_first = set(results(tmp_path / "parts"))
    second = runner.invoke(app, [*sweep_args, "--out", str(tmp_path / "parts"), "--shard", "2/2"])
    assert second.exit_code == 0 and "sweep: 1 cells: 0 already done, 1 ran" in second.output  # nothing of part 1 again
    assert len(after_first) == 2 and len(set(results(tmp_path / "parts")) - after_first) == 1
    assert results(tmp_path / "parts") == results(tmp_path / "whole") and len(results(tmp_path / "whole")) == 3
    bad = runner.invoke(app, [*sweep_args, "--out", str(tmp_path / "bad"), "--shard", "3/2"])
    assert bad.exit_code == 2 and "--shard 3/2: expected I/N with 1 <= I <= N" in bad.output


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_sweep_deals_cells_to_ranks_and_equals_one_process(sweep_args, tmp_path):
    from clipseg_sparse.sweeps.grid import Grid
    from clipseg_sparse.sweeps.run import SweepPaths, run_sweep

    grid = Grid.from_dict(dict(models=[TINY_CONFIG], pretrained="none", datasets=["voc21"], sources=["qk", "qq", "kk"], templates="single"))
    one = run_sweep(grid, SweepPaths(tmp_path / "one", {"*": tmp_path / "data"}), device="cpu", progress=False)
    assert one.ran == 3 and not one.failed
    run = torchrun([*sweep_args, "--out", str(tmp_path / "two")], tmp_path)
    assert results(tmp_path / "two") == results(tmp_path / "one")
    assert run.stderr.count("sweep: 3 cells: 0 already done, 3 ran, 0 failed") == 1  # one summary, from rank 0
    # each cell ran once, in one rank: a single-process item log per cell, none per rank
    assert len(list((tmp_path / "two").glob("*.progress.jsonl"))) == 3 and not list((tmp_path / "two").glob("*rank*"))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_segment_equals_one_process(tmp_path):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    rng = np.random.default_rng(0)
    (tmp_path / "in").mkdir()
    for i, (h, w) in enumerate([(40, 56), (32, 32), (48, 40), (36, 60), (44, 44)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / "in" / f"{i}.png")
    args = ["segment", str(tmp_path / "in"), "--classes", "cat,dog|puppy,sky", "--model", TINY_CONFIG, *RANDOM, "--templates", "single",
            "--resolution", "64", "--window", "0", "--device", "cpu", "--save-probs"]  # fmt: skip
    with one_thread():
        one = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one")], env={"CLIPSEG_SPARSE_CACHE": str(tmp_path / "cache")})
    assert one.exit_code == 0, one.output
    run = torchrun([*args, "--out", str(tmp_path / "two")], tmp_path)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(files) == 20 and files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in files:
        if name.endswith(".npz"):  # the zip headers hold the time of writing; the arrays must be equal
            with np.load(tmp_path / "one" / name) as a, np.load(tmp_path / "two" / name) as b:
                assert np.array_equal(a["probs"], b["probs"])
        else:
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # the summary, printed once, counts the images of both ranks
    assert len(re.findall(r"segmented\s*│\s*5\s", run.stdout)) == 1, run.stdout
    assert re.search(r"classes over 5 image", run.stdout)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_fgovd_equals_one_process(tmp_path):
    from test_fgovd import FULL, make_images

    from clipseg_sparse.evaluation.fgovd import evaluate_fgovd
    from clipseg_sparse.segment.settings import InferenceSettings

    make_images(FULL, tmp_path / "coco", count=5)
    with one_thread():
        one = evaluate_fgovd(load_clip(TINY_CONFIG, pretrained=None, device="cpu"), [FULL], tmp_path / "coco", "sclip", negatives=2,
                             settings=InferenceSettings(resolution=64, window=0), limit=5, progress=False)  # fmt: skip
    torchrun(["fgovd", "--benchmark", str(FULL), "--images", str(tmp_path / "coco"), "--model", TINY_CONFIG, *RANDOM,
              "--preset", "sclip", "--negatives", "2", "--resolution", "64", "--window", "0", "--limit", "5", "--device", "cpu",
              "--out", str(tmp_path / "two.json")], tmp_path)  # fmt: skip
    two = json.loads((tmp_path / "two.json").read_text())
    assert len(two["per_annotation"]) == len(one["per_annotation"]) > 5
    assert two["per_annotation"] == one["per_annotation"] and two["metrics"] == one["metrics"]
    # each rank scored its share of the 5 images in its own item log
    logs = sorted(tmp_path.glob("two.progress.rank*of2.jsonl"))
    assert [len(p.read_text().splitlines()) - 1 for p in logs] == [3, 2]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("argv,code", [(["ls", "presets"], 0), (["segment", "no-such-folder", "--classes", "a,b"], 2)])
def test_the_cli_leaves_the_process_group_before_exit(argv, code, monkeypatch, capsys):
    """A torchrun rank once finished all its images, then aborted at interpreter exit ("terminate called without
    an active exception", SIGABRT): gloo's group was torn down during finalisation. The CLI now leaves the
    group itself at every end of a command, a user error included."""
    import torch.distributed as dist

    from clipseg_sparse.cli.app import main

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(sys, "argv", ["clipseg-sparse", *argv])
        with pytest.raises(SystemExit) as end:
            main()
        assert end.value.code == code
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
