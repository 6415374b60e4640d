"""RF-CLIP (presets `rfclip`, `rfclip-entmax`, options `denoise`, `refocus`, `presence`, forward `refocus`, protocols
`rfclip`, `rfclip-pamr`) against a transcription of
liblacklucy/RF-CLIP@c2b333e (`clip/model.py`: `VisionTransformer.forward`, `attn_refocusing` ('vanilla'),
`last_attn`, `feat_denoising`, `feat_enhancing`; `custom_segmentor.py`: `hierarchical_clustering` (scipy's linkage
and fcluster), `hierarchical_prompt`, `forward_feature`, `forward_slide`, `predict`, `postprocess_result`), on a
random-init ViT-B/16 and a random 12-block tiny ViT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import window_run
from sclip_line_reference import embed, heads, labels_off_ties, merge, sclip_postprocess, slide_inference, structured
from test_itaclip import deep_tiny  # noqa: F401 - the 12-block tiny ViT fixture
from test_presence import ref_clusters, ref_hierarchical_prompt
from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.methods import rfclip
from clipseg_sparse.segment.labels import ClassMaps
from clipseg_sparse.segment.plan import Plan

TINY_SINKS = [3, 17, 40, 61]
TINY_SPEC = "kk/softmax/cls:0/noffn/denoise:1.3,0.4,3;17;40;61/refocus:0.4/presence:complete,{w},{a},{t}{src}"


# -- transcription ---------------------------------------------------------------------------------------------------
def ref_feat_denoising(x, n_patches, sink_channel, sigma=5.0, alpha=0.4):
    """feat_denoising (last=False) on N+1 x C tokens, batch 1."""
    x_clone = x.clone()[:, None, :]
    feat = x_clone[1:, :, :]
    feat_min = feat.min(dim=-1, keepdim=True)[0]
    feat_norm = (feat - feat_min) / (feat - feat_min).sum(dim=-1, keepdim=True).clamp(min=1e-8)
    sink_value, _ = feat_norm[:, :, sink_channel].max(dim=-1)
    mask = sink_value > sigma * (1.0 / feat.shape[-1])
    B, N, C = feat.shape[1], feat.shape[0], feat.shape[2]
    H, W = n_patches
    feat_2d = feat.view(H, W, B, C).permute(2, 3, 0, 1)
    avg_conv = nn.Conv2d(C, C, kernel_size=3, padding=1, bias=False, groups=C)
    nn.init.constant_(avg_conv.weight, 1 / 9)
    neighbor_avg = avg_conv(feat_2d)
    feat_denoised = torch.where(mask.view(H, W, B).permute(2, 0, 1).unsqueeze(1), neighbor_avg, feat_2d)
    feat_processed = feat_denoised.permute(2, 3, 0, 1).reshape(N, B, C)
    x_clone[1:] = (1 - alpha) * x_clone[1:] + alpha * feat_processed
    return x_clone[:, 0], int(mask.sum())


def ref_kk(attn, u):
    _, k, _ = heads(attn, u)
    return F.softmax(torch.bmm(k * k.shape[-1] ** -0.5, k.transpose(1, 2)), dim=-1)


def ref_enhance(x, guide, beta=0.4):
    """feat_enhancing(x, guide), last=False."""
    g = guide[1:]
    simi = F.cosine_similarity(g.unsqueeze(1), g.unsqueeze(0), dim=-1)
    simi[simi < beta] = 0
    x = x.clone()
    x[1:] = simi @ x[1:]
    return x


@torch.no_grad()
def ref_encode_image(visual, img, sink_channel, sigma=5.0, return_cls=False, stats=None):
    """VisionTransformer.forward (return_all=True), batch 1: (patch features N x D, x_last CLS embedding 1 x D)."""
    x, rows, cols = embed(visual, img)
    n_patches = (rows, cols)
    blocks = visual.transformer.resblocks
    kk, guide = {}, []
    for i, blk in enumerate(blocks[:-1]):
        u = blk.ln_1(x)
        kk[i] = ref_kk(blk.attn, u)
        q, k, v = heads(blk.attn, u)
        x = x + merge(blk.attn, F.softmax(torch.bmm(q * q.shape[-1] ** -0.5, k.transpose(1, 2)), dim=-1) @ v)  # 'vanilla'
        x = x + blk.mlp(blk.ln_2(x))
        x, sinks = ref_feat_denoising(x, n_patches, sink_channel, sigma)
        if stats is not None:
            stats.append(sinks)
        guide.append(x)
    blk = blocks[-1]
    x_last = blk(x[None])[0]
    x_last, _ = ref_feat_denoising(x_last, n_patches, sink_channel, sigma)
    guide.append(x_last)
    cls = visual.ln_post(x_last[:1]) @ visual.proj
    if return_cls:
        return cls
    x_guide = torch.stack(guide).mean(0)
    decoded, maps = [], []
    for u in (ref_enhance(x, x_guide), ref_enhance(x_guide, x_guide)):  # last_attn on each input
        kk[len(blocks) - 1] = ref_kk(blk.attn, blk.ln_1(u))
        _, _, v = heads(blk.attn, blk.ln_1(u))
        A = torch.stack([kk[i][:, 1:, 1:] for i in range(len(blocks))]).mean(0)
        maps.append(A)
        decoded.append(merge(blk.attn, A @ v[:, 1:]))
    out = torch.stack(decoded).mean(0)
    return visual.ln_post(out) @ visual.proj, cls, maps[0]


@torch.no_grad()
def ref_forward_feature(visual, img, whole_img, text, clusters, w, a, sinks, sigma):
    feats, cls, _ = ref_encode_image(visual, img, sinks, sigma)
    feats = feats / feats.norm(dim=-1, keepdim=True)
    x_last = cls / cls.norm(dim=-1, keepdim=True)
    if whole_img is None:
        g = x_last @ text.T
    else:
        gv = ref_encode_image(visual, whole_img, sinks, sigma, return_cls=True)
        g = (gv / gv.norm(dim=-1, keepdim=True)) @ text.T
    adjusted = ref_hierarchical_prompt(feats, g[0], text, clusters, a)
    logits = (feats @ adjusted.T) * (1 - w) + g * w
    h, wd = img.shape[-2] // 16, img.shape[-1] // 16
    logits = logits.T.reshape(1, -1, h, wd)
    return F.interpolate(logits, size=img.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def ref_predict(visual, img, text, query_idx, ori_shape, consts, crop, stride, city=False, sinks=TINY_SINKS, sigma=1.3, prob_thd=0.1):
    w, a, t = consts
    clusters = ref_clusters(text, t)
    preds = slide_inference(lambda c: ref_forward_feature(visual, c, None if city else img, text, clusters, w, a, sinks, sigma), img, crop, stride)
    logits = F.interpolate(preds, size=ori_shape, mode="bilinear", align_corners=False)[0]
    return (logits, *sclip_postprocess(logits, query_idx, 40.0, prob_thd))


# -- the preset against the transcription ----------------------------------------------------------------------------
def test_rfclip_features_equal_the_published_forward(vit_b16):
    """ViT-B/16, one 224 window, the published sink channels at sigma 1.3 (at 5 no token of a random-weight model is
    a sink): features, the CLS embedding of x_12 and input x_11's map."""
    pixels = structured(1, (224, 224), seed=3)
    stats = []
    feats, cls, A = ref_encode_image(vit_b16.visual, pixels, rfclip.SINK_CHANNELS[768], 1.3, stats=stats)
    out = rfclip.refocused(vit_b16, pixels, AttentionSpec.parse("rfclip/denoise:1.3,0.4"), maps=True)
    assert (out.features.reshape(196, -1) - F.normalize(feats, dim=-1)).abs().max() < 1e-4
    assert (out.cls - F.normalize(cls, dim=-1)).abs().max() < 1e-4
    assert (out.maps[0] - A).abs().max() < 1e-5
    assert sum(stats) > 50  # many tokens are sinks


