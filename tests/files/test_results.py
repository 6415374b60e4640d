"""Result files: item logs resume, configurations are hashed and compared, writes are atomic; and a result
identifies its data, so a changed dataset or benchmark file is never answered with an old number (issue 15,
finding 4): eval and fgovd refuse, sweep recomputes the cell in place."""

import json
import os
import shutil
from pathlib import Path

import pytest

from clipseg_sparse.files.results import ConfigMismatchError, ItemLog, logged_or_computed, config_hash, package_versions
from clipseg_sparse.runtime.atomic import write_json_atomic
from clipseg_sparse.sweeps.grid import Grid
from clipseg_sparse.sweeps.run import SweepPaths, run_sweep
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark
from test_common import assert_one_line_error, invoke

TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--device", "cpu", "--resolution", "32", "--window", "0"]
SUBSET = Path(__file__).parents[1] / "data" / "fgovd" / "subset" / "transparency.json"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))


def test_item_log_resumes_and_ignores_torn_line(tmp_path):
    path = tmp_path / "run.jsonl"
    log = ItemLog(path, {"a": 1})
    log.append("img1", {"x": 1})
    log.append("img2", {"x": 2})
    with path.open("a") as f:
        f.write('{"id": "img3", "x"')  # killed mid-write
    again = ItemLog(path, {"a": 1})
    assert set(again.done) == {"img1", "img2"}
    again.append("img3", {"x": 3})
    assert set(ItemLog(path, {"a": 1}).done) == {"img1", "img2", "img3"}
    assert ItemLog(path, {"a": 1}).done["img3"]["x"] == 3


def test_item_log_killed_while_writing_its_header_starts_afresh(tmp_path):
    """A header torn by a kill is not "another configuration": the log restarts with a full header."""
    path = tmp_path / "run.jsonl"
    path.write_text('{"config": {"a": 1}, "ha')
    log = ItemLog(path, {"a": 1})
    assert log.done == {}
    log.append("img1", {"x": 1})
    assert set(ItemLog(path, {"a": 1}).done) == {"img1"}


def test_item_log_refuses_other_config(tmp_path):
    path = tmp_path / "run.jsonl"
    ItemLog(path, {"a": 1}).append("x", {})
    with pytest.raises(ConfigMismatchError, match="different configuration"):
        ItemLog(path, {"a": 2})


