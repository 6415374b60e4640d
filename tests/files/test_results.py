import json

import pytest

from clipseg_sparse.files.results import ConfigMismatchError, ItemLog, logged_or_computed, config_hash, package_versions
from clipseg_sparse.runtime.atomic import write_json_atomic


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
