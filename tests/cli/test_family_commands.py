"""Every command on every timm-tower family, unchanged: `segment`, `eval`, `fgovd`, `sweep`, `analyze`, `explain`,
`demo` and `bench` given `--model NAME --pretrained none` for EVA-02, SigLIP, SigLIP 2 and PE-Core B/16.

`load_clip` is replaced by a builder of the same real architecture (open_clip's `create_model` on the meta
device, then seeded random weights: timm's own init of these towers takes 10+ s each here) and, for the
SigLIP text towers whose Hugging Face tokenizer is not on this machine, word-id tokens; everything else
(name checks, the commands, windows, stages, result files) runs as it does for users. Tiny images keep it
fast; each command runs on one or two families, each family under several commands. EVA-01 has only
giant configurations (EVA01-g-14, 1B parameters), too large to build here; its blocks are covered by
tests/models/test_families.py's shape check.
"""

from __future__ import annotations

import json

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.bench import run as bench_run
from clipseg_sparse.cli.app import app
from clipseg_sparse.models import clip as clip_module
from clipseg_sparse.models.clip import DenseCLIP
from clipseg_sparse.models.tower import model_family
from conftest import free_memory
from fake_benchmarks import make_benchmark
from test_families import _WordIds, _fill
from test_fgovd import SUBSET, make_images

FAMILIES = {"EVA-02": "EVA02-B-16", "SigLIP": "ViT-B-16-SigLIP", "SigLIP 2": "ViT-B-16-SigLIP2", "PE-Core": "PE-Core-B-16"}
FAST = ["--templates", "single", "--resolution", "32"]
_BUILT: dict[tuple[str, str], DenseCLIP] = {}


def _family_clip(name: str, precision: str = "fp32") -> DenseCLIP:
    """The real architecture `name`, seeded random weights, built once in a row per name and precision: one
    model is held at a time (the four B/16 families held together took 3.5 GB)."""
    if (name, precision) not in _BUILT:
        _BUILT.clear()
        free_memory()
        with torch.device("meta"):
            model = open_clip.create_model(name, pretrained=None, device="meta")
        model = _fill(model, seed=3).to({"fp32": torch.float32, "bf16": torch.bfloat16}[precision])
        model.visual.preprocess_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
        cfg = open_clip.get_model_config(name)["text_cfg"]
        tokenizer = _WordIds(cfg["context_length"], cfg["vocab_size"]) if "hf_tokenizer_name" in cfg else open_clip.get_tokenizer(name)
        _BUILT[name, precision] = DenseCLIP(model=model, tokenizer=tokenizer, model_name=name, pretrained="none", precision=precision)
    return _BUILT[name, precision]


@pytest.fixture(scope="module", autouse=True)
def _drop_built():
    yield
    _BUILT.clear()


@pytest.fixture(autouse=True)
def towers(monkeypatch):
    """`load_clip` as the commands call it, building the named family; the calls are recorded."""
    calls = []

    def load_clip(model_name="ViT-B-16", pretrained="openai", device="auto", precision="fp32", **kwargs):
        name = clip_module.check_model_name(model_name)  # the commands' own name check, unchanged
        assert pretrained is None or str(pretrained).lower() in ("none", ""), pretrained
        calls.append(name)
        return _family_clip(name, precision)

    monkeypatch.setattr(clip_module, "load_clip", load_clip)
    monkeypatch.setattr(bench_run, "load_clip", load_clip)  # imported by name there
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # B/16 towers on a few tokens: one thread is faster on a loaded machine
    yield calls
    torch.set_num_threads(before)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_the_families_are_the_supported_timm_ones():
    for family, name in FAMILIES.items():
        assert model_family(name, open_clip.get_model_config(name)).name == family
        assert model_family(name, open_clip.get_model_config(name)).reason is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_segment(family, tmp_path, towers):
    image = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(image)
    result = invoke("segment", image, "--classes", "cat,dog|puppy,grass", "--model", FAMILIES[family], "--pretrained", "none",
                    "--preset", "naclip-entmax", "--window", "32", "--stride", "16", *FAST, "--out", tmp_path / "out", "--save-probs")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert towers == [FAMILIES[family]]
    labels = np.asarray(Image.open(tmp_path / "out" / "in.png"))
    assert labels.shape == (40, 56)
    info = json.loads((tmp_path / "out" / "in.json").read_text())
    assert info["settings"]["model"] == FAMILIES[family]


