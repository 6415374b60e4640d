"""`bench --suites pipeline` on the tiny CLIP: the parts of one image's run, nested parts subtracted, memory
counted per part (no timing assertions beyond consistency)."""

import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from clipseg_sparse.bench.pipeline import NETWORK, OTHER, STAGE, PartTimer, bench_pipeline
from clipseg_sparse.cli.app import app
from conftest import TINY_CONFIG


def test_nested_parts_are_subtracted_and_peaks_count_their_pages():
    timer = PartTimer(trim=True)
    with timer.part("outer", OTHER):
        time.sleep(0.02)
        with timer.part("inner", NETWORK):
            time.sleep(0.03)
            block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    outer, inner = timer.parts["outer"], timer.parts["inner"]
    assert inner.own == inner.seconds >= 0.03 and outer.seconds >= outer.own + inner.seconds - 1e-6 and outer.own >= 0.02
    if Path("/proc/self/clear_refs").exists():
        assert inner.peak_mib >= 60 and outer.peak_mib >= inner.peak_mib  # the outer part's peak includes the inner's


def test_wrapped_calls_are_parts_and_restored():
    class Thing:
        def run(self, x):
            return x + 1

    timer = PartTimer()
    original = Thing.run
    with timer.wrapped(Thing, "run", lambda t: "thing", STAGE):
        assert Thing().run(1) == 2 and Thing().run(2) == 3
    assert Thing.run is original and timer.parts["thing"].calls == 2 and timer.parts["thing"].kind == STAGE


def test_pipeline_parts_add_up_to_the_run():
    report = bench_pipeline("naclip+pamr", classes=5, size=(48, 64), model=TINY_CONFIG)
    names = {p.name: p for p in report.parts}
    assert {"CLIP tiny-vit forward", "stage pamr:10:8,16", "write outputs (label PNG, overlay, JSON)", "load image"} <= set(names)
    assert names["CLIP tiny-vit forward"].kind == NETWORK and report.networks == pytest.approx(names["CLIP tiny-vit forward"].own)
    assert sum(p.own for p in report.parts) == pytest.approx(report.whole, rel=1e-9)
    assert all(p.calls >= 1 for p in report.parts) and report.whole > report.networks > 0


def test_bench_pipeline_command(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--suites", "pipeline", "--families", "sclip", "--classes", "3", "--size", "32x48", "--model", TINY_CONFIG])
    assert result.exit_code == 0, result.output
    assert "sclip (sclip, protocol sclip): 3 classes, 32x48" in result.output and "CLIP tiny-vit forward" in result.output
    bad = CliRunner().invoke(app, ["bench", "--suites", "pipeline", "--families", "nope", "--classes", "3", "--model", TINY_CONFIG])
    assert bad.exit_code == 2 and "unknown pipeline family 'nope'" in bad.output
