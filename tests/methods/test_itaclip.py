"""ITACLIP (presets `itaclip`, `itaclip-entmax`, taps `qq@L` / `kk@L`, option `tta`, forward `views`, refine stage
`close`, protocol `itaclip`) against a transcription of m-arda-aydn/ITACLIP@521a33c (`clip/model.py`:
`VisionTransformer.forward`, `custom_attn`, `use_saved_attn`; `itaclip_segmentor.py`: `forward_feature`,
`get_flipped_logits`, `forward_slide`, `postprocess_result`), run on a random-init ViT-B/16; the views with
torchvision's transforms, as the code applies them, the closing with cv2."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms as T

from conftest import window_run
from sclip_line_reference import block, embed, heads, labels_off_ties, merge, sclip_postprocess, slide_inference, structured
from test_stages import reference_pamr
from clipseg_sparse.attention import AttentionSpec, attention_maps
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.methods import itaclip
from clipseg_sparse.segment.labels import ClassMaps
from clipseg_sparse.segment.maps import DenseMap
from clipseg_sparse.segment.plan import Plan
from clipseg_sparse.stages import parse_stage, pamr


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory):
    """A random 12-block, width-64 ViT/16 at 64 px (ITACLIP reads blocks 7, 8, 10), fast enough for five views of
    several windows."""
    from clipseg_sparse import load_clip

    config = {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 64, "layers": 12, "width": 64, "patch_size": 16, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1},
    }
    path = tmp_path_factory.mktemp("itaclip") / "deep-tiny.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    return load_clip(str(path), pretrained=None, device="cpu")


# -- transcription (model.py l.229-330, itaclip_segmentor.py l.108-230) -------------------------------------------
def ref_self_attn(attn, u):
    """custom_attn(return_attn=True, attn_self=True): softmax(s q q^T) + softmax(s k k^T), H x N x N."""
    q, k, _ = heads(attn, u)
    scale = q.shape[-1] ** -0.5
    return F.softmax(torch.bmm(q, q.transpose(1, 2)) * scale, dim=-1) + F.softmax(torch.bmm(k, k.transpose(1, 2)) * scale, dim=-1)


@torch.no_grad()
def ref_encode_image(visual, img, maps=None):
    """VisionTransformer.forward(return_all=True, attn_self=True), batch 1: N x D, CLS first."""
    x, _, _ = embed(visual, img)
    blocks = visual.transformer.resblocks
    attn_list = []
    for count, blk in enumerate(blocks[:-1], start=1):
        if count in [7, 8, 10]:
            attn_list.append(ref_self_attn(blk.attn, blk.ln_1(x)))
        x = block(blk, x)
    avg_attn = torch.mean(torch.stack(attn_list), dim=0)
    last = blocks[-1]
    avg_attn = 0.5 * ref_self_attn(last.attn, last.ln_1(x)) + 0.5 * avg_attn
    if maps is not None:
        maps.append(avg_attn)
    _, _, v = heads(last.attn, last.ln_1(x))
    x = x + merge(last.attn, torch.bmm(avg_attn, v))
    return visual.ln_post(x) @ visual.proj


def _normed(visual, img):
    f = ref_encode_image(visual, img)
    return f / f.norm(dim=-1, keepdim=True)


@torch.no_grad()
def ref_forward_feature(visual, img, text, lam):
    """forward_feature with img_engineering: 1 x Q x H x W logits of one crop."""
    img_list = [_normed(visual, img)]
    for transform in [T.Grayscale(), T.GaussianBlur(kernel_size=11, sigma=5)]:
        new_img = transform(img.squeeze()).unsqueeze(0)
        if new_img.shape[1] == 1:
            new_img = new_img.expand(1, 3, -1, -1)
        img_list.append(_normed(visual, new_img))
    flip_transforms = [T.RandomVerticalFlip(p=1), T.RandomHorizontalFlip(p=1)]
    flip_list = [_normed(visual, t(img.squeeze()).unsqueeze(0)) for t in flip_transforms]
    image_features = torch.mean(torch.stack(img_list), dim=0)[1:]
    logits = image_features @ text.T
    w, h = img.shape[-2] // 16, img.shape[-1] // 16
    out_dim = logits.shape[-1]
    logits = F.interpolate(logits.T.reshape(1, out_dim, w, h), size=img.shape[-2:], mode="bilinear")
    flip_logits = []
    for i, f in enumerate(flip_list):
        fl = F.interpolate((f[1:] @ text.T).T.reshape(1, out_dim, w, h), size=img.shape[-2:], mode="bilinear")
        flip_logits.append(flip_transforms[i](fl))
    return lam * logits + (1 - lam) * torch.mean(torch.stack(flip_logits), dim=0)


@torch.no_grad()
def ref_predict(visual, img, text, query_idx, ori_shape, lam, logit_scale, prob_thd, area_thd, crop=224, stride=28):
    """forward_slide with PAMR (10, (8, 16)) and postprocess_result before the closing."""
    preds = slide_inference(lambda c: ref_forward_feature(visual, c, text, lam), img, crop, stride)
    logits = F.interpolate(preds, size=ori_shape, mode="bilinear")
    guide = F.interpolate(img, size=ori_shape, mode="bilinear")
    refined = reference_pamr(logits[0], guide[0], 10, (8, 16))
    return (logits[0], refined, *sclip_postprocess(refined, query_idx, logit_scale, prob_thd, area_thd))


# -- the preset against the transcription ------------------------------------------------------------------------
def test_itaclip_attention_equals_the_published_one(vit_b16):
    """One view: the last block's map and the features (window alone: `encode_dense` is the original view)."""
    pixels = structured(2, (224, 224), seed=3)
    with torch.no_grad():
        ours = vit_b16.encode_dense(pixels, "itaclip").reshape(2, 196, -1)
        ours_maps = attention_maps(vit_b16, pixels, "itaclip")
    for b in range(2):
        maps = []
        ref = ref_encode_image(vit_b16.visual, pixels[b : b + 1], maps)
        assert (ours[b] - F.normalize(ref[1:], dim=-1)).abs().max() < 1e-4
        assert (ours_maps[b] - maps[0]).abs().max() < 1e-5


