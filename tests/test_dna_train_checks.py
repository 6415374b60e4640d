"""`dna train` refuses what cannot work at once, before the model loads (issue 25): a resolution below one
patch per side (was `RuntimeError: shape '[0, 0]'` in the data loader), and a second run with other
settings on an --out another run has claimed (was: both exit 0, the last writer wins)."""

from __future__ import annotations

from pathlib import Path

import pytest
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
