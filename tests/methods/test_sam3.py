"""SAM 3: the SegEarth-OV3 pipeline (`methods/sam3.py`), its prompters (`models/sam3/`) and the `--regions
sam3` source, against a transcription of earth-insights/SegEarth-OV-3@87e5cc1 `segearthov3_segmentor.py`.

The fusion runs on a stubbed prompter (fixed instance masks, scores, semantic maps and presence per name);
the transformers backend on a small random `Sam3Model` (`sam3_tiny.tiny_hf_model`, always); the package
backend on a small random SAM 3 built from the package's classes when the package is installed (extra
`.[sam3-package]`; its pins, huggingface-hub < 2 and numpy < 2.4, keep it out of the test extra)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets import DATASETS, class_vocabulary
from clipseg_sparse.evaluation.metrics import intersect_and_union, segmentation_metrics
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.evaluation.segmentation import evaluate
from clipseg_sparse.methods.sam3 import Sam3Segmenter
from clipseg_sparse.models.sam3 import Sam3Prompt
from clipseg_sparse.segment.images import load_image
from clipseg_sparse.segment.pipelines import find_pipeline
from clipseg_sparse.segment.regions import Sam3Regions
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.vocabulary import Vocabulary
from fake_benchmarks import make_benchmark

HAS_SAM3 = importlib.util.find_spec("sam3") is not None
needs_sam3 = pytest.mark.skipif(not HAS_SAM3, reason="the sam3 package (extra .[sam3-package]) is not installed")


class StubPrompter:
    """Fixed answers per name, as the prompter gives them (instances already kept), drawn from a seed per
    name and image size; records every (name, confidence) it is asked."""

    def __init__(self, instances: dict[str, int] | None = None, fixed: dict | None = None) -> None:
        self.instances = instances or {}
        self.fixed = fixed or {}
        self.asked: list[tuple[str, float]] = []

    def config(self) -> dict:
        return {"model": "sam3", "pretrained": "stub", "device": "cpu"}

    def set_image(self, rgb: np.ndarray) -> dict:
        return {"size": rgb.shape[:2]}

    def answer(self, size, name: str) -> Sam3Prompt:
        if name in self.fixed:
            return self.fixed[name]
        g = torch.Generator().manual_seed(sum(map(ord, name)) + 7 * size[0] + size[1])
        n = self.instances.get(name, 2)
        return Sam3Prompt(torch.rand(n, *size, generator=g), torch.rand(n, generator=g), torch.rand(*size, generator=g), float(torch.rand(1, generator=g)))

    def prompt(self, state: dict, name: str, confidence: float) -> Sam3Prompt:
        self.asked.append((name, confidence))
        return self.answer(state["size"], name)

    def prompts(self, state: dict, names, confidence: float) -> list[Sam3Prompt]:
        return [self.prompt(state, name, confidence) for name in names]

    def normalized(self, normalizer):
        return contextlib.nullcontext()


def published_labels(answers: dict, query_words, query_idx, h, w, prob_thd, bg_idx=0):
    """`SegEarthOV3Segmentation._inference_single_view` then `predict` (no slide), transcribed on the
    patched processor's state keys: masks_logits n x 1 x H x W, object_score n, semantic_mask_logits
    1 x 1 x H x W, presence_score."""
    num_cls, num_queries = max(query_idx) + 1, len(query_idx)
    query_idx = torch.tensor(query_idx)
    seg_logits = torch.zeros((num_queries, h, w))
    for q, word in enumerate(query_words):
        st = answers[word]
        if st["masks_logits"].shape[0] > 0:
            for inst_id in range(st["masks_logits"].shape[0]):
                seg_logits[q] = torch.max(seg_logits[q], st["masks_logits"][inst_id].squeeze() * st["object_score"][inst_id])
        semantic = st["semantic_mask_logits"]
        if semantic.shape != (h, w):
            semantic = F.interpolate(semantic, size=(h, w), mode="bilinear", align_corners=False).squeeze()
        seg_logits[q] = torch.max(seg_logits[q], semantic)
        seg_logits[q] = seg_logits[q] * st["presence_score"]
    if num_cls != num_queries:
        cls_index = F.one_hot(query_idx).T.view(num_cls, num_queries, 1, 1)
        seg_logits = (seg_logits.unsqueeze(0) * cls_index).max(1)[0]
    seg_pred = torch.argmax(seg_logits, dim=0)
    seg_pred[seg_logits.max(0)[0] < prob_thd] = bg_idx
    return seg_logits, seg_pred


def state_of(answer: Sam3Prompt) -> dict:
    return {
        "masks_logits": answer.masks[:, None], "object_score": answer.scores,
        "semantic_mask_logits": answer.semantic[None, None], "presence_score": torch.tensor(answer.presence),
    }  # fmt: skip


def test_fusion_equals_the_published_segmentor_on_stubbed_answers():
    vocab = Vocabulary.parse("background,cat|kitten|tabby,dog,sky")
    stub = StubPrompter({"kitten": 0, "dog": 3, "sky": 1})
    rgb = np.zeros((9, 13, 3), np.uint8)
    for thd in (0.0, 0.3):
        seg = Sam3Segmenter(stub, vocab, InferenceSettings(bg_threshold=thd), confidence=0.4)
        answers = {n: state_of(stub.answer((9, 13), n)) for n in vocab.flat_names}
        want_scores, want_labels = published_labels(answers, vocab.flat_names, vocab.name_to_class, 9, 13, thd)
        torch.testing.assert_close(seg.scores(rgb), want_scores, rtol=0, atol=0)
        assert np.array_equal(seg.predict_labels(rgb), want_labels.numpy())
    assert {c for _, c in stub.asked} == {0.4} and [n for n, _ in stub.asked[:6]] == list(vocab.flat_names)


def test_fusion_by_hand_at_one_pixel():
    """cat: instances 0.9 x 0.6 and 0.5 x 0.8 -> 0.54, semantic 0.3 -> 0.54, presence 0.5 -> 0.27;
    kitten: no instance, semantic 0.7, presence 0.9 -> 0.63; so cat = max(0.27, 0.63) = 0.63;
    dog: 1.0 x 0.7 -> 0.7, semantic 0.2, presence 0.5 -> 0.35. Labels: cat (1); below 0.65: class 0."""
    one = lambda *v: torch.tensor(v, dtype=torch.float32).view(-1, 1, 1)  # noqa: E731
    fixed = {
        "cat": Sam3Prompt(one(0.9, 0.5), torch.tensor([0.6, 0.8]), torch.full((1, 1), 0.3), 0.5),
        "kitten": Sam3Prompt(torch.zeros(0, 1, 1), torch.zeros(0), torch.full((1, 1), 0.7), 0.9),
        "dog": Sam3Prompt(one(1.0), torch.tensor([0.7]), torch.full((1, 1), 0.2), 0.5),
        "sky": Sam3Prompt(torch.zeros(0, 1, 1), torch.zeros(0), torch.full((1, 1), 0.1), 0.1),
    }
    vocab = Vocabulary.parse("sky,cat|kitten,dog")
    rgb = np.zeros((1, 1, 3), np.uint8)
    seg = Sam3Segmenter(StubPrompter(fixed=fixed), vocab)
    torch.testing.assert_close(seg.scores(rgb)[:, 0, 0], torch.tensor([0.01, 0.63, 0.35]))
    assert seg.predict_labels(rgb)[0, 0] == 1
    assert Sam3Segmenter(StubPrompter(fixed=fixed), vocab, InferenceSettings(bg_threshold=0.65)).predict_labels(rgb)[0, 0] == 0


def test_pipeline_text_and_protocol_constants():
    assert find_pipeline("sclip") is None and find_pipeline(None) is None
    assert find_pipeline("sam3").name == "sam3:0.5" and find_pipeline("sam3:0.25").name == "sam3:0.25"
    for bad in ("sam3:1.5", "sam3:x"):
        with pytest.raises(ValueError, match=r"sam3\[:CONFIDENCE\]"):
            find_pipeline(bad)
    p = PROTOCOLS.get("sam3")
    # configs/cfg_*.py of SegEarth-OV-3@87e5cc1: confidence_threshold and prob_thd per dataset
    published = {"voc21": (0.5, 0.4), "voc20": (0.2, 0), "context60": (0.3, 0.1), "context59": (0.3, 0), "coco-object": (0.5, 0.4),
                 "coco-stuff": (0.2, 0), "cityscapes": (0.3, 0), "ade20k": (0.3, 0)}  # fmt: skip
    for dataset, (confidence, prob_thd) in published.items():
        assert find_pipeline(p.pipeline_text(dataset)).name == f"sam3:{confidence:g}", dataset
        s = p.settings(dataset)
        assert (s.bg_threshold, s.resolution, s.window, s.stage_texts()) == (prob_thd, 0, 0, ()), dataset
    assert p.pipeline_text("voc20", "sam3:0.4") == "sam3:0.4"  # a pipeline given with its own constant runs as given
    voc20, version = class_vocabulary("voc20", p.class_names)
    assert version.startswith("segearth/") and ("boat", "ship") in voc20.names
    assert class_vocabulary("voc21", "segearth")[0].names[0] == ("background",)


@pytest.mark.parametrize("dataset", ["voc21", "voc20"])
def test_eval_runs_the_pipeline_with_the_protocols_constants(tmp_path, dataset):
    make_benchmark(dataset, tmp_path, n=2)
    stub = StubPrompter()
    record = evaluate(stub, dataset, tmp_path, protocol="sam3", class_names=None, progress=False, out=tmp_path / "r.json")
    c = record["config"]
    confidence, prob_thd = {"voc21": (0.5, 0.4), "voc20": (0.2, 0.0)}[dataset]
    assert (c["attention"], c["model"], c["protocol"], c["bg_threshold"]) == (f"sam3:{confidence:g}", "sam3", "sam3", prob_thd)
    assert c["class_names_version"].startswith("segearth/") and {conf for _, conf in stub.asked} == {confidence}
    bench = DATASETS.get(dataset)
    vocab, _ = class_vocabulary(dataset, "segearth")
    total = 0
    for sample in bench.samples(tmp_path):
        rgb = load_image(sample.image)
        answers = {n: state_of(stub.answer(rgb.shape[:2], n)) for n in vocab.flat_names}
        _, pred = published_labels(answers, vocab.flat_names, vocab.name_to_class, *rgb.shape[:2], prob_thd)
        total = total + intersect_and_union(pred.numpy(), bench.load_label(sample.label), bench.num_classes)
    assert record["metrics"]["mIoU"] == pytest.approx(100 * segmentation_metrics(total)["mIoU"])


def test_other_commands_and_a_clip_model_refuse_the_pipeline(tiny_clip, tmp_path):
    res = CliRunner().invoke(app, ["segment", str(tmp_path), "--classes", "a,b", "--preset", "sam3", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "only `eval` runs it" in res.stderr.strip().splitlines()[-1], res.stderr
    make_benchmark("voc21", tmp_path / "d", n=1)
    with pytest.raises(ValueError, match="its own model"):
        evaluate(tiny_clip, "voc21", tmp_path / "d", protocol="sam3", progress=False)


def test_sam3_refuses_stages():
    with pytest.raises(ValueError, match="no stages"):
        Sam3Segmenter(StubPrompter(), Vocabulary.parse("a,b"), InferenceSettings(pamr=True))


def test_eval_without_transformers_is_one_line(tmp_path, monkeypatch):
    make_benchmark("voc21", tmp_path, n=1)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    res = CliRunner().invoke(app, ["eval", "--dataset", "voc21", "--root", str(tmp_path), "--protocol", "sam3", "--device", "cpu"])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and ".[sam3]" in lines[0], res.stderr


@needs_sam3
def test_the_package_backend_on_a_cpu_is_one_line(tmp_path):
    """sam3 0.1.4 builds its model with CUDA calls: refused before any work, in one line."""
    make_benchmark("voc21", tmp_path, n=1)
    res = CliRunner().invoke(app, ["eval", "--dataset", "voc21", "--root", str(tmp_path), "--preset", "sam3:0.4", "--device", "cpu",
                                   "--proxy-weights", "sam3=package:none"])  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "CUDA only" in lines[0], res.stderr


def test_regions_sam3_without_transformers_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    make_benchmark("voc21", tmp_path, n=1)
    args = ["eval", "--dataset", "voc21", "--root", str(tmp_path), "--protocol", "corrclip", "--regions", "sam3", "--device", "cpu",
            "--pretrained", "no-such-tag"]  # fmt: skip  (a model load would fail on the tag: the regions must fail first)
    monkeypatch.setitem(sys.modules, "transformers", None)
    res = CliRunner().invoke(app, args)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and ".[sam3]" in lines[0], res.stderr


@pytest.fixture(scope="module")
def tiny_prompter():
    if not HAS_SAM3:
        pytest.skip("the sam3 package (extra .[sam3-package]) is not installed")
    from sam3_tiny import RESOLUTION, tiny_sam3_model

    from clipseg_sparse.models.sam3 import PackagePrompter

    return PackagePrompter(tiny_sam3_model(), "none", "cpu", RESOLUTION)


def test_prompter_equals_the_published_processor(tiny_prompter):
    """Masks and scores: the package's `Sam3Processor.set_text_prompt`; semantic map and presence: the lines
    SegEarth-OV3's patched processor adds, on the same `forward_grounding` outputs."""
    from PIL import Image
    from sam3.model.sam3_image_processor import Sam3Processor

    model = tiny_prompter.model
    rgb = np.random.default_rng(0).integers(0, 256, (30, 44, 3), dtype=np.uint8)
    for name, confidence in (("cat", 0.3), ("a red car", 0.0)):
        ours = tiny_prompter.prompt(tiny_prompter.set_image(rgb), name, confidence)
        proc = Sam3Processor(model, resolution=tiny_prompter.processor.resolution, device="cpu", confidence_threshold=confidence)
        state = proc.set_text_prompt(state=proc.set_image(Image.fromarray(rgb)), prompt=name)
        with torch.inference_mode():
            out = model.forward_grounding(backbone_out=state["backbone_out"], find_input=proc.find_stage, geometric_prompt=state["geometric_prompt"], find_target=None)
        semantic = F.interpolate(out["semantic_seg"], (30, 44), mode="bilinear", align_corners=False).sigmoid()
        presence = out["presence_logit_dec"].sigmoid().unsqueeze(1).squeeze().squeeze()
        assert ours.masks.shape[0] == state["masks_logits"].shape[0]
        torch.testing.assert_close(ours.masks, state["masks_logits"][:, 0])
        torch.testing.assert_close(ours.scores, state["scores"])
        torch.testing.assert_close(ours.semantic, semantic[0, 0])
        assert ours.presence == pytest.approx(float(presence))
    assert ours.masks.shape[0] == 10  # confidence 0: every query is an instance


