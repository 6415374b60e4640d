"""Trident's SAM prompt refinement (stage samrefine): prompts from a hand BFS, the half-resolution maps
against F.interpolate, the score rule by hand with a stubbed predictor, and the stage end to end through
Segmenter with a tiny random-init SAM (segment_anything's modules with a 1-block, 32-wide image encoder; its
prompt encoder and mask decoder at their real sizes). The whole rule against a transcription of the
published `sam_refinement`: tests/methods/test_trident_published.py. One SAM encoder pass for both Trident
stages: the `sam` stage's pass against set_image, and the predictor's own encoder counted in a Trident run."""

from __future__ import annotations

import sys
from collections import deque
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from conftest import TINY_CONFIG
from clipseg_sparse.methods import trident_refine as sr
from clipseg_sparse.runtime.weights import MissingExtraError
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.runtime.weights import WeightsUnavailableError
from clipseg_sparse.stages import parse_stage


class Maps:
    """A ClassMaps stand-in: C x H x W probabilities served in bands of `step` rows."""

    def __init__(self, probs: torch.Tensor, step: int = 7) -> None:
        self.probs, self.shape = probs, tuple(probs.shape)
        self.bands = [(y, min(y + step, probs.shape[1])) for y in range(0, probs.shape[1], step)]

    def rows(self, y0: int, y1: int) -> torch.Tensor:
        return self.probs[:, y0:y1]


def bfs_components(half: np.ndarray, probs: torch.Tensor, coarse_thresh: float, min_area: int) -> set:
    """(class, box, point) of every 8-connected same-class component of `half` with area >= min_area, by
    breadth-first search, where the top probability reaches coarse_thresh; classes whose probability never
    does skipped; box corners inclusive; point: the first pixel (row-major) of highest class probability."""
    h, w = half.shape
    top = probs.max(0).values.numpy()
    usable = (top >= coarse_thresh) if coarse_thresh > 0 else np.ones_like(half, dtype=bool)
    seen = np.zeros_like(half, dtype=bool)
    out = set()
    for y in range(h):
        for x in range(w):
            if seen[y, x] or not usable[y, x]:
                continue
            c, queue, pixels = half[y, x], deque([(y, x)]), []
            seen[y, x] = True
            while queue:
                py, px = queue.popleft()
                pixels.append((py, px))
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        ny, nx = py + dy, px + dx
                        if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and usable[ny, nx] and half[ny, nx] == c:
                            seen[ny, nx] = True
                            queue.append((ny, nx))
            if len(pixels) < min_area or probs[c].max() < coarse_thresh:
                continue
            ys, xs = [p[0] for p in pixels], [p[1] for p in pixels]
            by, bx = min(pixels, key=lambda p: (-probs[c][p].item(), p))
            out.add((int(c), (min(xs), min(ys), max(xs), max(ys)), (bx, by)))
    return out


def test_component_prompts_equal_a_bfs():
    rng = np.random.default_rng(0)
    half = np.repeat(np.repeat(rng.integers(0, 3, size=(9, 11)), 5, 0), 5, 1)[:41, :53]  # blocks, odd size
    probs = torch.from_numpy(rng.random((3, *half.shape))).float()
    for coarse in (0.0, 0.5):
        prompts = sr.component_prompts(half, probs, coarse, min_area=4)
        expected = bfs_components(half, probs, coarse, 4)
        assert len(expected) > 5 and len(prompts) == len(expected)
        assert {(p.cls, p.box, p.point) for p in prompts} == expected
        assert [p.cls for p in prompts] == sorted(p.cls for p in prompts)  # class order
    assert sr.component_prompts(half, probs, 0.0, min_area=10**6) == []
    assert sr.component_prompts(half, probs * 0.1, 0.2, min_area=1) == []  # nothing reaches coarse_thresh


