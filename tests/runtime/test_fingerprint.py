"""A checkpoint rewritten in place is not the checkpoint a result was made with (issue 25, data integrity 1),
and `analyze` notices edited data as `eval` does (data integrity 2).

Every result configuration records a checkpoint file's content digest (`pretrained_sha256`), so with the
same `--pretrained PATH` and other content: eval, fgovd and analyze's own result refuse, segment refuses
instead of skipping every image as done, a sweep recomputes the cell, dna train refuses to resume. A copy
or a touched file (same content) still matches; tags and random weights record no digest, so their results
keep their configuration hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file

from clipseg_sparse import load_clip
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark
from test_common import assert_one_line_error, invoke

FAST = ["--templates", "single", "--device", "cpu", "--resolution", "32", "--window", "0"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))


def write_weights(tiny_clip, path: Path, shift: float = 0.0) -> str:
    """The tiny model's weights at `path` (the visual projection shifted by `shift`); the file's sha256[:12]."""
    state = {k: v.detach().clone().contiguous() for k, v in tiny_clip.model.state_dict().items()}
    state["visual.proj"] += shift
    save_file(state, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@pytest.fixture
def ckpt(tiny_clip, tmp_path) -> Path:
    path = tmp_path / "w" / "tiny.safetensors"
    path.parent.mkdir()
    write_weights(tiny_clip, path)
    return path


def rewrite(tiny_clip, path: Path) -> str:
    """Other weights under the same name, as a training job saving over its checkpoint would."""
    before = path.stat().st_mtime_ns
    digest = write_weights(tiny_clip, path, shift=0.5)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # a later time even on coarse file-system clocks
    return digest


def touch(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))


def test_configurations_record_a_checkpoints_content_and_nothing_for_tags(tiny_clip, ckpt):
    from clipseg_sparse.models.proxies import ProxyBackbones

    digest = hashlib.sha256(ckpt.read_bytes()).hexdigest()[:12]
    assert load_clip(TINY_CONFIG, pretrained=str(ckpt), device="cpu").config()["pretrained_sha256"] == digest
    # random weights (and tags): the configuration is what it was, so older results keep their hashes
    assert set(tiny_clip.config()) == {"model", "pretrained", "precision", "quick_gelu", "attention_backend"}
    proxies = ProxyBackbones(weights=str(ckpt))
    assert proxies.config(["dino_vitb16"])["dino_vitb16"] == {"timm": "vit_base_patch16_224.dino", "weights": str(ckpt), "precision": "fp32", "sha256": digest}
    assert "sha256" not in ProxyBackbones(weights="none").config(["dino_vitb16"])["dino_vitb16"]


def test_eval_refuses_a_result_of_a_checkpoint_rewritten_in_place(tiny_clip, ckpt, tmp_path):
    make_benchmark("voc21", tmp_path / "data", n=2, size=(32, 32))
    out = tmp_path / "voc.json"
    args = ["eval", "--dataset", "voc21", "--root", tmp_path / "data", "--model", TINY_CONFIG, "--pretrained", ckpt, *FAST, "--out", out]
    assert invoke(*args).exit_code == 0
    touch(ckpt)  # same content, new time: still the same weights
    shown = invoke(*args)
    assert shown.exit_code == 0 and "holds this configuration's finished result" in shown.stderr
    digest = rewrite(tiny_clip, ckpt)
    assert_one_line_error(invoke(*args), str(out), "differs in: pretrained_sha256", "checkpoint's content")
    assert invoke(*args, "--overwrite").exit_code == 0
    assert json.loads(out.read_text())["config"]["pretrained_sha256"] == digest


def test_fgovd_refuses_a_result_of_a_checkpoint_rewritten_in_place(tiny_clip, ckpt, tmp_path):
    from test_fgovd import make_images
    from test_results import SUBSET

    make_images(SUBSET, tmp_path / "coco")
    out = tmp_path / "r.json"
    args = ["fgovd", "-b", SUBSET, "--images", tmp_path / "coco", "--model", TINY_CONFIG, "--pretrained", ckpt, *FAST, "--negatives", "2", "--out", out]
    assert invoke(*args).exit_code == 0
    rewrite(tiny_clip, ckpt)
    assert_one_line_error(invoke(*args), str(out), "differs in: pretrained_sha256")


def test_segment_does_not_skip_images_made_with_other_weights(tiny_clip, ckpt, tmp_path):
    (tmp_path / "in").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "in" / "a.png")
    args = ["segment", tmp_path / "in", "--classes", "cat,sky", "--model", TINY_CONFIG, "--pretrained", ckpt, *FAST, "--out", tmp_path / "out"]
    assert invoke(*args).exit_code == 0
    touch(ckpt)
    assert "skipped (already done) │ 1" in invoke(*args).stdout
    rewrite(tiny_clip, ckpt)
    assert_one_line_error(invoke(*args), "a.json was made with other settings", "pretrained_sha256")
    again = invoke(*args, "--overwrite")
    assert again.exit_code == 0 and "segmented              │ 1" in again.stdout


def test_sweep_recomputes_a_cell_whose_checkpoint_was_rewritten(tiny_clip, ckpt, tmp_path):
    from clipseg_sparse.sweeps.grid import Grid
    from clipseg_sparse.sweeps.run import SweepPaths, run_sweep

    make_benchmark("voc21", tmp_path / "data", n=2, size=(32, 32))
    grid = Grid(models=[TINY_CONFIG], pretrained=str(ckpt), datasets=["voc21"], resolutions=[32], templates="single", overrides={"window": 0})
    paths = SweepPaths(tmp_path / "sweep", roots={"*": tmp_path / "data"})
    first = run_sweep(grid, paths, device="cpu", progress=False)
    assert first.ran == 1 and not first.failed
    touch(ckpt)
    assert (run_sweep(grid, paths, device="cpu", progress=False).skipped, first.results[0].exists()) == (1, True)
    digest = rewrite(tiny_clip, ckpt)
    again = run_sweep(grid, paths, device="cpu", progress=False)
    assert (again.skipped, again.ran, again.stale) == (0, 1, 1)  # the cell's file name (its hash) is kept
    assert json.loads(first.results[0].read_text())["config"]["pretrained_sha256"] == digest


def test_analyze_recomputes_for_a_rewritten_checkpoint_and_refuses_edited_labels(tiny_clip, ckpt, tmp_path):
    make_benchmark("ade20k", tmp_path / "data", n=2, size=(32, 32))
    out = tmp_path / "stats"
    args = ["analyze", "--dataset", "ade20k", "--root", tmp_path / "data", "--model", TINY_CONFIG, "--pretrained", ckpt,
            "--device", "cpu", "--resolution", "32", "--window", "0", "--out", out, "--preset", "sclip"]  # fmt: skip
    assert invoke(*args).exit_code == 0
    [first] = out.glob("*.json")
    digest = rewrite(tiny_clip, ckpt)
    assert invoke(*args).exit_code == 0
    made = {json.loads(p.read_text())["config"]["pretrained_sha256"] for p in out.glob("*.json") if not p.name.endswith(".progress.jsonl")}
    assert digest in made and len(made) == 2  # computed anew, the old result left as it was
    # a label file edited in place (data integrity 2): refused as eval refuses, not the old numbers shown
    label = sorted((tmp_path / "data").rglob("annotations/**/*.png"))[0]
    edited = np.array(Image.open(label))
    edited[:8] = (edited[:8] + 1) % 150
    Image.fromarray(edited).save(label)
    assert_one_line_error(invoke(*args), "differs in: data", "the data changed")
    assert invoke(*args, "--overwrite").exit_code == 0


def test_dna_train_refuses_to_resume_on_a_rewritten_checkpoint(tiny_clip, ckpt, tmp_path):
    from test_train_checks import _one_line

    make_benchmark("ade20k-train", tmp_path / "ade", n=2, size=(64, 80), seed=3)
    args = ["dna", "train", "--out", tmp_path / "run", "--root", tmp_path / "ade", "--dataset", "ade20k", "--model", TINY_CONFIG,
            "--pretrained", ckpt, "--device", "cpu", "--steps", "1", "--batch-size", "2", "--templates", "single", "--resolution", "32"]  # fmt: skip
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())["config"]
    assert settings["pretrained_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()[:12]
    rewrite(tiny_clip, ckpt)
    _one_line(invoke(*args), "other settings (pretrained_sha256)")


def test_dna_stats_records_the_weights_and_the_adapter(tiny_clip, ckpt, tmp_path):
    from clipseg_sparse.dna.adapter import save_adapter
    from clipseg_sparse.dna.convert import convert_to_dna

    clip = load_clip(TINY_CONFIG, pretrained=str(ckpt), device="cpu")
    convert_to_dna(clip, 1)
    adapter = save_adapter(clip, tmp_path / "a.safetensors")
    out = tmp_path / "stats.json"
    result = invoke("dna", "stats", adapter, "--model", TINY_CONFIG, "--pretrained", ckpt, "--device", "cpu", "--out", out)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["model"]["pretrained_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()[:12]
    assert record["adapter_sha256"] == hashlib.sha256(adapter.read_bytes()).hexdigest()[:12]


def test_a_stamp_matches_a_copy_and_not_a_rewrite_of_the_same_size(tmp_path):
    from clipseg_sparse.runtime.fingerprint import file_stamp, stamp_matches

    path = tmp_path / "store.npy"
    path.write_bytes(b"a" * 64)
    stamp = file_stamp(path)
    assert stamp == {"bytes": 64, "mtime_ns": path.stat().st_mtime_ns, "sha256": hashlib.sha256(b"a" * 64).hexdigest()[:12]}
    touch(path)  # same content, another time: digested, still the same
    assert stamp_matches(path, stamp)
    path.write_bytes(b"b" * 64)
    touch(path)
    assert not stamp_matches(path, stamp) and not stamp_matches(tmp_path / "missing.npy", stamp)
    path.write_bytes(b"a" * 65)
    assert not stamp_matches(path, stamp)