def test_pipeline_end_to_end_on_a_tiny_random_sam3(tiny_prompter):
    vocab = Vocabulary.parse("cat|kitten,sky")
    rgb = np.random.default_rng(1).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    seg = Sam3Segmenter(tiny_prompter, vocab, confidence=0.3)
    scores = seg.scores(rgb)
    state = tiny_prompter.set_image(rgb)
    answers = {n: state_of(tiny_prompter.prompt(state, n, 0.3)) for n in vocab.flat_names}
    want, labels = published_labels(answers, vocab.flat_names, vocab.name_to_class, 20, 28, 0.0)
    torch.testing.assert_close(scores, want)
    assert np.array_equal(seg.predict_labels(rgb), labels.numpy())


def test_sam3_regions_are_prompted_with_the_segmenters_names_and_cached(tiny_clip, tmp_path):
    from clipseg_sparse.segment.segmenter import Segmenter

    stub = StubPrompter({"a": 2, "b": 1})
    source = Sam3Regions(tmp_path, prompter=stub, confidence=0.4)
    settings = InferenceSettings(resolution=32, window=0, stages=("regionvote",))
    seg = Segmenter(tiny_clip, "a,b", "qq/softmax", settings, templates="single", regions=source)
    rgb = np.random.default_rng(2).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    regions = seg.region_map(rgb, "x.jpg")
    assert stub.asked == [("a", 0.4), ("b", 0.4)]
    masks = [m.numpy() > 0.5 for n in ("a", "b") for m in stub.answer((12, 16), n).masks]
    order = sorted(range(3), key=lambda i: -masks[i].sum())  # larger masks painted first
    want = np.full((12, 16), -1)
    for i in order:
        want[masks[i]] = i
    assert np.array_equal(regions, want)
    seg.predict(rgb, "x.jpg")
    assert len(stub.asked) == 2  # the second read is the cached map
    other = Segmenter(tiny_clip, "a,c", "qq/softmax", settings, templates="single", regions=source)
    other.region_map(rgb, "x.jpg")
    assert stub.asked[2:] == [("a", 0.4), ("c", 0.4)]  # other names: other masks
    assert seg.config()["regions"] == "sam3:facebook/sam3:confidence=0.4"