def test_itaclip_pipeline_equals_the_published_one(deep_tiny):
    """Three 64 px windows at stride 16, five views each, VOC21's lambda 0.7, logit scale 60, prob_thd and area_thd,
    PAMR: cosine, refined cosine and probabilities within 1e-4, labels equal off near-ties."""
    pixels = structured(1, (64, 96), seed=5)
    text = F.normalize(torch.randn(6, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
    query_idx = [0, 0, 1, 2, 3, 4]
    logits, refined, probs, labels = ref_predict(deep_tiny.visual, pixels, text, query_idx, (80, 120), 0.7, 60.0, 0.1, 0.1, 64, 16)
    spec = itaclip.PROTOCOL.spec_for("voc21")
    run = window_run(deep_tiny, pixels, spec, text, window=64, stride=16, remainder="drop", pos_interp="scale")
    cos = itaclip.views_cosine(run, (80, 120)).rows(0, 80)
    assert (cos - logits).abs().max() < 1e-4
    guide = F.interpolate(pixels, size=(80, 120), mode="bilinear")[0]
    ours_refined = pamr(cos, guide)
    assert (ours_refined - refined).abs().max() < 1e-4
    maps = ClassMaps(DenseMap(ours_refined), query_idx, 5, 60.0, area_threshold=0.1)
    ours = torch.from_numpy(np.concatenate([band for _, _, band in maps.numpy_bands()], axis=1))
    assert (ours - probs).abs().max() < 1e-4
    got = torch.from_numpy(maps.labels(0.1, 0.1))
    sure = labels_off_ties(probs)
    assert sure.float().mean() > 0.9 and torch.equal(got[sure], labels[sure])


# -- the pieces against torchvision, cv2 and direct computations ---------------------------------------------------
def test_grayscale_and_blur_are_torchvisions():
    x = torch.randn(2, 3, 40, 36, generator=torch.Generator().manual_seed(0))
    for b in range(2):
        assert torch.allclose(itaclip.grayscale(x)[b], T.Grayscale()(x[b]).expand(3, -1, -1), atol=1e-6)
        assert torch.allclose(itaclip.gaussian_blur(x)[b], T.GaussianBlur(kernel_size=11, sigma=5)(x[b]), atol=1e-5)


def test_views_flip_back_on_the_grid():
    """With an encoder that returns its input's pixels as features, every view maps back onto the original."""
    x = torch.rand(1, 3, 8, 6, generator=torch.Generator().manual_seed(0))
    flat = itaclip.view_features(lambda v: v.permute(0, 2, 3, 1), x, 0.0)
    assert torch.allclose(flat, x.permute(0, 2, 3, 1))
    both = itaclip.view_features(lambda v: v.permute(0, 2, 3, 1), x, 0.4)
    plain = x.permute(0, 2, 3, 1)
    mixed = (plain + itaclip.grayscale(x).permute(0, 2, 3, 1) + itaclip.gaussian_blur(x).permute(0, 2, 3, 1)) / 3
    assert torch.allclose(both, 0.4 * mixed + 0.6 * plain, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_close_is_cv2_morph_close(seed):
    labels = torch.from_numpy(np.random.default_rng(seed).integers(0, 6, (23, 31))).long()
    want = cv2.morphologyEx(labels.numpy().astype(np.uint8), cv2.MORPH_CLOSE, cv2.getStructuringElement(cv2.MORPH_RECT, (3, 3)))
    assert torch.equal(itaclip.close_labels(labels), torch.from_numpy(want.astype(np.int64)))
    stage = parse_stage("close")
    assert stage.kind == "refine" and stage.name == "close:3" and torch.equal(stage(labels, None, None), itaclip.close_labels(labels))


def test_qq_at_a_block_reads_that_blocks_own_input(tiny_clip):
    """`qq@2/softmax/nores/noffn`: softmax(s q_2 q_2^T) of block 2's ln_1 input, applied to the last block's values."""
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        maps = attention_maps(tiny_clip, pixels, "qq@2/softmax/nores/noffn")
        x, _ = tiny_clip._embed(pixels)
        blocks = tiny_clip.visual.transformer.resblocks
        x1 = blocks[0](x)
        q, _, _ = heads(blocks[1].attn, blocks[1].ln_1(x1[0]))
        want = F.softmax(q @ q.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
    assert (maps[0] - want).abs().max() < 1e-6


@pytest.mark.parametrize("bad", ["qq@1/softmax", "kk@x/softmax", "itaclip/tta:1.5", "itaclip/tta:x"])
def test_bad_taps_and_options_are_refused(bad):
    with pytest.raises(UserValueError):
        AttentionSpec.parse(bad)


def test_bad_close_and_views_with_regions_are_refused():
    with pytest.raises(UserValueError):
        parse_stage("close:2")
    with pytest.raises(UserValueError, match="flips"):
        Plan.of("ext:dino_vitb8[cos,region:0.2]/softmax/cls:0/noffn/tta:0.75")


# -- entmax, protocol, grid ---------------------------------------------------------------------------------------
def test_itaclip_entmax_tends_to_itaclip(deep_tiny):
    pixels = structured(1, (64, 64), seed=3)
    text = F.normalize(torch.randn(4, 64, generator=torch.Generator().manual_seed(2)), dim=-1)
    cos = {}
    for spec in ("itaclip", "itaclip/entmax:1.0001", "itaclip-entmax"):
        run = window_run(deep_tiny, pixels, spec, text, window=64, stride=32, remainder="drop")
        cos[spec] = itaclip.views_cosine(run).rows(0, 64)
    assert (cos["itaclip/entmax:1.0001"] - cos["itaclip"]).abs().max() < 1e-3
    assert (cos["itaclip-entmax"] - cos["itaclip"]).abs().max() > 2e-3
    assert AttentionSpec.parse("itaclip-entmax") == AttentionSpec.parse("itaclip").replace(normalizer="entmax:1.5")


# typed from m-arda-aydn/ITACLIP@521a33c configs/cfg_*.py (model dicts and Resize scales)
ITACLIP_PUBLISHED = {
    "voc21": dict(resolution=336, window=224, stride=28, logit_scale=60, bg_threshold=0.1, area_threshold=0.1, pamr=True, tta=0.7),
    "context60": dict(resolution=336, window=224, stride=28, logit_scale=55, bg_threshold=0.1, pamr=True, tta=0.75),
    "coco-object": dict(resolution=336, stride=28, logit_scale=50, bg_threshold=0.1, pamr=True, tta=0.75),
    "coco-stuff": dict(resolution=448, stride=28, logit_scale=40, bg_threshold=0, pamr=True, tta=0.75),
    "cityscapes": dict(resolution=560, stride=28, logit_scale=40, bg_threshold=0, pamr=True, tta=0.7),
}


@pytest.mark.parametrize("dataset", list(ITACLIP_PUBLISHED))
def test_itaclip_protocol_matches_the_published_configs(dataset):
    settings = itaclip.PROTOCOL.settings(dataset)
    want = dict(ITACLIP_PUBLISHED[dataset])
    assert float(itaclip.PROTOCOL.spec_for(dataset).extra("tta")) == want.pop("tta")
    for name, value in want.items():
        assert getattr(settings, name) == pytest.approx(value), name
    assert settings.stages == ("close:3",) and (settings.resize, settings.pos_interp, settings.remainder) == ("opencv", "scale", "drop")
    assert itaclip.PROTOCOL.attention == "itaclip" and itaclip.PROTOCOL.class_names == "itaclip"


def test_itaclip_class_files_are_its_own():
    from clipseg_sparse.datasets.classnames import class_vocabulary

    voc, version = class_vocabulary("voc21", "itaclip")
    assert version.startswith("itaclip/voc21.txt@") and "avian" in voc.names[3] and "helmet" in voc.names[0]
    assert class_vocabulary("ade20k", "itaclip")[1].startswith("itaclip/ade20k.txt@")  # SCLIP's file, no ITACLIP one


def test_itaclip_grid_and_published_numbers():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("itaclip")).grid
    assert g.protocol == "itaclip" and list(g.presets) == ["itaclip"] and list(g.normalizers) == ["softmax", "entmax:1.5"]
    assert set(g.datasets) == set(DATASETS.names())
    from clipseg_sparse.evaluation.published import PUBLISHED

    row = PUBLISHED.get("itaclip")
    assert set(row.miou) == {"voc21", "context60", "coco-object", "coco-stuff", "cityscapes"} and row.average is None  # the README's five
