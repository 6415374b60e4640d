"""Trident's SAM prompt refinement (stage samrefine): prompts from a hand BFS, the score rule by hand with a
stubbed predictor, and the stage end to end through Segmenter with a tiny random-init SAM (segment_anything's
modules with a 1-block, 32-wide image encoder; its prompt encoder and mask decoder at their real sizes)."""

from __future__ import annotations

import sys
from collections import deque

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import TINY_CONFIG
from clipseg_sparse.methods import trident_refine as sr
from clipseg_sparse.runtime.weights import MissingExtraError
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.runtime.weights import WeightsUnavailableError
from clipseg_sparse.stages import parse_stage


def bfs_components(half: np.ndarray, top: np.ndarray, min_area: int) -> set:
    """(class, box, point) of every 8-connected same-class component of `half` (class >= 0) with area >=
    min_area, by breadth-first search; coordinates doubled as full-resolution pixels."""
    h, w = half.shape
    seen = np.zeros_like(half, dtype=bool)
    out = set()
    for y in range(h):
        for x in range(w):
            if seen[y, x] or half[y, x] < 0:
                continue
            c, queue, pixels = half[y, x], deque([(y, x)]), []
            seen[y, x] = True
            while queue:
                py, px = queue.popleft()
                pixels.append((py, px))
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        ny, nx = py + dy, px + dx
                        if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and half[ny, nx] == c:
                            seen[ny, nx] = True
                            queue.append((ny, nx))
            if len(pixels) < min_area:
                continue
            ys, xs = [p[0] for p in pixels], [p[1] for p in pixels]
            by, bx = max(pixels, key=lambda p: top[p])
            out.add((int(c), (min(xs) * 2, min(ys) * 2, max(xs) * 2 + 1, max(ys) * 2 + 1), (bx * 2, by * 2)))
    return out


def test_component_prompts_equal_a_bfs():
    rng = np.random.default_rng(0)
    coarse = np.repeat(np.repeat(rng.integers(-1, 3, size=(9, 11)), 5, 0), 5, 1)[:41, :53]  # blocks, odd size
    top = rng.random(coarse.shape)
    prompts = sr.component_prompts(coarse, top, min_area=4)
    expected = bfs_components(coarse[::2, ::2], top[::2, ::2], 4)
    assert len(expected) > 5 and {(p.cls, p.box, p.point) for p in prompts} == expected
    assert len(prompts) == len(expected)
    for p in prompts:  # the full-size mask: the component's half-resolution pixels repeated 2 x 2
        half = p.mask[::2, ::2]
        assert np.array_equal(p.mask, np.repeat(np.repeat(half, 2, 0), 2, 1)[:41, :53]) and p.mask[p.point[1], p.point[0]]
        assert (coarse[::2, ::2][half] == p.cls).all() and half.sum() >= 4
    assert sr.component_prompts(coarse, top, min_area=10**6) == []