def test_report_puts_sam3_beside_a_clip_preset(tiny_clip, tmp_path):
    """A sam3 result and a CLIP preset's on the same benchmark land in one table (rows: source)."""
    from clipseg_sparse.sweeps.records import collect
    from clipseg_sparse.sweeps.report import pivot

    make_benchmark("voc21", tmp_path / "d", n=1)
    evaluate(StubPrompter(), "voc21", tmp_path / "d", protocol="sam3", class_names=None, progress=False, out=tmp_path / "r" / "sam3.json")
    evaluate(tiny_clip, "voc21", tmp_path / "d", "sclip", templates="single", progress=False, out=tmp_path / "r" / "sclip.json",
             overrides=dict(resolution=64, window=32, stride=16))  # fmt: skip
    (table,) = pivot(collect([tmp_path / "r"]), rows="source", cols="dataset", metric="mIoU")
    assert sorted(table.row_values) == ["qq+kk", "sam3:0.5"] and table.col_values == ["voc21"]
    assert table.cell("sam3:0.5", "voc21") is not None and table.cell("qq+kk", "voc21") is not None


# -- the transformers backend (runs everywhere) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_prompter():
    from sam3_tiny import tiny_hf_prompter

    torch.set_num_threads(1)  # the tiny model's ops are too small for two threads on a shared 2-core machine
    return tiny_hf_prompter()


