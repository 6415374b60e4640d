"""Two `segment` runs with different vocabularies on one --out never mix their outputs (issue 15, finding 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipseg_sparse.files.folder import plan_run, run_plan
from clipseg_sparse.files.inputs import discover_images
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.files.outputs import ClaimConflictError, OutputOptions
from conftest import TINY_CONFIG

SETTINGS = InferenceSettings(resolution=64, window=0)


def make_images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(folder / f"im{i:03d}.jpg")


def test_a_run_planned_before_another_claimed_its_images_stops_instead_of_overwriting(tiny_clip, tmp_path):
    make_images(tmp_path / "in", 3)
    out, options = tmp_path / "out", OutputOptions(save_probs=True)
    jobs = discover_images([tmp_path / "in"], out).jobs
    seg_a = Segmenter(tiny_clip, "cat,dog", settings=SETTINGS, templates="single", cache_dir=None)
    seg_b = Segmenter(tiny_clip, "car,tree,road", settings=SETTINGS, templates="single", cache_dir=None)
    plan_a, plan_b = plan_run(jobs, out, options, seg_a.config()), plan_run(jobs, out, options, seg_b.config())
    assert len(plan_a.todo) == len(plan_b.todo) == 3  # both planned before either wrote
    run_plan(seg_a, plan_a, options)
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ClaimConflictError, match="other settings"):
        run_plan(seg_b, plan_b, options)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written  # A's files untouched, nothing of B


def test_a_second_run_with_the_same_settings_skips_what_the_first_finished_since_its_plan(tiny_clip, tmp_path):
    make_images(tmp_path / "in", 2)
    out, options = tmp_path / "out", OutputOptions()
    jobs = discover_images([tmp_path / "in"], out).jobs
    seg = Segmenter(tiny_clip, "cat,dog", settings=SETTINGS, templates="single", cache_dir=None)
    plan_1, plan_2 = plan_run(jobs, out, options, seg.config()), plan_run(jobs, out, options, seg.config())
    run_plan(seg, plan_1, options)
    second = run_plan(seg, plan_2, options)
    assert (second.segmented, second.skipped, len(second.records)) == (0, 2, 2)


def test_two_processes_with_different_vocabularies_on_one_out(tmp_path):
    make_images(tmp_path / "in", 40)
    out = tmp_path / "out"
    common = [sys.executable, "-m", "clipseg_sparse", "segment", str(tmp_path / "in"), "--out", str(out), "--save-probs",
              "--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--resolution", "64", "--window", "0",
              "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "CLIPSEG_SPARSE_CACHE": str(tmp_path / "cache"), "COLUMNS": "300"}
    procs = [
        subprocess.Popen([*common, "--classes", vocab], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for vocab in ("cat,dog", "car,tree,road")
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results  # one run wins, the other stops
    loser = next(err for code, err in results if code == 2)
    assert "already have outputs this run would replace" in loser and "Traceback" not in loser
    records = sorted(out.glob("*[0-9].json"))
    assert records
    for record_path in records:  # every image's files come from one run: the record's classes = the label map's
        record = json.loads(record_path.read_text())
        probs = np.load(record_path.with_suffix(".probs.npz"))
        assert list(probs["class_names"]) == record["class_names"], record_path
        labels = np.array(Image.open(record_path.with_suffix(".png")))
        assert sorted(np.unique(labels).tolist()) == sorted(c["index"] for c in record["classes_present"]), record_path


def test_two_processes_with_the_same_settings_on_one_out_segment_each_image_once(tmp_path):
    """Issue 35, reliability 16: each image is claimed (a lock file, flock) while one run segments it; the other
    run goes on to the next, and skips what the first finished since it planned."""
    make_images(tmp_path / "in", 40)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "clipseg_sparse", "segment", str(tmp_path / "in"), "--out", str(out), "--classes", "cat,dog",
               "--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--resolution", "64", "--window", "0",
               "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "CLIPSEG_SPARSE_CACHE": str(tmp_path / "cache"), "COLUMNS": "300"}
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    counts = [{row.split("│")[1].strip(): int(row.split("│")[2]) for row in stdout.splitlines() if row.count("│") == 3 and row.split("│")[2].strip().isdigit()}
              for _, stdout, _ in results]  # fmt: skip
    assert sum(c["segmented"] for c in counts) == 40, counts
    assert len(list(out.glob("*.json"))) == 40 and not list(out.glob(".*.lock"))