def test_refine_rule_by_hand():
    rng = np.random.default_rng(1)
    h, w, coarse_thresh, iou_thresh = 5, 6, 0.3, 0.8
    classes = [0, 2, 5]
    probs = torch.from_numpy(rng.random((3, h, w))).float()
    labels = torch.from_numpy(rng.integers(0, 6, (h, w)))
    region = np.zeros((h, w), dtype=bool)
    region[1:3, 2:5] = True
    prompts = [sr.Prompt(c, (0, 0, 1, 1), (0, 0), region) for c in (0, 2, 0, 5)]
    logits = torch.from_numpy(rng.normal(0, 3, (4, h, w))).float()
    ious = torch.tensor([0.9, 0.5, 0.95, 0.85])  # class 2's mask fails
    seen = []

    def predict(part, masks):
        start = sum(len(s) for s in seen)
        seen.append(masks)
        return logits[start : start + len(part)], ious[start : start + len(part)]

    out = sr.refine_labels(labels, probs, classes, prompts, predict, coarse_thresh, iou_thresh, chunk=3)
    assert [len(m) for m in seen] == [3, 1]
    for i, m in enumerate(torch.cat(seen)):  # the mask input: probability x 0.005 above coarse_thresh, else 0
        p = probs[classes.index(prompts[i].cls)]
        for y in range(h):
            for x in range(w):
                assert m[y, x].item() == pytest.approx(p[y, x].item() * 0.005 if p[y, x] > coarse_thresh else 0.0)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    for y in range(h):
        for x in range(w):
            scores = {
                0: max(sig(logits[0, y, x].item()), sig(logits[2, y, x].item())) * probs[0, y, x].item(),
                2: probs[1, y, x].item(),  # no kept mask: the coarse probability
                5: sig(logits[3, y, x].item()) * probs[2, y, x].item(),
            }
            inside = any(logits[k, y, x] > 0 for k in (0, 2, 3))  # kept masks only
            want = max(scores, key=scores.get) if inside else labels[y, x].item()
            assert out[y, x].item() == want
    # every mask dropped: the labels unchanged; a dropped component keeps its class probability inside it
    assert torch.equal(sr.refine_labels(labels, probs, classes, prompts, predict, coarse_thresh, 0.99), labels)
    # class 0 with one kept and one dropped mask: inside the dropped component its probability stays
    other = np.zeros((h, w), dtype=bool)
    other[3:, :3] = True
    pair = [prompts[0], sr.Prompt(0, (0, 0, 1, 1), (0, 0), other)]
    two = sr.refine_labels(labels, probs, classes, pair, lambda part, m: (logits[:2], torch.tensor([0.9, 0.5])), coarse_thresh, iou_thresh)
    score0 = torch.maximum(torch.sigmoid(logits[0]) * probs[0], torch.from_numpy(other) * probs[0])
    best = torch.stack([score0, probs[1], probs[2]]).argmax(0)
    assert torch.equal(two, torch.where(logits[0] > 0, torch.tensor(classes)[best], labels))


def tiny_predictor():
    from segment_anything import SamPredictor
    from segment_anything.build_sam import _build_sam

    torch.manual_seed(0)
    return SamPredictor(_build_sam(encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=1, encoder_global_attn_indexes=[0]).eval())


def test_stage_end_to_end_through_segmenter(tiny_clip, monkeypatch):
    pytest.importorskip("segment_anything")
    predictor = tiny_predictor()
    calls = []
    monkeypatch.setattr(sr, "load_sam_predictor", lambda weights, device: calls.append(weights) or predictor)
    monkeypatch.setattr(sr, "_PREDICTORS", {})
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
    coarse, top, classes, probs = sr.coarse_maps(maps, 0.0)
    assert torch.equal(torch.from_numpy(coarse), labels)  # threshold 0: the plain arg-max
    prompts = sr.component_prompts(coarse, top)
    assert prompts  # the test must exercise SAM
    with torch.inference_mode():
        want = sr.refine_labels(labels, probs, classes, prompts, sr.sam_predict(predictor, image), 0.0, 0.0)
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
    """eval's load_proxies loads SAM's predictor when a refine stage is on: bad weights fail before any work,
    with a UserError of one line (which the CLI's boundary prints as the one-line error, exit 2)."""
    from clipseg_sparse.cli import common as cli_common
    from clipseg_sparse.attention import resolve_spec
    from clipseg_sparse.errors import UserError

    monkeypatch.setattr(sr, "_PREDICTORS", {})
    with pytest.raises(UserError) as error:
        cli_common.load_proxies(resolve_spec("clip"), tiny_clip, "sam_vitb=hub", ["samrefine:0.2"])
    assert "sam_vitb=PATH" in str(error.value) and "\n" not in str(error.value)
    cli_common.load_proxies(resolve_spec("clip"), tiny_clip, "none", ())  # no refine stage: SAM is not loaded
    assert sr._PREDICTORS == {}


def test_trident_samrefine_protocol_adds_the_stage_per_dataset():
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    plain, refined = PROTOCOLS.get("trident"), PROTOCOLS.get("trident-samrefine")
    coarse = {"voc21": "0.2", "voc20": "0.2", "context60": "0.15", "context59": "0.15", "coco-object": "0.25", "coco-stuff": "0.05", "cityscapes": "0.1", "ade20k": "0.05"}
    for dataset, c in coarse.items():
        base = plain.settings(dataset, {})
        assert refined.settings(dataset, {}) == base.replace(stages=(*base.stages, f"samrefine:{c}:0.8"))
    assert plain.settings("voc21", {}).stage_texts() == ("sam:1.2",)  # off by default, as the published config