def test_config_hash_is_order_independent():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_write_json_atomic(tmp_path):
    import numpy as np

    path = tmp_path / "sub" / "r.json"
    write_json_atomic(path, {"v": np.float32(0.5), "arr": np.arange(3)})
    assert json.loads(path.read_text()) == {"v": 0.5, "arr": [0, 1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_package_versions():
    v = package_versions()
    assert v["torch"] != "not installed" and "python" in v


def test_logged_or_computed_reuses_unless_told_not_to(tmp_path):
    log = ItemLog(tmp_path / "run.jsonl", {"a": 1})
    calls = []
    compute = lambda: calls.append(1) or {"x": len(calls)}  # noqa: E731
    first, reused = logged_or_computed(log, "img", compute)
    assert (first["x"], reused, len(calls)) == (1, False, 1) and first["seconds"] >= 0
    again, reused = logged_or_computed(ItemLog(tmp_path / "run.jsonl", {"a": 1}), "img", compute)
    assert (again["x"], reused, len(calls)) == (1, True, 1)
    redone, reused = logged_or_computed(log, "img", compute, reusable=False)
    assert (redone["x"], reused, len(calls)) == (2, False, 2)
    assert ItemLog(tmp_path / "run.jsonl", {"a": 1}).done["img"]["x"] == 2
    alone, reused = logged_or_computed(None, "img", compute)
    assert (alone["x"], reused) == (3, False)


# -- a result identifies its data -----------------------------------------------------------------------
def test_eval_refuses_a_finished_result_after_its_files_changed(tmp_path):
    make_benchmark("voc21", tmp_path / "data", n=2, size=(32, 32))
    out = tmp_path / "voc.json"
    args = ["eval", "--dataset", "voc21", "--root", tmp_path / "data", *TINY, "--out", out]
    assert invoke(*args).exit_code == 0
    assert json.loads(out.read_text())["config"]["data"].startswith("2 samples@")
    assert invoke(*args).exit_code == 0  # unchanged data: the result is shown
    make_benchmark("voc21", tmp_path / "data", n=2, size=(32, 32), seed=5)  # same names, other labels
    assert_one_line_error(invoke(*args), str(out), "differs in: data", "the data changed")
    again = invoke(*args, "--overwrite")
    assert again.exit_code == 0 and json.loads(out.read_text())["config"]["data"] != ""


def test_eval_progress_log_of_other_data_is_not_resumed(tmp_path):
    from clipseg_sparse.files.results import progress_path

    make_benchmark("voc21", tmp_path / "data", n=3, size=(32, 32))
    out = tmp_path / "voc.json"
    args = ["eval", "--dataset", "voc21", "--root", tmp_path / "data", *TINY, "--out", out]
    assert invoke(*args, "--limit", "1").exit_code == 0
    out.unlink()  # an interrupted run: only the log remains
    split = next((tmp_path / "data").rglob("val.txt"))
    split.write_text("".join(split.read_text().splitlines(keepends=True)[:2]))  # the split now lists 2 images
    result = invoke(*args)
    assert_one_line_error(result, str(progress_path(out)), "differs in: data")


def test_sweep_recomputes_a_cell_whose_root_or_files_changed(tmp_path):
    make_benchmark("voc21", tmp_path / "a", n=2, size=(32, 32), seed=0)
    make_benchmark("voc21", tmp_path / "b", n=2, size=(32, 32), seed=7)
    grid = Grid(models=[TINY_CONFIG], pretrained="none", datasets=["voc21"], resolutions=[32], templates="single",
                overrides={"window": 0})  # fmt: skip
    out = tmp_path / "sweep"
    first = run_sweep(grid, SweepPaths(out, roots={"*": tmp_path / "a"}), device="cpu", progress=False)
    [result] = first.results
    miou_a = json.loads(result.read_text())["metrics"]["mIoU"]
    again = run_sweep(grid, SweepPaths(out, roots={"*": tmp_path / "a"}), device="cpu", progress=False)
    assert (again.skipped, again.ran, again.stale) == (1, 0, 0)
    other = run_sweep(grid, SweepPaths(out, roots={"*": tmp_path / "b"}), device="cpu", progress=False)
    assert (other.skipped, other.ran, other.stale) == (0, 1, 1)  # it said "1 already done" with the old number
    record = json.loads(result.read_text())
    assert record["config"]["root"] == str((tmp_path / "b").resolve())
    fresh = run_sweep(grid, SweepPaths(tmp_path / "fresh", roots={"*": tmp_path / "b"}), device="cpu", progress=False)
    assert record["metrics"]["mIoU"] == json.loads(fresh.results[0].read_text())["metrics"]["mIoU"] != miou_a
    label = next((tmp_path / "b").rglob("*.png"))
    os.utime(label, ns=(label.stat().st_atime_ns, label.stat().st_mtime_ns + 10**9))  # a file modified in place
    assert run_sweep(grid, SweepPaths(out, roots={"*": tmp_path / "b"}), device="cpu", progress=False).stale == 1
    no_data = run_sweep(grid, SweepPaths(out, roots={}), device="cpu", progress=False)
    assert (no_data.skipped, no_data.ran) == (1, 0)  # without the data nothing is judged: the report can be re-rendered


def test_fgovd_records_the_file_and_refuses_another_file_of_the_same_name(tiny_clip, tmp_path):
    from test_fgovd import make_images

    make_images(SUBSET, tmp_path / "coco")
    bench = tmp_path / "b" / "transparency.json"
    bench.parent.mkdir()
    shutil.copy(SUBSET, bench)
    out = tmp_path / "r.json"
    args = ["fgovd", "-b", bench, "--images", tmp_path / "coco", *TINY, "--negatives", "2", "--out", out]
    assert invoke(*args).exit_code == 0, "first run"
    [file_id] = json.loads(out.read_text())["config"]["benchmark_files"]
    assert file_id.startswith("transparency.json@")
    data = json.loads(bench.read_text())
    data["annotations"] = data["annotations"][:2]
    bench.write_text(json.dumps(data))  # another file under the same name (and split)
    assert_one_line_error(invoke(*args), str(out), "differs in: benchmark_files")