@pytest.mark.parametrize("city", [False, True])
def test_rfclip_pipeline_equals_the_published_one(deep_tiny, city):
    """Tiny 12-block ViT, 64 px windows at stride 32 (1 x 2), its own sink channels, synonyms, VOC21's prob_thd: the
    global embedding from the whole input (or, Cityscapes, each window's), cosine and probabilities within 1e-4,
    labels equal off near-ties."""
    pixels = structured(1, (64, 96), seed=5)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 64, generator=g)
    text = F.normalize(torch.cat([base, base[:3] + 0.3 * torch.randn(3, 64, generator=g)]), dim=-1)  # near names cluster
    query_idx = [0, 1, 2, 3, 3, 1, 2]
    consts = (0.25, 0.2, 0.5)
    logits, probs, labels = ref_predict(deep_tiny.visual, pixels, text, query_idx, (70, 100), consts, 64, 32, city)
    spec = TINY_SPEC.format(w=0.25, a=0.2, t=0.5, src=",window" if city else "")
    run = window_run(deep_tiny, pixels, spec, text, window=64, stride=32, remainder="drop", pos_interp="scale")
    cos = rfclip.refocus_cosine(run, (70, 100))
    assert (cos.rows(0, 70) - logits).abs().max() < 1e-4
    maps = ClassMaps(cos, query_idx, 4, 40.0)
    ours = torch.from_numpy(np.concatenate([band for _, _, band in maps.numpy_bands()], axis=1))
    assert (ours - probs).abs().max() < 1e-4
    got = torch.from_numpy(maps.labels(0.1))
    sure = labels_off_ties(probs)
    assert sure.float().mean() > 0.9 and torch.equal(got[sure], labels[sure])