def transformers_forward(prompter, rgb, names):
    """transformers' own `Sam3Model.forward` on each name with one padded box (label -10): the sam3 package's
    prompt (text + the geometry encoder's CLS token), answered as the package processor does."""
    ids, mask = prompter.tokens(names)
    pixels = prompter.processor(images=rgb, return_tensors="pt").pixel_values.expand(len(names), -1, -1, -1)
    with torch.inference_mode():
        out = prompter.model(pixel_values=pixels, input_ids=ids, attention_mask=mask, input_boxes=torch.zeros(len(names), 1, 4),
                             input_boxes_labels=torch.full((len(names), 1), -10))  # fmt: skip
    presence = out.presence_logits.sigmoid().reshape(-1)
    size = rgb.shape[:2]
    semantic = F.interpolate(out.semantic_seg, size=size, mode="bilinear", align_corners=False).sigmoid()[:, 0]
    masks = F.interpolate(out.pred_masks, size=size, mode="bilinear", align_corners=False).sigmoid()
    return out.pred_logits.sigmoid() * presence[:, None], masks, semantic, presence


def test_transformers_prompter_equals_sam3models_own_forward(hf_prompter):
    rgb = np.random.default_rng(0).integers(0, 256, (30, 44, 3), dtype=np.uint8)
    names = ["cat", "a red car", "sky"]
    scores, masks, semantic, presence = transformers_forward(hf_prompter, rgb, names)
    got = hf_prompter.prompts(hf_prompter.set_image(rgb), names, 0.0)
    for k, answer in enumerate(got):  # 1e-5: an AVX2-only CPU (AMD EPYC) gave masks 1.3e-6 apart, AVX-512 ones < 1e-6
        torch.testing.assert_close(answer.scores, scores[k], atol=1e-5, rtol=0)
        torch.testing.assert_close(answer.masks, masks[k], atol=1e-5, rtol=0)
        torch.testing.assert_close(answer.semantic, semantic[k], atol=1e-5, rtol=0)
        assert answer.presence == pytest.approx(float(presence[k]), abs=1e-5)
    assert len({round(a.presence, 4) for a in got}) == 3  # the random model tells the prompts apart
    kept = hf_prompter.prompts(hf_prompter.set_image(rgb), names, 0.3)
    for k, answer in enumerate(kept):
        assert torch.equal(answer.scores, got[k].scores[got[k].scores > 0.3])


