"""`bench --suites pipeline` on the tiny CLIP, and its SAM 3 families on a small random Sam3Model: the parts of
one image's run, nested parts subtracted, memory counted per part (no timing assertions beyond consistency)."""

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
    assert bad.exit_code == 2 and "unknown pipeline family or preset 'nope'" in bad.output


def test_any_preset_runs_with_its_papers_protocol():
    """A preset's own protocol (an -entmax twin: its base's), SCLIP's where no protocol runs it; unknown names refused."""
    from clipseg_sparse.bench.pipeline import preset_target
    from clipseg_sparse.errors import UserValueError

    assert preset_target("naclip+pamr") == ("naclip", "naclip")  # a family
    assert preset_target("resclip") == ("resclip", "resclip") and preset_target("resclip-entmax") == ("resclip-entmax", "resclip")
    assert preset_target("clip") == ("clip", "sclip")
    assert preset_target("scclip-l14-entmax") == ("scclip-l14-entmax", "scclip")  # a variant without its own: its base's
    with pytest.raises(UserValueError, match="unknown pipeline family or preset 'nope'"):
        preset_target("nope")
    report = bench_pipeline("naclip-entmax", classes=3, size=(32, 48), model=TINY_CONFIG, memory=False)
    assert (report.preset, report.protocol, report.model) == ("naclip-entmax", "naclip", TINY_CONFIG)
    assert all(p.peak_mib is None for p in report.parts)  # no memory run


def test_presets_reading_more_blocks_are_timed_on_a_clip_that_has_them():
    from clipseg_sparse.attention import resolve_spec
    from clipseg_sparse.bench.pipeline import bench_model
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    assert bench_model(resolve_spec("sclip"), PROTOCOLS.get("sclip")) == "ViT-B-16"
    assert bench_model(resolve_spec("scclip-l14"), PROTOCOLS.get("scclip")) == "ViT-L-14"  # blocks 9..19: no protocol CLIP
    assert bench_model(resolve_spec("corrclip-l14"), PROTOCOLS.get("corrclip-l14-metaclip")) == "ViT-L-14-quickgelu"  # the protocol's


@pytest.fixture(scope="module")
def tiny_sam3(tmp_path_factory):
    """A folder holding the tests' small random Sam3Model and its processor: the weights a SAM 3 family loads."""
    from sam3_tiny import tiny_hf_prompter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for two threads on a shared 2-core machine
    prompter, folder = tiny_hf_prompter(), tmp_path_factory.mktemp("sam3-tiny")
    prompter.model.save_pretrained(folder)
    prompter.processor.save_pretrained(folder)
    yield str(folder)
    torch.set_num_threads(threads)


SAM3_NETWORKS = {"SAM 3 vision encoder (get_vision_features)", "SAM 3 text encoder (get_text_features)",
                 "SAM 3 detector (run_prompts: geometry and fusion encoders, DETR decoder, scoring)", "SAM 3 mask decoder (mask_decoder)"}  # fmt: skip


@pytest.mark.parametrize("family, classes, encodings", [("sam3", 3, 1), ("activesam", 41, 2)])
def test_sam3_pipeline_parts_add_up_to_the_run(tiny_sam3, family, classes, encodings):
    """The SAM 3 families: every network part timed and counted in the networks, the parts adding up to the run;
    ActiveSAM over 40 names encodes the image twice (its 672-px preview, then the full input)."""
    report = bench_pipeline(family, classes=classes, size=(48, 64), model=tiny_sam3, memory=False)
    names = {p.name: p for p in report.parts}
    assert (report.preset, report.protocol, report.model) == (family, family, f"sam3:{tiny_sam3}")
    assert {p.name for p in report.parts if p.kind == NETWORK} == SAM3_NETWORKS and all(names[n].own > 0 for n in SAM3_NETWORKS)
    assert report.networks == pytest.approx(sum(names[n].own for n in SAM3_NETWORKS))
    assert {"load image", "label map: argmax, background rule", "write outputs (label PNG)", "fuse_prompt: instances, semantic map, presence"} <= set(names)
    assert names["SAM 3 vision encoder (get_vision_features)"].calls == encodings
    assert sum(p.own for p in report.parts) == pytest.approx(report.whole, rel=1e-9) and report.whole > report.networks > 0


def test_relative_cost_is_the_whole_run_over_sclips(tmp_path, monkeypatch):
    import clipseg_sparse.bench.pipeline as pipeline

    costs = {"presets": {"sclip": {"whole": 2.0, "networks": 1.5}, "proxyclip": {"whole": 45.0, "networks": 44.0}}}
    assert pipeline.relative_cost("proxyclip", costs) == 22.5 and pipeline.relative_cost("lposs", costs) is None
    assert pipeline.relative_cost("proxyclip", {"presets": {"proxyclip": {"whole": 45.0}}}) is None  # no sclip row
    monkeypatch.setattr(pipeline, "COST_FILE", tmp_path / "none.json")
    assert pipeline.preset_costs() == {"presets": {}} and pipeline.relative_cost("sclip") is None


def test_the_benchmark_merges_each_run_into_the_cost_file(tmp_path):
    """benchmarks/pipeline.py --cost-file: runs merge by preset (a resumed sweep keeps earlier rows), sorted."""
    import argparse
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("pipeline_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(size="480x640", threads=1, cpu_time=True)
    file = tmp_path / "cost.json"
    module.keep_cost(file, {"preset": "sclip", "classes": 150, "whole": 2.0004, "networks": 1.5, "model": "ViT-B-16"}, args)
    module.keep_cost(file, {"preset": "naclip", "classes": 150, "whole": 3.0, "networks": 1.6, "model": "ViT-B-16"}, args)
    module.keep_cost(file, {"preset": "sclip", "classes": 150, "whole": 2.5, "networks": 1.5, "model": "ViT-B-16"}, args)
    costs = json.loads(file.read_text())
    assert list(costs["presets"]) == ["naclip", "sclip"] and costs["presets"]["sclip"]["whole"] == 2.5
    assert "150 classes" in costs["measured"] and "process CPU time" in costs["measured"] and not file.with_suffix(".tmp").exists()


def test_the_synthetic_bank_opens_as_a_built_one(tmp_path):
    """The bench's bank (corrclipv2+bank) passes the checks opening a bank makes (its manifest's stamps and hash)."""
    from types import SimpleNamespace

    from clipseg_sparse.bench.pipeline import synthetic_bank

    dense = SimpleNamespace(image_feature_map=lambda rgb: torch.zeros(1, 8, 2, 2))
    backbones = SimpleNamespace(get=lambda name, device: dense, config=lambda names: {n: {"weights": "none"} for n in names})
    clip = SimpleNamespace(device="cpu", visual=SimpleNamespace(proj=torch.zeros(16, 4)), model_name="ViT-B-16", pretrained="none")
    bank = synthetic_bank(tmp_path / "bank", clip, backbones, "c_radio_v3_l", rows=20)
    assert bank.keys.shape == (20, 8) and bank.manifest["rows"] == 20