def test_rfclip_whole_image_uses_its_own_embedding(deep_tiny):
    """VOC21 / COCO-Stuff: the whole input as one window (slide_crop=0), g from its own x_12."""
    pixels = structured(1, (64, 80), seed=2)
    text = F.normalize(torch.randn(5, 64, generator=torch.Generator().manual_seed(3)), dim=-1)
    clusters = ref_clusters(text, 0.9)
    want = ref_forward_feature(deep_tiny.visual, pixels, None, text, clusters, 0.1, 0.03, TINY_SINKS, 1.3)[0]
    run = window_run(deep_tiny, pixels, TINY_SPEC.format(w=0.1, a=0.03, t=0.9, src=""), text, window=0, remainder="drop", pos_interp="scale")
    assert (rfclip.refocus_cosine(run).rows(0, 64) - want).abs().max() < 1e-4


# -- the denoising against its published code --------------------------------------------
def test_denoise_tokens_equal_feat_denoising():
    x = torch.randn(1, 1 + 6 * 5, 64, generator=torch.Generator().manual_seed(0))
    want, sinks = ref_feat_denoising(x[0], (6, 5), TINY_SINKS, 1.3)
    assert 0 < sinks < 30
    assert (rfclip.denoise_tokens(x, (6, 5), tuple(TINY_SINKS), 1.3, 0.4)[0] - want).abs().max() < 1e-6


# -- entmax, checks, protocol, grid -----------------------------------------------------------------------------------
def test_rfclip_entmax_tends_to_rfclip(deep_tiny):
    pixels = structured(1, (64, 64), seed=3)
    spec = AttentionSpec.parse(TINY_SPEC.format(w=0.25, a=0.04, t=0.09, src=""))
    feats = {n: rfclip.refocused(deep_tiny, pixels, spec.replace(normalizer=n)).features for n in ("softmax", "entmax:1.0001", "entmax:1.5")}
    assert (feats["entmax:1.0001"] - feats["softmax"]).abs().max() < 1e-3
    assert (feats["entmax:1.5"] - feats["softmax"]).abs().max() > 1e-2
    assert AttentionSpec.parse("rfclip-entmax") == AttentionSpec.parse("rfclip").replace(normalizer="entmax:1.5")


@pytest.mark.parametrize("bad", ["rfclip/gauss:5", "qq/softmax/cls:0/noffn/refocus:0.4", "kk/softmax/cls:0/noffn/denoise:5,0.4", "sclip/presence:complete,0.1,0.03,0.1"])
def test_specs_the_refocus_forward_cannot_run_are_refused(bad):
    with pytest.raises(UserValueError):
        Plan.of(bad)