def test_buckets_do_not_change_a_prompts_answer(hf_prompter, monkeypatch):
    rgb = np.random.default_rng(1).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    names = ["cat", "kitten", "dog", "sky", "road"]
    state = hf_prompter.set_image(rgb)
    together = hf_prompter.prompts(state, names, 0.0)
    monkeypatch.setattr(hf_prompter, "bucket", 2)
    apart = hf_prompter.prompts(state, names, 0.0)
    for a, b in zip(together, apart):
        torch.testing.assert_close(a.masks, b.masks, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.semantic, b.semantic, atol=1e-5, rtol=0)


def test_pipeline_on_the_transformers_backend_equals_the_published_fusion(hf_prompter):
    vocab = Vocabulary.parse("cat|kitten,sky,road")
    rgb = np.random.default_rng(2).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    seg = Sam3Segmenter(hf_prompter, vocab, confidence=0.3)
    state = hf_prompter.set_image(rgb)
    answers = {n: state_of(hf_prompter.prompt(state, n, 0.3)) for n in vocab.flat_names}
    want, labels = published_labels(answers, vocab.flat_names, vocab.name_to_class, 20, 28, 0.0)
    torch.testing.assert_close(seg.scores(rgb), want)
    assert np.array_equal(seg.predict_labels(rgb), labels.numpy())
    assert seg.config()["backend"] == "transformers" and seg.config()["attention"] == "sam3:0.3"