@pytest.mark.parametrize("family", ["EVA-02", "SigLIP 2"])
def test_eval(family, tmp_path, towers):
    make_benchmark("voc21", tmp_path / "voc", n=2)
    out = tmp_path / "r.json"
    result = invoke("eval", "--dataset", "voc21", "--root", tmp_path / "voc", "--model", FAMILIES[family], "--pretrained", "none",
                    "--preset", "sclip-entmax", "--window", "32", "--stride", "16", *FAST, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["config"]["model"] == FAMILIES[family] and record["num_images"] == 2
    assert 0 <= record["metrics"]["mIoU"] <= 100


def test_fgovd(tmp_path, towers):
    make_images(SUBSET, tmp_path / "coco")
    out = tmp_path / "f.json"
    result = invoke("fgovd", "-b", SUBSET, "--images", tmp_path / "coco", "--model", FAMILIES["PE-Core"], "--pretrained", "none",
                    "--device", "cpu", "--resolution", "32", "--window", "0", "--negatives", "2", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["model"] == FAMILIES["PE-Core"]


def test_sweep(tmp_path, towers):
    make_benchmark("voc20", tmp_path / "voc", n=1)
    out = tmp_path / "sweep"
    result = invoke("sweep", "--models", f"{FAMILIES['EVA-02']},{FAMILIES['SigLIP']}", "--pretrained", "none", "--datasets", "voc20",
                    "--presets", "clearclip", "--normalizers", "softmax", "--alphas", "1.5", "--resolutions", "32", "--templates", "single",
                    "--root", f"voc20={tmp_path / 'voc'}", "--out", out, "--device", "cpu")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "4 cells: 0 already done, 4 ran, 0 failed" in result.stderr
    assert sorted({json.loads(p.read_text())["config"]["model"] for p in out.glob("*.json")}) == sorted([FAMILIES["EVA-02"], FAMILIES["SigLIP"]])


def test_analyze(tmp_path, towers):
    make_benchmark("voc20", tmp_path / "voc", n=1)
    result = invoke("analyze", "--dataset", "voc20", "--root", tmp_path / "voc", "--model", FAMILIES["SigLIP"], "--pretrained", "none",
                    "--preset", "sclip", "--preset", "sclip-entmax", "--resolution", "32", "--window", "0", "--out", tmp_path / "an")  # fmt: skip
    assert result.exit_code == 0, result.output
    records = [json.loads(p.read_text()) for p in (tmp_path / "an").glob("*.json")]
    assert len(records) == 2 and {r["config"]["model"] for r in records} == {FAMILIES["SigLIP"]}


def test_explain(tmp_path, towers):
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "e.png"
    result = invoke("explain", image, "--point", "10,10", "--classes", "a,b", "--preset", "clearclip", "--preset", "clearclip-entmax",
                    "--model", FAMILIES["PE-Core"], "--pretrained", "none", *FAST, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert Image.open(out).size[0] > 100


def test_demo(monkeypatch, towers):
    from clipseg_sparse.analysis import demo as demo_module
    from clipseg_sparse.segment.settings import InferenceSettings

    launched = []
    monkeypatch.setattr(demo_module, "launch", lambda demo, host=None, port=None, **kw: launched.append(demo))
    result = invoke("demo", "--model", FAMILIES["SigLIP 2"], "--pretrained", "none", "--templates", "single")
    assert result.exit_code == 0, result.output
    assert len(launched) == 1 and towers == [FAMILIES["SigLIP 2"]]
    model = demo_module.DemoModel(_family_clip(FAMILIES["SigLIP 2"]), InferenceSettings(resolution=32, window=0), "single")
    image = np.random.default_rng(2).integers(0, 255, (32, 48, 3), dtype=np.uint8)
    masks = model.predict(image, "a,b", ["clearclip", "clearclip-entmax"])
    assert [m.shape[0] for m, _ in masks] == [32, 32]
    maps = model.attention(image, "a,b", ["clearclip", "clearclip-entmax"], 10, 10)
    assert [m.shape for m, _ in maps] == [(32, 48, 3)] * 2


@pytest.mark.parametrize("family, suites", [("EVA-02", "normalizer,forward"), ("SigLIP 2", "normalizer")])
def test_bench(family, suites, towers):
    """`bench --quick` on a tower (segment, windows and bf16 also run on EVA-02: minutes, so not here)."""
    result = invoke("bench", "--quick", "--model", FAMILIES[family], "--suites", suites)
    assert result.exit_code == 0, result.output
    assert set(towers) == {FAMILIES[family]}
    for suite in suites.split(","):
        assert f"{suite} " in result.stdout or suite in result.stdout
    assert f"{FAMILIES[family]} 224px qq H12 N{196 + (0 if 'SigLIP' in family else 1)}" in result.stdout


def test_one_family_model_is_held_at_a_time():
    """The suite's memory: a model built for one family is dropped when another is built."""
    _family_clip(FAMILIES["EVA-02"])
    _family_clip(FAMILIES["PE-Core"])
    assert list(_BUILT) == [(FAMILIES["PE-Core"], "fp32")]