@pytest.mark.parametrize("bad", ["rfclip/denoise:0,0.4", "rfclip/denoise:5", "rfclip/refocus:2", "rfclip/presence:single,0.1,0.1,0.1", "rfclip/presence:complete,0.1,0.1", "rfclip/presence:ward,0.1,0.1,0.1,crop"])
def test_bad_option_arguments_are_refused(bad):
    with pytest.raises(UserValueError):
        AttentionSpec.parse(bad)


def test_sink_channels_follow_the_width(tiny_clip):
    with pytest.raises(UserValueError, match="768"):
        Plan.of("rfclip", clip=tiny_clip)
    assert rfclip.Denoise.parse("5,0.4").sinks(1024) == rfclip.SINK_CHANNELS[1024]


def test_explain_reads_input_x11s_map(deep_tiny):
    pixels = structured(1, (64, 96), seed=1)
    run = window_run(deep_tiny, pixels, TINY_SPEC.format(w=0.1, a=0.1, t=0.1, src=""), window=64, stride=32, remainder="drop")
    windows = list(rfclip.RefocusForward().attention(run))
    assert len(windows) == 2 and windows[0].grid == (4, 4) and windows[0].maps.shape == (4, 16, 16)
    (whole,) = rfclip.RefocusForward().attention(run, whole_image=True)
    assert whole.grid == (4, 6)


# typed from liblacklucy/RF-CLIP@c2b333e configs/cfg_*.py, RF_CLIP's defaults and eval_all.sh (--pamr off)
RFCLIP_PUBLISHED = {
    "voc21": dict(resolution=336, window=0, logit_scale=40, bg_threshold=0.1, pamr=False, consts=(0.1, 0.03, 0.10)),
    "voc20": dict(resolution=336, window=224, stride=112, bg_threshold=0, consts=(0.4, 0.02, 0.10)),
    "context60": dict(resolution=336, window=224, stride=112, bg_threshold=0.1, consts=(0.25, 0.04, 0.09)),
    "context59": dict(resolution=336, window=224, bg_threshold=0, consts=(0.25, 0.04, 0.09)),
    "coco-object": dict(resolution=336, window=224, bg_threshold=0.1, consts=(0.25, 0.01, 0.10)),
    "coco-stuff": dict(resolution=336, window=0, bg_threshold=0, consts=(0.2, 0.02, 0.02)),
    "cityscapes": dict(resolution=560, window=224, stride=112, consts=(0.1, 0.03, 0.14)),
    "ade20k": dict(resolution=336, window=224, stride=112, consts=(0.3, 0.05, 0.06)),
}


@pytest.mark.parametrize("dataset", list(RFCLIP_PUBLISHED))
def test_rfclip_protocol_matches_the_published_configs(dataset):
    want = dict(RFCLIP_PUBLISHED[dataset])
    presence, source = rfclip.presence_arg(rfclip.PROTOCOL.spec_for(dataset).extra("presence"))
    assert (presence.linkage, presence.weight, presence.alpha, presence.threshold) == ("complete", *want.pop("consts"))
    assert source == ("window" if dataset == "cityscapes" else "image")
    settings = rfclip.PROTOCOL.settings(dataset)
    for name, value in want.items():
        assert getattr(settings, name) == pytest.approx(value), name
    assert (settings.resize, settings.pos_interp, settings.remainder) == ("opencv", "scale", "drop")
    assert rfclip.PAMR_PROTOCOL.settings(dataset).pamr and rfclip.PROTOCOL.class_names == "sclip"
    assert rfclip.PROTOCOL.spec_for(dataset, "rfclip-entmax").normalizer == "entmax:1.5"


def test_rfclip_grid_and_published_numbers():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("rfclip")).grid
    assert g.protocol == "rfclip" and list(g.presets) == ["rfclip"] and list(g.normalizers) == ["softmax", "entmax:1.5"]
    assert set(g.datasets) == set(DATASETS.names())
    from clipseg_sparse.evaluation.published import PUBLISHED

    for name, avg in (("rfclip", 44.2), ("rfclip-pamr", 45.5)):
        row = PUBLISHED.get(name)
        assert set(row.miou) == set(DATASETS.names()) and row.clip == "ViT-B-16:openai"
        assert sum(row.miou.values()) / 8 == pytest.approx(avg, abs=0.05)  # the table's avg-8