def test_bf16_autocast_on_a_cpu_runs_near_fp32(hf_prompter):
    from sam3_tiny import tiny_hf_prompter

    rgb = np.random.default_rng(3).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    vocab = Vocabulary.parse("cat,sky")
    bf16 = tiny_hf_prompter("bf16")
    assert bf16.config()["precision"] == "bf16-autocast" and hf_prompter.config()["precision"] == "fp32"
    low, full = Sam3Segmenter(bf16, vocab, confidence=0.0).scores(rgb), Sam3Segmenter(hf_prompter, vocab, confidence=0.0).scores(rgb)
    assert low.dtype == torch.float32 and 0 < float((low - full).abs().max()) < 0.05


def test_entmax_inside_the_detector(hf_prompter):
    """entmax:1.0001 is softmax within tolerance, sparsemax changes the answer and puts exact zeros in the
    decoder's image rows, and leaving `normalized` restores SDPA bit for bit."""
    rgb = np.random.default_rng(4).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    vocab = Vocabulary.parse("cat,sky,road")
    plain = Sam3Segmenter(hf_prompter, vocab, confidence=0.0).scores(rgb)
    near = Sam3Segmenter(hf_prompter, vocab, confidence=0.0, normalizer="entmax:1.0001").scores(rgb)
    sparse = Sam3Segmenter(hf_prompter, vocab, confidence=0.0, normalizer="sparsemax").scores(rgb)
    assert float((near - plain).abs().max()) < 1e-3
    assert float((sparse - plain).abs().max()) > 1e-2
    assert torch.equal(Sam3Segmenter(hf_prompter, vocab, confidence=0.0).scores(rgb), plain)
    state = hf_prompter.set_image(rgb)
    for normalizer, zeros in (("softmax", False), ("sparsemax", True)):
        with hf_prompter.normalized(normalizer), hf_prompter.attention(("decoder-image",)) as rows:
            hf_prompter.prompts(state, ["cat"], 0.0)
        (weights,) = [w for calls in rows.values() for w in calls]
        assert weights.shape[-1] == 64 and torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)  # 8 x 8 image tokens
        assert bool((weights[:, :, 1:] == 0).any()) == zeros


def test_pipeline_texts_and_the_protocols_constants_with_a_normalizer():
    sam3 = PROTOCOLS.get("sam3")
    assert sam3.pipeline_text("voc20", "sam3-entmax") == "sam3:0.2/entmax:1.5"
    assert sam3.pipeline_text("voc21", "sam3/sparsemax") == "sam3/sparsemax"
    assert sam3.pipeline_text("voc20", "sam3:0.4") == "sam3:0.4"  # a constant given is kept
    assert find_pipeline("sam3:0.2/entmax:1.5").name == "sam3:0.2/entmax:1.5"
    assert find_pipeline("sam3-entmax").name == "sam3:0.5/entmax:1.5"
    assert find_pipeline("sam3/softmax").name == "sam3:0.5"  # SAM 3's own attention: the result keys of before
    for bad in ("sam3/entmax:3", "sam3:x/sparsemax", "sam3/nope"):
        with pytest.raises(ValueError, match="bad pipeline"):
            find_pipeline(bad)


