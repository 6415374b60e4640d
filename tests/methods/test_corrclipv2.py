"""CorrCLIPv2 (zdk258/CorrCLIP@103bc18, folder CorrCLIPv2/) against a plain-torch transcription of its
`forward_slide` + `postprocess_result` on random weights and given masks.

A tiny random CLIP (3 blocks, patch 16) and a tiny NaFlexViT in C-RADIOv3's layout stand in for MetaCLIP
ViT-B/16 and C-RADIOv3-L; the spatial branch reads blocks 1..2 (the published 6..10 need 12 blocks).
Windows are 112 px (a multiple of both CLIP's patch and the published 56-pixel padding, so neither side
pads) and every window holds unsegmented pixels (the published code takes each window's smallest id as
unsegmented; here it is id -1 wherever it is).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_CONFIG, installed_backbones
from test_corrclip import published_corrclip
from test_dense_backbones import published_extract_dense, tiny_radio
from test_proxyclip import installed_tiny_dino

from clipseg_sparse import load_clip
from clipseg_sparse.attention import resolve_spec
from clipseg_sparse.segment.bank import ImageBank
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings

TINY_V2 = "ext:c_radio_v3_l.image[cos,scale:4,region]/softmax/cls:0/noffn/in:mean@1-2/mct:0.5"
NAMES = [["cat", "kitten"], ["grass"], ["sky"], ["road"]]
SETTINGS = dict(resolution=112, window=112, stride=56, logit_scale=40.0)


@pytest.fixture()
def radio(tiny_clip):
    bb = tiny_radio()
    with installed_backbones(bb, clips=[tiny_clip]):
        yield bb


@pytest.fixture(scope="module")
def deep_clip(tmp_path_factory):
    """The tiny CLIP with 24 blocks (ViT-L/14's depth): the presets' spatial branches re-run blocks 6..10
    (B/16) and 11..22 (L/14), which the 3-block tiny CLIP does not have."""
    spec = json.loads(Path(TINY_CONFIG).read_text())
    config = tmp_path_factory.mktemp("deep") / "tiny-deep.json"
    config.write_text(json.dumps({**spec, "vision_cfg": {**spec["vision_cfg"], "layers": 24}}))
    torch.manual_seed(0)
    return load_clip(str(config), pretrained=None, device="cpu")


@pytest.fixture()
def deep_bank(deep_clip, radio, tmp_path):
    """(deep CLIP, an image bank of its values) for the presets' `hook:retrieve` (tests/segment/test_bank.py's
    builder: tiny DINO values, the tiny RADIO keys), two small images."""
    from test_bank import build, write_images

    dino = installed_tiny_dino(deep_clip)
    next(dino)
    jobs, regions = write_images(tmp_path / "images", 2)
    build(tmp_path / "bank", jobs, regions, [deep_clip], radio)
    yield deep_clip, ImageBank.open(tmp_path / "bank")
    next(dino, None)  # its teardown


def image_and_regions(seed: int = 0, shape=(100, 150), n: int = 5):
    """A smooth random RGB image and blocky region ids (10 x 10 cells) with many unsegmented (-1) cells."""
    rng = np.random.default_rng(seed)
    H, W = shape
    base = rng.integers(0, 256, (H // 10 + 2, W // 10 + 2, 3)).astype(np.float32)
    rgb = F.interpolate(torch.from_numpy(base).permute(2, 0, 1)[None], (H, W), mode="bilinear", align_corners=False)[0]
    rgb = rgb.permute(1, 2, 0).clamp(0, 255).round().to(torch.uint8).numpy()
    cells = rng.integers(-1, n, (H // 10, W // 10))
    cells[rng.random(cells.shape) < 0.3] = -1
    return rgb, np.kron(cells, np.ones((10, 10), dtype=np.int64))


def published_forward_slide(seg: Segmenter, backbone, rgb, regions, text, support=None, alpha=0.5):
    """corrclip_segmentor.py forward_slide: VFM once on the raw image, features resized to the network input
    and L2-normalised; 336/112-style windows (here 112/56, no padding) through the CorrCLIP body with each
    window's crop of masks and features (features resized to 2x CLIP's grid, L2); logits averaged; fused
    alpha * own + (1 - alpha) * support at the input size (support: N x h x w or None); bilinear to the
    original size. Returns N x H x W."""
    img = seg.pixels(rgb)
    h_img, w_img = img.shape[-2:]
    vfm = published_extract_dense(backbone, rgb)
    vfm = F.normalize(F.interpolate(vfm, size=(h_img, w_img), mode="bilinear"), dim=1)
    masks = F.interpolate(torch.from_numpy(regions)[None, None].float(), size=(h_img, w_img), mode="nearest").int()
    crop, stride = seg.settings.window, seg.settings.stride
    h_grids = max(h_img - crop + stride - 1, 0) // stride + 1
    w_grids = max(w_img - crop + stride - 1, 0) // stride + 1
    preds = torch.zeros(1, len(text), h_img, w_img)
    count = torch.zeros(1, 1, h_img, w_img)
    for hi in range(h_grids):
        for wi in range(w_grids):
            y1, x1 = hi * stride, wi * stride
            y2, x2 = min(y1 + crop, h_img), min(x1 + crop, w_img)
            y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
            crop_img, crop_masks, crop_vfm = img[..., y1:y2, x1:x2], masks[0, 0, y1:y2, x1:x2], vfm[..., y1:y2, x1:x2]
            assert bool((crop_masks == -1).any()), "the test needs unsegmented pixels in every window"
            feat_shape = (crop_img.shape[-2] // 16 * 2, crop_img.shape[-1] // 16 * 2)
            dino = F.normalize(F.interpolate(crop_vfm, size=feat_shape, mode="bilinear").flatten(2, 3).transpose(1, 2), dim=-1)
            feats, _ = published_corrclip(seg.clip, None, crop_img, crop_masks.long(), None, dino_feats=dino)
            logits = (feats.reshape(-1, feats.shape[-1]) @ text.T).T.reshape(1, len(text), *feat_shape)
            preds[..., y1:y2, x1:x2] += F.interpolate(logits, size=crop_img.shape[-2:], mode="bilinear")
            count[..., y1:y2, x1:x2] += 1
    preds = preds / count
    if support is not None:
        preds = alpha * preds + (1 - alpha) * support[None]
    return F.interpolate(preds, size=rgb.shape[:2], mode="bilinear")[0]


def published_postprocess(seg_logits, query_idx, regions, logit_scale=40.0, prob_thd=0.0, background_id=0):
    """postprocess_result: softmax(40 x), max over each class's names (scatter_reduce amax), argmax,
    prob_thd -> background, then every region but the smallest id (unsegmented) takes its torch.mode."""
    seg_logit = (seg_logits * logit_scale).softmax(0)
    num_cls = max(query_idx) + 1
    idx = torch.tensor(query_idx)
    H, W = seg_logit.shape[1:]
    out = seg_logit.new_full((num_cls, H, W), float("-inf"))
    out.scatter_reduce_(0, idx.view(-1, 1, 1).expand(-1, H, W), seg_logit, reduce="amax", include_self=True)
    seg_pred = out.argmax(0, keepdim=True)
    seg_pred[out.max(0, keepdim=True)[0] < prob_thd] = background_id
    masks = torch.from_numpy(regions)
    for value in torch.unique(masks)[1:]:
        mask = value == masks.unsqueeze(0)
        seg_pred[mask] = torch.mode(seg_pred[mask])[0]
    return out, seg_pred[0]


class Given:
    """A region source that always gives the same map."""

    def __init__(self, regions: np.ndarray) -> None:
        self.regions = regions

    def __call__(self, rgb, name) -> np.ndarray:
        return self.regions

    def source(self) -> str:
        return "given"


def query_idx_of(names) -> list[int]:
    return [c for c, syn in enumerate(names) for _ in syn]


def test_whole_image_proxy_spec_equals_the_published_forward_slide(tiny_clip, radio):
    rgb, regions = image_and_regions()
    settings = InferenceSettings(**SETTINGS, stages=("regionvote",), bg_threshold=0.15)
    seg = Segmenter(tiny_clip, _vocab(), spec=TINY_V2, settings=settings, regions=Given(regions))
    cos = seg.cosine(rgb, regions).rows(0, rgb.shape[0])
    expected = published_forward_slide(seg, radio, rgb, regions, seg.text)
    torch.testing.assert_close(cos, expected, atol=2e-5, rtol=1e-4)
    probs, labels = published_postprocess(expected, query_idx_of(NAMES), regions, prob_thd=0.15)
    result = seg.predict(rgb, "x.png")
    torch.testing.assert_close(torch.as_tensor(np.asarray(result.probs)), probs, atol=1e-4, rtol=1e-4)
    assert np.array_equal(result.labels, labels.numpy())


@pytest.mark.parametrize("preset", ["corrclipv2-entmax", "corrclipv2-l14-entmax"])
def test_corrclipv2_entmax_near_one_is_the_softmax_preset(deep_bank, preset):
    """The preset's spec with entmax:ALPHA for ALPHA -> 1 tends to the softmax preset (the retrieval support,
    the same in both, fused in). Measured here, the largest cosine difference grows linearly in ALPHA - 1
    (entmax is softmax to first order), B/16 / L/14 indices: 1.6e-4 / 1.1e-4 at 1.001, 1.6e-3 / 1.1e-3 at
    1.01, 1.8e-2 / 1.2e-2 at 1.1, 5.8e-2 / 4.3e-2 at 1.5, on maps of max |cos| 0.13 / 0.09; the tolerance 1e-3
    is 6x the 1.001 difference and below the 1.01 one, and the difference must grow with ALPHA."""
    clip, bank = deep_bank
    rgb, regions = image_and_regions()
    spec = resolve_spec(preset)
    softmax_preset = resolve_spec(preset.removesuffix("-entmax"))
    assert spec.normalizer == "entmax:1.5" and spec.replace(normalizer="softmax") == softmax_preset

    def cosine(s) -> torch.Tensor:
        seg = Segmenter(clip, _vocab(), spec=s, settings=InferenceSettings(**SETTINGS), regions=Given(regions), bank=bank)
        return seg.cosine(rgb, regions).rows(0, rgb.shape[0])

    softmax = cosine(softmax_preset)
    diffs = [float((cosine(spec.replace(normalizer=f"entmax:{a}")) - softmax).abs().max()) for a in (1.001, 1.01, 1.1, 1.5)]
    assert diffs[0] < 1e-3, diffs
    assert diffs == sorted(diffs) and diffs[-1] > 1e-2, diffs


def _vocab():
    from clipseg_sparse.segment.vocabulary import Vocabulary

    return Vocabulary.from_names(NAMES)


def test_presets_and_protocol_follow_the_published_configs():
    """CorrCLIPv2/configs/cfg_*.py (+ the segmentor defaults slide_crop 336, slide_stride 112, logit_scale 40)."""
    from clipseg_sparse.attention import PRESETS
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    for name in ("corrclipv2", "corrclipv2-entmax", "corrclipv2-l14", "corrclipv2-l14-entmax", "corrclipv2-values"):
        assert name in PRESETS
    spec = PRESETS.get("corrclipv2").spec
    assert str(spec).startswith("ext:c_radio_v3_l.image[cos,scale:4,region]/softmax") and "hook:retrieve" in str(spec)
    assert "in:mean@11-22" in str(PRESETS.get("corrclipv2-l14").spec) and "entmax:1.5" in str(PRESETS.get("corrclipv2-entmax").spec)
    p = PROTOCOLS.get("corrclipv2")
    published = {
        "voc21": (336, 336, 112, 0.2), "context60": (336, 336, 112, 0.15), "coco-object": (336, 336, 112, 0.25),
        "voc20": (336, 336, 112, 0.0), "context59": (336, 336, 112, 0.0), "ade20k": (448, 336, 112, 0.0), "cityscapes": (784, 224, 112, 0.0),
    }  # fmt: skip
    for dataset, (short, window, stride, thd) in published.items():
        s = p.settings(dataset)
        assert (s.resolution, s.window, s.stride, s.bg_threshold, s.logit_scale) == (short, window, stride, thd, 40.0), dataset
        assert s.stages == ("regionvote",)
