"""GLA-CLIP (presets `glaclip`, `glaclip-entmax`, options `kv`, `anchor`, `dyn`, forward `crosswindow`, protocol
`glaclip`) against a transcription of 2btlFe/GLA-CLIP@ba74915 (`gla_clip_segmentor.py`: `forward_kv_expansion`,
`forward_feature`, `postprocess_result`; `open_clip/transformer.py`: `VisionTransformer.forward`,
`Custom_Attn_Model_Type`; `myutils.py`: `KV_Extension`, `dynamic_beta`, `dynamic_gamma`) with predict.sh's flags,
run on a random-init CLIP and a tiny random DINO-layout ViT (patch 8) standing in for DINO ViT-B/8."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import window_run
from sclip_line_reference import dino_last_features, labels_off_ties, structured
from test_proxyclip import installed_tiny_dino
from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.methods import glaclip
from clipseg_sparse.segment.labels import ClassMaps
from clipseg_sparse.segment.plan import Plan
from clipseg_sparse.segment.windows import window_cosine_map

IMAGENET = (torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))


@pytest.fixture(scope="module")
def b16_dino(vit_b16):
    yield from installed_tiny_dino(vit_b16)


@pytest.fixture(scope="module")
def tiny_dino(tiny_clip):
    yield from installed_tiny_dino(tiny_clip)


# -- transcription ------------------------------------------------------------------------------------------------
def ref_kv_extension(ex_feats_grid, v_ext, token_size, num_heads, mini_iters=2, crit=0.55, beta_alpha=0.3, gamma_alpha=30.0):
    """myutils.py KV_Extension.forward with token_norm, proxy_sim, dynamic_beta, dynamic_gamma (scale 1,
    cutting_hp 0, temperature 1): [S, B, C]."""
    h_grids, w_grids, C, H, W = ex_feats_grid.shape
    B, S = h_grids * w_grids, H * W
    ex_feats_grid = ex_feats_grid.permute(0, 1, 3, 4, 2).reshape(B, S, C).reshape(1, B * S, C)
    key = F.normalize(ex_feats_grid, dim=-1)
    v_ext = v_ext.reshape(B * num_heads, token_size[0], token_size[1], -1).permute(0, 3, 1, 2).contiguous()
    v_ext = F.interpolate(v_ext, size=(H, W), mode="bilinear", align_corners=False)
    Dh = v_ext.shape[1]
    v_ext = v_ext.view(B, num_heads, Dh, H, W).flatten(3).permute(1, 0, 3, 2).reshape(num_heads, B * S, Dh)
    proxy = key.clone()
    attn_weights = torch.bmm(F.normalize(proxy, dim=-1), key.transpose(1, 2))
    for _ in range(mini_iters):
        mask_one = (attn_weights > crit).to(key.dtype)
        gone = torch.where(mask_one.sum(dim=-1)[0] == 0)[0]
        if len(gone) != 0:
            mask_one[0, gone, gone] = 1
        proxy = torch.bmm(mask_one, key)
        proxy = F.normalize(proxy / (mask_one.sum(dim=-1, keepdim=True) + 1e-6), dim=-1)
        attn_weights = torch.bmm(proxy, key.transpose(1, 2))
    attn_weights = attn_weights.reshape(B, S, B * S) * 1
    sim_mean = attn_weights.mean(dim=-1, keepdim=True)
    gamma = 1 + gamma_alpha / mask_one.sum(dim=-1).reshape(B, S, 1)
    beta = 1 + beta_alpha * np.log1p(B)
    sim_mean[sim_mean < 0] = 0
    attn_weights = (attn_weights - sim_mean * beta) * gamma
    cut = torch.minimum(attn_weights.max(dim=-1, keepdim=True).values, torch.tensor(0.0))
    attn_weights.masked_fill_(attn_weights < cut, float("-inf"))
    attn_weights = F.softmax(attn_weights / 1.0, dim=-1)
    return torch.einsum("bsn,hnd->hsbd", attn_weights, v_ext).permute(1, 2, 0, 3).reshape(S, B, -1)


@torch.no_grad()
def ref_encode_image(visual, dino, crops, h_grids, w_grids):
    """forward_feature (ProxyCLIP branch, DINO) + VisionTransformer.forward with KV_token_extension: B x S x D."""
    mean, std = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1), torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    imgs_norm = ((crops * std + mean) - IMAGENET[0]) / IMAGENET[1]
    feat = dino_last_features(dino, imgs_norm)
    nb_im, I, J = feat.shape[0], crops.shape[-2] // 8, crops.shape[-1] // 8
    ex_feats = feat[:, 1:, :].reshape(nb_im, I, J, -1).permute(0, 3, 1, 2)
    x = visual.conv1(crops)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    x = torch.cat([visual.class_embedding.view(1, 1, -1).expand(x.shape[0], -1, -1), x], dim=1) + visual.positional_embedding
    x = visual.ln_pre(x).permute(1, 0, 2)  # LND
    for blk in visual.transformer.resblocks[:-1]:
        x = blk(x.permute(1, 0, 2)).permute(1, 0, 2)  # open_clip blocks are batch first here
    token_size = (crops.shape[-2] // 16, crops.shape[-1] // 16)
    blk = visual.transformer.resblocks[-1]
    x = blk.ln_1(x[1:, :, :])
    num_heads = blk.attn.num_heads
    num_tokens, bsz, embed_dim = x.size()
    _, _, v = F.linear(x, blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, dim=-1)
    v = v.contiguous().view(-1, bsz * num_heads, embed_dim // num_heads).transpose(0, 1)
    B, C, H, W = ex_feats.shape
    ex_feats = F.interpolate(ex_feats, size=(H, W), mode="bilinear", align_corners=False)
    out = ref_kv_extension(ex_feats.reshape(h_grids, w_grids, C, H, W), v, token_size, num_heads)
    out = blk.attn.out_proj(out).permute(1, 0, 2)
    return visual.ln_post(out) @ visual.proj


def ref_boxes(h_img, w_img, crop, stride):
    h_grids = max(h_img - crop + stride - 1, 0) // stride + 1
    w_grids = max(w_img - crop + stride - 1, 0) // stride + 1
    boxes = []
    for h_idx in range(h_grids):
        for w_idx in range(w_grids):
            y1, x1 = h_idx * stride, w_idx * stride
            y2, x2 = min(y1 + crop, h_img), min(x1 + crop, w_img)
            boxes.append((max(y2 - crop, 0), y2, max(x2 - crop, 0), x2))
    return boxes, h_grids, w_grids


@torch.no_grad()
def ref_predict(visual, dino, img, text, query_idx, ori_shape, crop, stride, logit_scale=40.0, prob_thd=0.1):
    """forward_kv_expansion (all windows in one batch, no padding: square crops of a multiple of 56) and
    postprocess_result: (logits Q x H x W, class probabilities, labels)."""
    _, _, h_img, w_img = img.shape
    boxes, h_grids, w_grids = ref_boxes(h_img, w_img, crop, stride)
    crops = torch.cat([img[:, :, y1:y2, x1:x2] for y1, y2, x1, x2 in boxes])
    feats = ref_encode_image(visual, dino, crops, h_grids, w_grids)
    logits = F.normalize(feats, dim=-1) @ text.T
    Hs = Ws = int(logits.shape[1] ** 0.5)
    logits = F.interpolate(logits.permute(0, 2, 1).reshape(-1, logits.shape[-1], Hs, Ws), size=(crop, crop), mode="bilinear", align_corners=False)
    preds = img.new_zeros((1, text.shape[0], h_img, w_img))
    count = img.new_zeros((1, 1, h_img, w_img))
    for i, (y1, y2, x1, x2) in enumerate(boxes):
        preds += F.pad(logits[i : i + 1], (int(x1), int(w_img - x2), int(y1), int(h_img - y2)))
        count[:, :, y1:y2, x1:x2] += 1
    logits = F.interpolate(preds / count, size=ori_shape, mode="bilinear")[0]
    probs = (logits * logit_scale).softmax(0)
    qi = torch.tensor(query_idx)
    num_cls = int(qi.max()) + 1
    cls_probs = torch.full((num_cls, *ori_shape), torch.finfo(probs.dtype).min)
    cls_probs.scatter_reduce_(0, qi[:, None, None].expand(-1, *ori_shape), probs, reduce="amax", include_self=True)
    pred = cls_probs.argmax(0)
    pred[cls_probs.max(0)[0] < prob_thd] = 0
    return logits, cls_probs, pred


def _settings(window, stride):
    return dict(window=window, stride=stride, remainder="centre", pos_interp="scale", logit_scale=40.0)


# -- the preset against the transcription --------------------------------------------------------------------------
def test_glaclip_equals_the_published_forward(b16_dino):
    """ViT-B/16, two 224 windows (28 x 28 DINO grid each): every window's features within 1e-4, also a few rows
    of the attention at a time."""
    clip, backbone = b16_dino
    pixels = structured(1, (224, 336), seed=3)
    boxes, hg, wg = ref_boxes(224, 336, 224, 112)
    crops = torch.cat([pixels[:, :, y1:y2, x1:x2] for y1, y2, x1, x2 in boxes])
    ref = F.normalize(ref_encode_image(clip.visual, backbone.model, crops, hg, wg), dim=-1)
    run = window_run(clip, pixels, "glaclip", **_settings(224, 112))
    for rows in (None, 500):
        got_boxes, feats = glaclip.crosswindow_features(run, rows)
        assert got_boxes == boxes and feats.shape == (2, 28, 28, clip.embed_dim)
        assert (feats.reshape(2, 784, -1) - ref).abs().max() < 1e-4


def test_glaclip_pipeline_equals_the_published_one(tiny_dino):
    """Tiny CLIP (64 px windows, stride 32: 3 x 3 windows), VOC21-like synonyms and prob_thd: cosine and class
    probabilities within 1e-4, labels equal off near-ties."""
    clip, backbone = tiny_dino
    pixels = structured(1, (128, 128), seed=5)
    text = F.normalize(torch.randn(5, clip.embed_dim, generator=torch.Generator().manual_seed(1)), dim=-1)
    query_idx = [0, 0, 1, 2, 3]
    logits, probs, labels = ref_predict(clip.visual, backbone.model, pixels, text, query_idx, (150, 140), 64, 32)
    run = window_run(clip, pixels, "glaclip", text, **_settings(64, 32))
    boxes, feats = glaclip.crosswindow_features(run)
    assert len(boxes) == 9
    cos = window_cosine_map(run, boxes, torch.einsum("bhwd,nd->bhwn", feats, text), (150, 140))
    maps = ClassMaps(cos, query_idx, 4, 40.0)
    ours = torch.from_numpy(np.concatenate([band for _, _, band in maps.numpy_bands()], axis=1))
    assert (cos.rows(0, 150) - logits).abs().max() < 1e-4
    assert (ours - probs).abs().max() < 1e-4
    got = torch.from_numpy(maps.labels(0.1))
    sure = labels_off_ties(probs)
    assert sure.float().mean() > 0.9 and torch.equal(got[sure], labels[sure])


# -- the scores against a plain loop --------------------------------------------------------------------------------
def loop_scores(keys, windows, iters, threshold, a, g):
    """One query at a time, one key at a time."""
    M = keys.shape[0]
    out = torch.empty(M, M)
    for i in range(M):
        q, count = keys[i], None
        for _ in range(iters):
            kept = [j for j in range(M) if float(q @ keys[j]) > threshold] or [i]
            count = len(kept)
            q = F.normalize(sum(keys[j] for j in kept), dim=0)
        s = torch.stack([q @ keys[j] for j in range(M)])
        if a is not None:
            s = (s - (1 + a * np.log1p(windows)) * max(float(s.mean()), 0.0)) * (1 + g / count)
        floor = min(float(s.max()), 0.0)
        out[i] = torch.where(s < floor, torch.tensor(float("-inf")), s)
    return out


@pytest.mark.parametrize("threshold,dyn", [(0.3, (0.3, 30.0)), (0.95, (0.3, 30.0)), (0.3, None)])
def test_crosswindow_scores_equal_a_plain_loop(threshold, dyn):
    """Anchor steps (0.95: most queries keep only their own key), dynamic beta / gamma, the min(row max, 0) cut."""
    g = torch.Generator().manual_seed(0)
    keys = F.normalize(torch.randn(40, 6, generator=g) + 0.8, dim=-1)
    want = loop_scores(keys, 3, 2, threshold, *(dyn or (None, None)))
    got = torch.cat([glaclip.crosswindow_scores(keys, r0, min(r0 + 7, 40), 3, (2, threshold), dyn) for r0 in range(0, 40, 7)])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert (got[finite] - want[finite]).abs().max() < 1e-5


def test_negative_rows_keep_their_maximum():
    keys = F.normalize(torch.tensor([[1.0, 0.0], [-1.0, 0.1], [0.0, 1.0]]), dim=-1)
    s = glaclip.crosswindow_scores(keys, 0, 3, 1, (1, 0.5), (5.0, 30.0))
    assert torch.isfinite(s).any(-1).all()


# -- entmax, checks, protocol, grid --------------------------------------------------------------------------------
def test_glaclip_entmax_tends_to_glaclip(tiny_dino):
    clip, _ = tiny_dino
    pixels = structured(1, (64, 96), seed=2)
    feats = {}
    for spec in ("glaclip", "glaclip/entmax:1.0001", "glaclip-entmax"):
        feats[spec] = glaclip.crosswindow_features(window_run(clip, pixels, spec, **_settings(64, 32)))[1]
    assert (feats["glaclip/entmax:1.0001"] - feats["glaclip"]).abs().max() < 1e-3
    assert (feats["glaclip-entmax"] - feats["glaclip"]).abs().max() > 1e-2
    assert AttentionSpec.parse("glaclip-entmax") == AttentionSpec.parse("glaclip").replace(normalizer="entmax:1.5")


@pytest.mark.parametrize(
    "bad",
    [
        "proxyclip/anchor:2,0.55",  # no kv:image
        "ext:dino_vitb8[cos,pos]/softmax/cls:0/noffn/kv:image/dyn:0.3,30",  # dyn without anchor
        "ext:dino_vitb8[cos,shift:1.2,scale:3,pos]/softmax/cls:0/noffn/kv:image",
        "glaclip/gauss:5",
        "glaclip/in:sum@4-10",
        "ext:dino_vitb8.qk[cos,pos]/softmax/cls:0/noffn/kv:image",
    ],
)
def test_specs_the_crosswindow_forward_cannot_run_are_refused(bad):
    with pytest.raises(UserValueError):
        Plan.of(bad)


@pytest.mark.parametrize("bad", ["glaclip/kv:window", "glaclip/anchor:0,0.5", "glaclip/anchor:2", "glaclip/dyn:-1,30", "glaclip/dyn:x,1"])
def test_bad_option_arguments_are_refused(bad):
    with pytest.raises(UserValueError):
        AttentionSpec.parse(bad)


def test_windows_alone_are_refused_and_explain_sees_one_window(tiny_dino):
    clip, _ = tiny_dino
    pixels = structured(1, (64, 64), seed=1)
    with pytest.raises(UserValueError, match="crosswindow forward"):
        clip.encode_dense(pixels, "glaclip")
    run = window_run(clip, pixels, "glaclip", **_settings(64, 32))
    (window,) = glaclip.CrossWindowForward().attention(run, whole_image=True)
    assert window.grid == (8, 8) and window.maps.shape == (1, 64, 64)
    assert torch.allclose(window.maps.sum(-1), torch.ones(1, 64))
    with pytest.raises(UserValueError, match="analyze"):
        next(glaclip.CrossWindowForward().attention(run))


# typed from 2btlFe/GLA-CLIP@ba74915 configs/cfg_*.py, cfg.py (ModelConfig) and eval.py's defaults
GLACLIP_PUBLISHED = {
    "voc21": dict(resolution=336, window=224, stride=112, logit_scale=40, bg_threshold=0.1, area_threshold=0, pamr=False),
    "context60": dict(resolution=336, window=224, stride=112, bg_threshold=0.1),
    "coco-object": dict(resolution=336, bg_threshold=0.1),
    "voc20": dict(resolution=336, bg_threshold=0),
    "context59": dict(resolution=336, bg_threshold=0),
    "coco-stuff": dict(resolution=336, window=224, logit_scale=40),
    "cityscapes": dict(resolution=560, window=224, stride=112),
    "ade20k": dict(resolution=336, bg_threshold=0),
}


@pytest.mark.parametrize("dataset", list(GLACLIP_PUBLISHED))
def test_glaclip_protocol_matches_the_published_configs(dataset):
    settings = glaclip.PROTOCOL.settings(dataset)
    for name, value in GLACLIP_PUBLISHED[dataset].items():
        assert getattr(settings, name) == pytest.approx(value), name
    assert (settings.resize, settings.pos_interp, settings.remainder) == ("opencv", "scale", "centre")
    assert glaclip.PROTOCOL.attention == "glaclip" and glaclip.PROTOCOL.class_names == "sclip"


def test_glaclip_grid_and_published_numbers():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("glaclip")).grid
    assert g.protocol == "glaclip" and list(g.presets) == ["glaclip"] and list(g.normalizers) == ["softmax", "entmax:1.5"]
    assert set(g.datasets) == set(DATASETS.names())
    from clipseg_sparse.evaluation.published import PUBLISHED

    row = PUBLISHED.get("glaclip")
    assert set(row.miou) == set(DATASETS.names()) and row.clip == "ViT-B-16:openai"
    assert sum(row.miou.values()) / 8 == pytest.approx(44.0, abs=0.05)  # the table's avg-8