@pytest.mark.parametrize("size", [(30, 40), (31, 45), (17, 9)])
def test_half_probabilities_equal_interpolate_band_by_band(size):
    probs = torch.rand(4, *size)
    want = F.interpolate(probs[None], size=(size[0] // 2, size[1] // 2), mode="bilinear", align_corners=False)[0]
    for step in (1, 4, 100):
        torch.testing.assert_close(sr.half_probabilities(Maps(probs, step)), want, atol=1e-6, rtol=0)


def test_refine_rule_by_hand():
    """The rule of `map_refinement_coarse`: per class the max over its kept masks of sigmoid(logit) x its
    probability, times the union of those masks; classes without a kept mask 0; labels change where any
    class scores above 0; dropped masks change nothing. The mask input is the class's half-resolution
    probability resized to the 256 frame, x 0.005 above coarse_thresh."""
    rng = np.random.default_rng(1)
    h, w, coarse, iou_thresh = 10, 12, 0.3, 0.8
    probs = torch.from_numpy(rng.random((6, h, w))).float()
    half = sr.half_probabilities(Maps(probs))
    labels = torch.from_numpy(rng.integers(0, 6, (h, w)))
    prompts = [sr.Prompt(c, (k, k, k + 1, k + 1), (k, k)) for k, c in enumerate((0, 2, 0, 5, 5))]
    logits = torch.from_numpy(rng.normal(0, 3, (5, h, w))).float()
    ious = torch.tensor([0.9, 0.5, 0.95, 0.85, 0.3])  # class 2's mask and one of class 5's fail
    calls = []

    def predict(part, masks):  # prompt k gets logits[k], ious[k]
        calls.append((part, masks))
        rows = [prompts.index(q) for q in part]
        return logits[rows], ious[rows]

    out = sr.refine_labels(labels, Maps(probs), half, prompts, predict, coarse, iou_thresh, chunk=1)
    assert [[q.cls for q in part] for part, _ in calls] == [[0], [0], [2], [5], [5]]  # one class per call, in order
    low = (int(h * 256 / w + 0.5), 256)
    for part, masks in calls:
        r = F.interpolate(half[part[0].cls][None, None], size=low, mode="bilinear", align_corners=False)[0, 0]
        assert masks.shape == (1, 256, 256) and (masks[0, low[0] :] == 0).all()
        torch.testing.assert_close(masks[0, : low[0]], torch.where(r > coarse, r * 0.005, torch.zeros_like(r)))
    sig = torch.sigmoid(logits)
    for y in range(h):
        for x in range(w):
            scores = {}
            for c, kept in ((0, (0, 2)), (5, (3,))):
                covered = any(logits[k, y, x] > 0 for k in kept)
                scores[c] = max(sig[k, y, x].item() * probs[c, y, x].item() for k in kept) if covered else 0.0
            want = max(scores, key=scores.get) if max(scores.values()) > 0 else labels[y, x].item()
            assert out[y, x].item() == want
    calls.clear()
    assert torch.equal(sr.refine_labels(labels, Maps(probs), half, prompts, predict, coarse, 0.99), labels)  # all dropped


def tiny_predictor():
    from segment_anything import SamPredictor
    from segment_anything.build_sam import _build_sam

    torch.manual_seed(0)
    sam = _build_sam(encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=1, encoder_global_attn_indexes=[0]).eval()
    with torch.no_grad():
        sam.mask_decoder.iou_prediction_head.layers[-1].bias += 1.0  # predicted IoUs above 0
    return SamPredictor(sam)


def test_stage_end_to_end_through_segmenter(tiny_clip, monkeypatch):
    pytest.importorskip("segment_anything")
    predictor = tiny_predictor()
    calls = []
    monkeypatch.setattr(sr, "load_sam_predictor", lambda weights, device: calls.append(weights) or predictor)
    monkeypatch.setattr(tiny_clip, "_proxies", None)  # SAM's predictor is held by the run's backbones: none yet
    rng = np.random.default_rng(2)
    image = np.zeros((96, 96, 3), dtype=np.uint8)
    image[:, :48] = (200, 30, 30)
    image[:, 48:] = (20, 200, 60)
    image = np.clip(image + rng.integers(0, 20, image.shape), 0, 255).astype(np.uint8)
    settings = InferenceSettings(resolution=64, window=0)
    plain = Segmenter(tiny_clip, "red,green,sky", spec="clip", settings=settings)
    refined = Segmenter(tiny_clip, "red,green,sky", spec="clip", settings=settings.replace(stages=("samrefine:0:0",)))
    assert refined.config()["stages"] == ["samrefine:0:0"]
    maps = plain.class_maps(image)
    labels = torch.from_numpy(maps.labels())
    want = sr.sam_refine(labels, maps, image, predictor, 0.0, 0.0)
    got = refined.predict_labels(image)
    assert calls == ["none"] and np.array_equal(got, want.numpy())
    assert (got != labels.numpy()).sum() > 100  # the random SAM changes labels: the stage did run
    assert np.array_equal(refined.predict(image).probs, plain.predict(image).probs)  # saved: before the stage


def test_stage_text_errors_and_listing():
    from clipseg_sparse.cli.app import app

    assert parse_stage("samrefine").name == "samrefine:0.2:0.8" and parse_stage("samrefine:0.05").name == "samrefine:0.05:0.8"
    for bad in ("samrefine:x", "samrefine:0.2:2", "samrefine:1:1:1"):
        with pytest.raises(ValueError, match="expected samrefine"):
            parse_stage(bad)
    result = CliRunner().invoke(app, ["ls", "stages"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "samrefine" in result.output and "refine: Trident's SAM prompt" in result.output


def test_missing_package_and_weights_are_one_line_errors(monkeypatch):
    with pytest.raises(WeightsUnavailableError, match="sam_vitb=PATH"):
        sr.load_sam_predictor("hub", torch.device("cpu"))
    with pytest.raises(WeightsUnavailableError, match="missing.pth: cannot load"):
        sr.load_sam_predictor("missing.pth", torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "segment_anything", None)  # import fails
    with pytest.raises(MissingExtraError, match=r"samrefine .*'segment_anything'.*pip install") as err:
        sr.load_sam_predictor("none", torch.device("cpu"))
    assert "\n" not in str(err.value)


def test_cli_loads_sam_before_any_image(tiny_clip, monkeypatch):
    """Binding a run's resources loads SAM's predictor when a refine stage is on (the stage's `load`): bad
    weights fail before any work, with a UserError of one line (which the CLI's boundary prints as the
    one-line error, exit 2)."""
    from clipseg_sparse.errors import UserError
    from clipseg_sparse.segment.plan import Plan
    from clipseg_sparse.segment.resources import Resources

    with pytest.raises(UserError) as error:
        Resources(proxy_weights="sam_vitb=hub").bind(Plan.of("clip", InferenceSettings(stages=("samrefine:0.2",))), tiny_clip)
    assert "sam_vitb=PATH" in str(error.value) and "\n" not in str(error.value)
    bound = Resources(proxy_weights="none").bind(Plan.of("clip"), tiny_clip)  # no refine stage: SAM is not loaded
    assert bound.backbones._held == {} and bound.backbones._loaded == {}


def test_trident_samrefine_protocol_adds_the_stage_per_dataset():
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    plain, refined = PROTOCOLS.get("trident"), PROTOCOLS.get("trident-samrefine")
    coarse = {"voc21": "0.2", "voc20": "0.2", "context60": "0.15", "context59": "0.15", "coco-object": "0.25", "coco-stuff": "0.05", "cityscapes": "0.1", "ade20k": "0.05"}
    for dataset, c in coarse.items():
        base = plain.settings(dataset, {})
        assert refined.settings(dataset, {}) == base.replace(stages=(*base.stages, f"samrefine:{c}:0.8"))
    assert plain.settings("voc21", {}).stage_texts() == ("sam:1.2",)  # off by default, as the published config


# -- one SAM encoder pass for both stages -------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_sam(tiny_clip):
    """A tiny DINO as dino_vitb16 and a tiny segment_anything SAM at SAM's real 1024-px geometry (2 blocks of
    width 32, the second global, random relative positions) as the predictor and, through timm's converter, as
    sam_vitb: both stages read the same weights, as with --proxy-weights sam_vitb=sam_vit_b_01ec64.pth."""
    from segment_anything import SamPredictor

    from conftest import installed_backbones
    from test_trident_published import tiny_trident_networks

    dino_bb, sam_bb, sam = tiny_trident_networks()
    with installed_backbones(dino_bb, sam_bb, clips=[tiny_clip]):
        yield tiny_clip, sam_bb, SamPredictor(sam)


def test_the_sam_stages_encoding_equals_set_image(shared_sam):
    """The `sam` stage's pass (timm's SAM, eps 1e-6) finished by `SamEncoding.embedding` gives SamPredictor's
    state after set_image on the same image: sizes exactly, the 1 x 256 x 64 x 64 embedding to float rounding.
    (SAM ViT-B itself, random weights through a saved checkpoint and the timm loader, 480 x 640: max |diff|
    1.2e-5 of values up to 4.8; benchmarks/README.md, Trident's SAM stages.)"""
    from clipseg_sparse.methods import trident

    _, sam_bb, predictor = shared_sam
    image = trident.sam_image(np.random.default_rng(3).integers(0, 256, (150, 200, 3), dtype=np.uint8))
    kept = {}
    trident.sam_maps(image, sam_bb, kept)
    encoding = kept[trident.SAM_ENCODING]
    predictor.set_image(image)
    assert (encoding.input_size, encoding.original_size) == (predictor.input_size, predictor.original_size) == ((788, 1024), (160, 208))
    embedding = encoding.embedding()
    assert embedding.shape == predictor.features.shape == (1, 256, 64, 64)
    torch.testing.assert_close(embedding, predictor.features, atol=1e-5, rtol=1e-5)
    assert sr.same_encoder(predictor, sam_bb)


def test_same_encoder_needs_the_very_weights(shared_sam):
    """A different draw (weights "none": segment_anything's and timm's random SAMs) or another precision is not
    the predictor's encoder, so its pass would not be set_image's."""
    import copy

    _, sam_bb, predictor = shared_sam
    other = copy.deepcopy(predictor)
    with torch.no_grad():
        other.model.image_encoder.blocks[1].attn.rel_pos_h[0, 0] += 1e-3
    assert not sr.same_encoder(other, sam_bb)
    assert not sr.same_encoder(copy.deepcopy(predictor), type(sam_bb)(sam_bb.info, copy.deepcopy(sam_bb.model).bfloat16()))


def trident_segmenter(clip, sam_stage: str) -> Segmenter:
    """VOC21's trident protocol scaled to the tiny models (150 x 200 -> 128 x 160, 112-px windows at stride 48),
    with the `sam` stage given and the refinement at IoU 0.45 (some of the random SAM's masks pass)."""
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    settings = PROTOCOLS.get("trident").settings("voc21", dict(resolution=112, window=112, stride=48, stages=(sam_stage, "samrefine:0.2:0.45")))
    return Segmenter(clip, "background,cat,dog,grass", spec="trident", settings=settings, templates="single")


@contextmanager
def encoder_calls(predictor) -> Iterator[list]:
    """The calls of the predictor's own image encoder inside the block."""
    calls = []
    hook = predictor.model.image_encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        hook.remove()


def test_the_predictor_reuses_the_sam_stages_pass(shared_sam, monkeypatch):
    """Trident with `sam` and `samrefine` on shared weights: SAM's image encoder runs once (the `sam` stage's;
    the predictor's own never), and the refined labels equal those of two passes (the predictor's set_image,
    `kept_encoding` off) but where the two embeddings' float rounding (< 1e-5) moves a mask logit across 0 or
    a score across another: at most 0.01 % of the pixels (none on this machine)."""
    from test_trident_published import scene

    clip, _, predictor = shared_sam
    monkeypatch.setattr(sr, "load_sam_predictor", lambda weights, device: predictor)
    seg, img = trident_segmenter(clip, "sam:1.2"), scene(0, (150, 200))
    with encoder_calls(predictor) as calls:
        once = seg.predict(img)
        assert calls == []
        monkeypatch.setattr(sr, "kept_encoding", lambda run, predictor: None)
        twice = seg.predict_labels(img)
        assert calls == [1]
    probs = torch.from_numpy(once.probs)  # before the refinement
    assert (twice != torch.where(probs.max(0).values < 0.2, 0, probs.argmax(0)).numpy()).sum() > 500  # it changed labels
    assert (once.labels != twice).sum() <= twice.size // 10_000


def test_the_predictor_encodes_after_sam_on_halves(shared_sam, monkeypatch):
    """With `halves` (Cityscapes) the `sam` stage sees other pixels than SamPredictor: it keeps no pass, and the
    predictor encodes the image itself."""
    from test_trident_published import scene

    clip, _, predictor = shared_sam
    monkeypatch.setattr(sr, "load_sam_predictor", lambda weights, device: predictor)
    with encoder_calls(predictor) as calls:
        trident_segmenter(clip, "sam:1.2:halves").predict_labels(scene(0, (150, 200)))
    assert calls == [1]
