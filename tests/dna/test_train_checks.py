"""`dna train` refuses what cannot work at once, before the model loads (issue 25): a resolution below one
patch per side (was `RuntimeError: shape '[0, 0]'` in the data loader), and a second run with other
settings on an --out another run has claimed (was: both exit 0, the last writer wins)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.dna.train import TrainConfig, TrainError, train
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark

runner = CliRunner()


@pytest.fixture(scope="module")
def ade_train(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ade")
    make_benchmark("ade20k-train", root, n=2, size=(64, 80), seed=3)
    return root


def _config(root: Path, **kw) -> TrainConfig:
    base = dict(dataset="ade20k", data=str(root), model=TINY_CONFIG, pretrained="none", steps=1, batch_size=2,
                lr=2e-2, resolution=32, templates="single", amp="off", seed=5)
    return TrainConfig(**{**base, **kw})


def _cli(root: Path, out: Path, *extra: str):
    args = ["dna", "train", "--out", str(out), "--root", str(root), "--dataset", "ade20k", "--model", TINY_CONFIG,
            "--pretrained", "none", "--device", "cpu", "--steps", "1", "--batch-size", "2", "--templates", "single", *extra]
    return runner.invoke(app, args)


def _one_line(result, *fragments: str) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model raises: the checks must come before it."""
    import clipseg_sparse.models.clip as clip_module

    def load_clip(*_a, **_k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(clip_module, "load_clip", load_clip)


@pytest.mark.parametrize("resolution, says", [(8, "the smallest valid resolution is 16"), (1, "the smallest valid resolution is 16"),
                                              (20, "use 16 or 32")])  # fmt: skip
def test_resolution_without_whole_patches_is_refused_before_the_model_loads(ade_train, tmp_path, no_model, resolution, says):
    _one_line(_cli(ade_train, tmp_path / "run", "--resolution", str(resolution)), f"--resolution {resolution}", says)
    assert not (tmp_path / "run").exists()


def test_the_smallest_valid_resolution_trains(ade_train, tmp_path):
    result = train(_config(ade_train, resolution=16), tmp_path / "run", device="cpu", progress=False)
    assert result.step == 1 and result.adapter.is_file()
    with pytest.raises(TrainError, match="smallest valid resolution is 16"):
        train(_config(ade_train, resolution=15, objective="image"), tmp_path / "image", device="cpu", progress=False)


class Interrupted(Exception):
    """A run stopped before its first checkpoint (killed while loading the model)."""


@pytest.fixture
def interrupted_load(monkeypatch):
    import clipseg_sparse.models.clip as clip_module

    def load_clip(*_a, **_k):
        raise Interrupted

    monkeypatch.setattr(clip_module, "load_clip", load_clip)
    return monkeypatch


def test_a_run_with_other_settings_is_refused_at_once_and_the_same_settings_resume(ade_train, tmp_path, interrupted_load):
    out = tmp_path / "run"
    with pytest.raises(Interrupted):  # the first run claimed --out, then stopped before any checkpoint
        train(_config(ade_train), out, device="cpu", progress=False)
    assert json.loads((out / "settings.json").read_text())["config"] == dataclasses.asdict(_config(ade_train))
    assert not (out / "checkpoint.pt").exists()
    # another run with other settings: one line naming them, before its model loads (Interrupted would be exit 1)
    _one_line(_cli(ade_train, out, "--resolution", "32", "--amp", "off", "--lr", "0.001", "--seed", "5"), str(out), "other settings (lr)")
    with pytest.raises(TrainError, match=r"other settings \(lr, seed\)"):
        train(_config(ade_train, lr=1e-3, seed=6), out, device="cpu", progress=False)
    interrupted_load.undo()
    # the same settings go on; the claim stays
    result = train(_config(ade_train), out, device="cpu", progress=False)
    assert result.step == 1 and result.adapter.is_file()
    with pytest.raises(TrainError, match=r"other settings \(steps\)"):
        train(_config(ade_train, steps=2), out, device="cpu", progress=False)
    # --overwrite re-claims for the new settings
    again = train(_config(ade_train, lr=1e-3), out, device="cpu", progress=False, overwrite=True)
    assert again.step == 1 and json.loads((out / "settings.json").read_text())["config"]["lr"] == 1e-3


def test_missing_data_claims_nothing_and_a_broken_claim_is_one_line(ade_train, tmp_path, no_model):
    out = tmp_path / "run"
    with pytest.raises(Exception, match="nothing"):
        train(_config(tmp_path / "nothing"), out, device="cpu", progress=False)
    assert not (out / "settings.json").exists()
    out.mkdir(exist_ok=True)
    (out / "settings.json").write_text("[1, 2")
    _one_line(_cli(ade_train, out, "--resolution", "32"), "settings.json", "not a settings record")


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_before_the_first_checkpoint_saves_one(ade_train, tmp_path, signum, code):
    """Stopped by SIGTERM or Ctrl-C before its first checkpoint (step `--save-every`), `dna train` saved nothing
    yet said "finished work is kept": it now ends the step under way, saves the checkpoint and resumes from it."""
    out = tmp_path / "run"
    env = dict(os.environ, CLIPSEG_SPARSE_CACHE=str(tmp_path / "cache"), CLIPSEG_SPARSE_PROGRESS_SECONDS="0", OMP_NUM_THREADS="1")
    args = ["dna", "train", "--out", str(out), "--root", str(ade_train), "--dataset", "ade20k", "--model", TINY_CONFIG, "--pretrained", "none",
            "--device", "cpu", "--steps", "100000", "--save-every", "100000", "--batch-size", "2", "--resolution", "32", "--templates", "single"]  # fmt: skip
    # a shell's background job (`pytest &`) starts with SIGINT ignored, and so would the child: give it Ctrl-C's default
    default_int = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    run = subprocess.Popen([sys.executable, "-m", "clipseg_sparse", *args], env=env, stderr=subprocess.PIPE, text=True, preexec_fn=default_int)
    seen = []
    try:
        for line in run.stderr:  # one progress line per step off a terminal
            seen.append(line)
            done = re.search(r"(\d+)/100000 steps", line)
            if done and int(done[1]) >= 3:
                break
        run.send_signal(signum)
        rest = run.communicate(timeout=120)[1]
    finally:
        run.kill()
    assert run.returncode == code, "".join(seen[-5:]) + rest
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert state["step"] >= 3 and len(state["losses"]) == state["step"]
    assert f"after step {state['step']} of 100000; checkpoint" in rest and "finished work is kept" in rest
    resumed = train(_config(ade_train, steps=100000, lr=1e-4, amp="auto", seed=0), out, device="cpu", progress=False, stop_after=state["step"] + 1, save_every=100000)
    assert resumed.resumed_from == state["step"] and resumed.step == state["step"] + 1