def test_eval_reads_a_saved_model_folder_and_records_the_backend(hf_prompter, tmp_path):
    make_benchmark("voc21", tmp_path / "d", n=1)
    folder = tmp_path / "sam3-tiny"
    hf_prompter.model.save_pretrained(folder)
    hf_prompter.processor.save_pretrained(folder)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["eval", "--dataset", "voc21", "--root", str(tmp_path / "d"), "--protocol", "sam3", "--preset", "sam3-entmax", "--device", "cpu",
                                   "--proxy-weights", f"sam3={folder}", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output + res.stderr
    config = json.loads(out.read_text())["config"]
    assert config["attention"] == "sam3:0.5/entmax:1.5" and config["backend"] == "transformers" and config["pretrained"] == str(folder)


def test_missing_weights_are_one_line(tmp_path):
    make_benchmark("voc21", tmp_path / "d", n=1)
    res = CliRunner().invoke(app, ["eval", "--dataset", "voc21", "--root", str(tmp_path / "d"), "--protocol", "sam3", "--device", "cpu",
                                   "--proxy-weights", f"sam3={tmp_path / 'none-here'}"])  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "no such folder" in lines[0], res.stderr


# -- analyze / explain: the detector's query rows ---------------------------------------------------------------
def test_query_attention_is_the_decoders_image_rows_with_the_prompts_scores(hf_prompter):
    """Per name: the last decoder layer's image rows of the 10 queries (presence token dropped), each a
    distribution over the 8 x 8 tokens, with the object scores `prompts` gives; sparsemax rows have zeros."""
    vocab = Vocabulary.parse("cat|kitten,sky,road")
    rgb = np.random.default_rng(5).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    att = Sam3Segmenter(hf_prompter, vocab, confidence=0.3).query_attention(rgb)
    assert att.rows.shape == (4, 2, 10, 64) and att.grid == (8, 8) and att.name_class == (0, 0, 1, 2)
    torch.testing.assert_close(att.rows.sum(-1), torch.ones(4, 2, 10), atol=1e-5, rtol=0)
    answers = hf_prompter.prompts(hf_prompter.set_image(rgb), vocab.flat_names, 0.0)
    for k, answer in enumerate(answers):
        torch.testing.assert_close(att.scores[k], answer.scores, atol=1e-6, rtol=0)
    assert torch.equal(att.kept, att.scores > 0.3)
    with hf_prompter.normalized("softmax", ("decoder-image",)), hf_prompter.attention(("decoder-image",)) as rows:
        hf_prompter.run(hf_prompter.set_image(rgb), ["sky"], with_masks=False)
    (direct,) = [w for calls in rows.values() for w in calls]
    torch.testing.assert_close(att.rows[2], direct[0, :, 1:], atol=1e-6, rtol=0)  # a name's rows do not depend on its bucket
    sparse = Sam3Segmenter(hf_prompter, vocab, confidence=0.3, normalizer="sparsemax").query_attention(rgb)
    assert bool((sparse.rows == 0).any()) and not bool((att.rows == 0).any())


def test_analyze_and_explain_a_sam3_pipeline_from_the_command_line(hf_prompter, tmp_path, monkeypatch):
    import clipseg_sparse.methods.sam3 as sam3_module

    monkeypatch.setattr(sam3_module, "load_sam3", lambda weights, device, precision: hf_prompter)  # the tiny model for sam3=none
    make_benchmark("voc21", tmp_path / "d", n=2, size=(40, 52))
    args = ["analyze", "--dataset", "voc21", "--root", str(tmp_path / "d"), "--preset", "sam3", "--preset", "sam3-entmax",
            "--pretrained", "none", "--out", str(tmp_path / "a"), "--device", "cpu"]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    records = {json.loads(p.read_text())["config"]["attention"]: json.loads(p.read_text()) for p in (tmp_path / "a").glob("*.json")}
    assert set(records) == {"sam3:0.5", "sam3:0.5/entmax:1.5"}  # the sam3 protocol's VOC21 confidence
    soft, ent = records["sam3:0.5"]["metrics"], records["sam3:0.5/entmax:1.5"]["metrics"]
    assert soft["nonzero"] == 64 and ent["nonzero"] < 64 and ent["entropy"] < soft["entropy"]
    assert records["sam3:0.5"]["patches"] > 0 and records["sam3:0.5"]["config"]["protocol"] == "sam3"
    mixed = CliRunner().invoke(app, [*args[:7], "--preset", "sclip", "--out", str(tmp_path / "b")])
    assert mixed.exit_code == 2 and "not both" in mixed.stderr
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(6).integers(0, 256, (20, 28, 3), dtype=np.uint8)).save(image)
    res = CliRunner().invoke(app, ["explain", str(image), "--point", "5,7", "--classes", "cat,sky,road", "--preset", "sam3-entmax",
                                   "--pretrained", "none", "--out", str(tmp_path / "e.png"), "--device", "cpu"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "sam3:0.5/entmax:1.5 (query" in res.stdout and "non-zero" in res.stdout
    assert Image.open(tmp_path / "e.png").size[0] > 300
