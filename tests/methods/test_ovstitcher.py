"""OV-Stitcher: the stitch operator, row-blocked image-wide attention, and the preset against a transcription
of atw617/OV-Stitcher@91a9489 (`ov_stitcher_segmentor.py` forward_feature / get_windowed_imgs /
stitch_features_from_batch / postprocess_result, `open_clip/transformer.py` VisionTransformer.forward) on a
random-init ViT-B/16 and a tiny random DINO-layout ViT/8, at a size with several windows whose last row and
column are off the patch grid (120 x 200: neither side a multiple of 56 or 16)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import window_run
from test_corrclip import IMAGENET, dbscan_one, region_map
from test_proxyclip import installed_tiny_dino, proxy  # noqa: F401  (fixture: tiny CLIP + tiny DINO)
from clipseg_sparse.attention import blocked_attention, global_attention, resolve_spec
from clipseg_sparse.attention.normalizers import normalize
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.methods.ovstitcher import StitchLayout, stitched_features
from clipseg_sparse.segment.vocabulary import Vocabulary


# -- the published code, transcribed ------------------------------------------------------------------
def compute_padsize(H: int, W: int, m: int) -> tuple[int, int, int, int]:
    l = r = t = b = 0
    if W % m:
        lr = m - W % m
        l, r = lr // 2, lr - lr // 2
    if H % m:
        tb = m - H % m
        t, b = tb // 2, tb - tb // 2
    return l, r, t, b


def get_windowed_imgs(img: torch.Tensor, crop: int, stride: int, fill: float = 0):
    _, _, h_img, w_img = img.shape
    h_grids = max(h_img - crop + stride - 1, 0) // stride + 1
    w_grids = max(w_img - crop + stride - 1, 0) // stride + 1
    crops, locs, pads = [], [], []
    for h_idx in range(h_grids):
        for w_idx in range(w_grids):
            y1, x1 = h_idx * stride, w_idx * stride
            y2, x2 = min(y1 + crop, h_img), min(x1 + crop, w_img)
            y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
            c = img[:, :, y1:y2, x1:x2]
            pad = compute_padsize(*c.shape[2:], 56)
            crops.append(F.pad(c, pad, value=fill) if any(pad) else c)
            locs.append((y1, x1, y2, x2))
            pads.append(pad)
    return torch.cat(crops), locs, pads


def published_stitch(feature: torch.Tensor, img_shape, locs, pads, patch: int) -> torch.Tensor:
    """transformer.py's stitch_features_from_batch (the CLIP variant: valid = (y2 - y1) // patch):
    feature n x D x T -> 1 x D x H/p x W/p."""
    _, D, _ = feature.shape
    preds = torch.zeros(1, D, img_shape[2] // patch, img_shape[3] // patch, dtype=feature.dtype)
    count = torch.zeros(1, 1, img_shape[2] // patch, img_shape[3] // patch, dtype=feature.dtype)
    for i, ((y1, x1, y2, x2), (pad_l, pad_r, pad_t, pad_b)) in enumerate(zip(locs, pads)):
        crop_h = math.ceil(((y2 - y1) + pad_t + pad_b) / patch)
        crop_w = math.ceil(((x2 - x1) + pad_l + pad_r) / patch)
        valid_h, valid_w = (y2 - y1) // patch, (x2 - x1) // patch
        t, l = math.ceil(pad_t / patch), math.ceil(pad_l / patch)
        feat = feature[i].reshape(D, crop_h, crop_w)[:, t : t + valid_h, l : l + valid_w]
        preds[:, :, y1 // patch : y1 // patch + valid_h, x1 // patch : x1 // patch + valid_w] += feat
        count[:, :, y1 // patch : y1 // patch + valid_h, x1 // patch : x1 // patch + valid_w] += 1
    assert (count == 0).sum() == 0
    return preds / count


def block_with_mask(blk, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fork's ResidualAttentionBlock with a bool mask (True = not attended), batch first."""
    u = blk.ln_1(x)
    x = x + blk.ls_1(blk.attn(u, u, u, need_weights=False, attn_mask=mask)[0])
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


def published_ovstitcher(clip, backbone, img, masks, crop, stride, first=6, last=10, alpha=1.0, beta=0.5, tau=4.0, eps=0.2, attention=False):
    """forward_feature + VisionTransformer.forward, batch 1, plain torch: image features 1 x N x D on the
    DINO grid (before the L2 norm) and that grid's shape. img: 1 x 3 x H x W CLIP-normalised; masks: H x W
    ids at the input's size with -1 (the map's minimum, the code's unsegmented) present. Features N x D.
    attention: also the last block's image-wide map the features are made with (`attn_weights`, 1 x N x N)."""
    v = clip.visual
    p, dp = 16, 8
    img_shape = img.shape
    crops, locs, pads = get_windowed_imgs(img, crop, stride)
    mean, std = torch.tensor(clip.mean).view(1, 3, 1, 1), torch.tensor(clip.std).view(1, 3, 1, 1)
    f = backbone.features(((crops * std + mean) - IMAGENET[0]) / IMAGENET[1], want=("qkv", "penult"))
    n, heads, M, hd = f.q.shape
    D = heads * hd

    def stitch(t, patch):  # n x T x D -> 1 x N x D
        return published_stitch(t.permute(0, 2, 1), img_shape, locs, pads, patch).reshape(1, t.shape[-1], -1).permute(0, 2, 1)

    sq, sk, sv = (stitch(t.transpose(1, 2).reshape(n, M, D), dp)[0] for t in (f.q, f.k, f.v))
    sq, sk, sv = (t.contiguous().view(-1, heads, hd).transpose(0, 1) for t in (sq, sk, sv))
    attn = torch.bmm(F.softmax(torch.bmm(sq, sk.transpose(1, 2)) * hd**-0.5, dim=-1), sv)
    attn = attn.transpose(0, 1).contiguous().view(-1, 1, D)
    feat_shape = (img_shape[2] // dp, img_shape[3] // dp)
    dblk = backbone.model.blocks[-1]
    dino = stitch(f.penult, dp) + F.linear(attn.permute(1, 0, 2), dblk.attn.proj.weight, dblk.attn.proj.bias)
    dino = dino + F.linear(F.gelu(F.linear(F.layer_norm(dino, dblk.norm2.normalized_shape, dblk.norm2.weight, dblk.norm2.bias, dblk.norm2.eps),
                                           dblk.mlp.fc1.weight, dblk.mlp.fc1.bias)), dblk.mlp.fc2.weight, dblk.mlp.fc2.bias)  # fmt: skip
    dino = F.normalize(dino, dim=-1)

    # VisionTransformer.forward
    x, token_grid = clip._embed(crops, "scale")  # conv1, CLS, interpolate_pos_encoding (+0.1), ln_pre
    B = x.shape[0]
    similarity = torch.einsum("b m c, b n c -> b m n", dino, dino)
    masks = F.interpolate(masks[None, None].float(), size=feat_shape, mode="nearest").int().squeeze(1)
    mask_values = torch.unique(masks[0])
    if mask_values.shape[0] > 2:
        region_masks = [idx == masks[0] for idx in mask_values]
        dino_feat = dino.reshape(1, *feat_shape, -1)[0]
        inst = F.normalize(torch.stack([dino_feat[m].mean(dim=0) for m in region_masks]), dim=1)[1:]
        sim = inst @ inst.T
        for idx, cluster_v in enumerate(dbscan_one(sim.max() - sim, eps), start=1):
            masks[0][region_masks[idx]] = cluster_v + 10000
    region_masks = [(idx == masks[0]).view(-1) for idx in torch.unique(masks[0])]
    equal_idx = torch.zeros_like(similarity[0]).bool()
    for m in region_masks[1:]:
        equal_idx += torch.outer(m, m)
    m = region_masks[0]
    equal_idx += (m.unsqueeze(0) + m.unsqueeze(1)) * (similarity[0] > similarity[0].mean())
    similarity[0][~equal_idx] = float("-inf")
    attn_weights = (similarity * tau).softmax(dim=-1)

    # the merged map at the input's size, windowed (padding = the unsegmented id, see the preset's notes)
    cropped, _, _ = get_windowed_imgs(F.interpolate(masks.float().unsqueeze(1), size=img_shape[-2:], mode="nearest"), crop, stride, fill=-1)
    cropped = F.interpolate(cropped.float(), size=token_grid, mode="nearest").int().squeeze(1)
    ids = torch.unique(masks)
    cropped_region_masks = torch.stack([idx == cropped for idx in ids], dim=1)  # B x R x h x w
    R = len(ids)
    T = x.shape[1]
    allowed = torch.zeros(B, R + T, R + T, dtype=torch.bool)
    allowed[:, R:, R:] = True
    allowed[:, :R, R] = True
    allowed[:, :R, R + 1 :] = cropped_region_masks.view(B, R, -1)
    x = torch.cat([x[:, :1].expand(B, R, -1), x], dim=1)
    feats_spatial = []
    blocks = v.transformer.resblocks
    L = len(blocks)
    for idx, blk in enumerate(blocks[:-1]):
        if first - 1 <= idx <= last - 1:
            C = x.shape[-1]
            sx = stitch(x[:, R + 1 :], p)
            q, k, vv = F.linear(blk.ln_1(x), blk.attn.in_proj_weight, blk.attn.in_proj_bias)[:, R + 1 :].chunk(3, dim=-1)
            q, k, vv = stitch(q, p), stitch(k, p), stitch(vv, p)
            a = F.softmax(torch.bmm(q, k.transpose(1, 2)) * (C // blk.attn.num_heads) ** -0.5, dim=-1)
            sx = sx + blk.attn.out_proj(torch.bmm(a, vv))
            feats_spatial.append(sx + blk.mlp(blk.ln_2(sx)))
        x = torch.cat([block_with_mask(blk, x[i : i + 1], ~allowed[i]) for i in range(B)])
    blk = blocks[-1]
    C = x.shape[-1]
    x_main = x[:, R:]
    x_spatial = torch.stack(feats_spatial).mean(0)
    wv, bv = blk.attn.in_proj_weight[2 * C :], blk.attn.in_proj_bias[2 * C :]
    v_main = stitch(F.linear(blk.ln_1(x_main), wv, bv)[:, 1:], p)  # 1 x Nc x C
    v_spatial = F.linear(blk.ln_1(x_spatial), wv, bv)
    cgrid = (img_shape[2] // p, img_shape[3] // p)
    val = torch.cat([v_main, v_spatial]).permute(0, 2, 1).reshape(2, C, *cgrid)
    val = F.interpolate(val, size=feat_shape, mode="bilinear", align_corners=False).flatten(2, 3).transpose(1, 2)
    x_main_spatial = blk.attn.out_proj(torch.bmm(attn_weights.expand(2, -1, -1), val))
    mct = torch.cat([block_with_mask(blk, x[i : i + 1], ~allowed[i]) for i in range(B)])[:, :R]  # B x R x C
    window_dino = tuple(s // dp for s in crops.shape[-2:])
    expand = F.interpolate(cropped_region_masks.float(), size=window_dino, mode="nearest").flatten(2, -1)
    x_semantic = stitch(expand.transpose(1, 2) @ mct, dp)
    out = v.ln_post(torch.cat([x_main_spatial, x_semantic]))
    feats = (out[0] + alpha * out[1] + beta * out[2]) @ v.proj
    return (feats, feat_shape, attn_weights) if attention else (feats, feat_shape)


def postprocess(logits: torch.Tensor, num_queries_bg: int, prob_thd: float, instance_masks: torch.Tensor) -> torch.Tensor:
    """postprocess_result for one image: logits Q x H x W at the original size (x 40 inside)."""
    seg_logit = (logits * 40).softmax(0)
    seg_logit = torch.cat([seg_logit[:num_queries_bg].max(0, keepdim=True)[0], seg_logit[num_queries_bg:]])
    seg_pred = seg_logit.argmax(0, keepdim=True)
    seg_pred[seg_logit.max(0, keepdim=True)[0] < prob_thd] = 0
    for value in torch.unique(instance_masks)[1:]:
        mask = (instance_masks == value)[None]
        seg_pred[mask] = torch.mode(seg_pred[mask])[0]
    return seg_pred[0]


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dino_b16(vit_b16):
    """ViT-B/16 (random) + a tiny DINO-layout ViT/8 installed as dino_vitb8 on the CPU (removed after)."""
    yield from installed_tiny_dino(vit_b16)


@pytest.fixture(scope="module")
def image():
    torch.manual_seed(3)
    pixels = torch.randn(1, 3, 120, 200) * 0.5 + torch.linspace(-1, 1, 200).view(1, 1, 1, 200)
    return pixels, region_map(np.random.default_rng(1), 120, 200, n=7)


# -- the stitch operator and the row blocks -----------------------------------------------------------
@pytest.mark.parametrize("size, crop, stride, patch", [((120, 200), 112, 56, 16), ((120, 200), 112, 56, 8), ((100, 150), 112, 56, 8), ((100, 150), 112, 56, 16)])
def test_stitch_equals_the_published_per_window_loop(size, crop, stride, patch):
    img = torch.zeros(1, 3, *size)
    _, locs, pads = get_windowed_imgs(img, crop, stride)
    layout = StitchLayout.of(*size, crop, stride, 56)
    assert [(y1, x1, y2, x2) for y1, y2, x1, x2 in layout.boxes] == locs and {layout.padding} == set(pads)
    h = (min(size[0], crop) + pads[0][2] + pads[0][3]) // patch
    w = (min(size[1], crop) + pads[0][0] + pads[0][1]) // patch
    feats = torch.randn(len(locs), h, w, 5, dtype=torch.float64)
    expected = published_stitch(feats.flatten(1, 2).permute(0, 2, 1), img.shape, locs, pads, patch)[0].permute(1, 2, 0)
    torch.testing.assert_close(layout.stitch(feats, patch), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax:1.5", "sparsemax"])
def test_row_blocked_attention_equals_the_full_map(normalizer):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 50, 8).unbind(0)
    full = normalize((q @ k.transpose(-2, -1)) * 0.3, normalizer) @ v
    torch.testing.assert_close(global_attention(q, k, v, 0.3, normalizer, rows=7), full, rtol=1e-5, atol=1e-6)
    allowed = torch.rand(50, 50) > 0.5
    allowed |= torch.eye(50, dtype=torch.bool)
    scores = (q[0] @ k[0].T).masked_fill(~allowed, float("-inf"))
    got = blocked_attention(lambda r0, r1: scores[r0:r1], v[0], normalizer, rows=11)
    torch.testing.assert_close(got, normalize(scores, normalizer) @ v[0], rtol=1e-5, atol=1e-6)


# -- the preset ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def softmax_features(dino_b16, image):
    clip, _ = dino_b16
    pixels, regions = image
    return stitched_features(stitch_run(clip, pixels, "ovstitcher", regions), rows=97)


def stitch_run(clip, pixels, spec, regions):
    """The run of the stitched forward on `pixels` with 112 / 56 windows and (n + 0.1) position scaling."""
    return window_run(clip, pixels, spec, regions=regions, window=112, stride=56, pos_interp="scale")


def test_ovstitcher_features_equal_the_published_forward(dino_b16, image, softmax_features):
    clip, backbone = dino_b16
    pixels, regions = image
    with torch.no_grad():
        expected, shape = published_ovstitcher(clip, backbone, pixels, regions, 112, 56)
    assert softmax_features.shape[:2] == shape == (15, 25)
    torch.testing.assert_close(softmax_features.reshape(-1, 512), F.normalize(expected, dim=-1), rtol=0, atol=1e-4)


def test_ovstitcher_labels_equal_the_published_postprocess(dino_b16):
    clip, backbone = dino_b16
    rng = np.random.default_rng(5)
    rgb = (np.linspace(0, 255, 250)[None, :, None] * np.ones((150, 1, 3)) * 0.6 + rng.integers(0, 100, (150, 250, 3))).astype(np.uint8)
    regions = region_map(rng, 152, 256, n=7)[:150, :250]
    vocabulary = Vocabulary.from_names([["background", "sky"], ["cat"], ["dog"], ["grass"]])
    settings = InferenceSettings(resolution=120, window=112, stride=56, bg_threshold=0.3, pos_interp="scale", stages=("regionvote",))
    seg = Segmenter(clip, vocabulary, "ovstitcher", settings, regions=lambda image, name: regions.numpy())
    labels = seg.predict_labels(rgb)
    img = seg.pixels(rgb)
    masks = F.interpolate(regions[None, None].float(), size=img.shape[-2:], mode="nearest")[0, 0].long()
    with torch.no_grad():
        feats, shape = published_ovstitcher(clip, backbone, img, masks, 112, 56)
        logits = (F.normalize(feats, dim=-1) @ seg.text.T).T.reshape(1, -1, *shape)
        logits = F.interpolate(F.interpolate(logits, size=img.shape[-2:], mode="bilinear"), size=rgb.shape[:2], mode="bilinear")
        expected = postprocess(logits[0], 2, 0.3, regions)
    assert img.shape[-2:] == (120, 200)
    assert (torch.from_numpy(labels) == expected).float().mean() > 0.999


def test_ovstitcher_attention_is_the_published_last_block_map(dino_b16, image):
    """What analyze and explain read of OV-Stitcher (its forward's attention, one image-wide map for all
    heads) is the published last block's region-scoped map, for softmax and entmax alike."""
    clip, backbone = dino_b16
    pixels, regions = image
    for spec in ("ovstitcher", "ovstitcher-entmax"):
        run = stitch_run(clip, pixels, spec, regions)
        (window,) = run.plan.forward.attention(run)
        with torch.no_grad():
            _, shape, published = published_ovstitcher(clip, backbone, pixels, regions, 112, 56, attention=True)
        assert window.grid == shape == (15, 25) and window.box == (0, 120, 0, 200) and window.maps.shape == (1, 375, 375)
        if spec == "ovstitcher":
            torch.testing.assert_close(window.maps[0], published[0], rtol=0, atol=1e-5)
        else:  # entmax: exact zeros where softmax spreads mass, rows still sum to 1
            assert (window.maps == 0).float().mean() > 0.5 and torch.allclose(window.maps.sum(-1), torch.ones(1, 375), atol=1e-5)


def test_explain_and_analyze_read_the_stitched_attention(dino_b16, tmp_path):
    """explain draws, for the patch under the point, the row of the published image-wide map (on DINO's
    8-px grid, no CLS); analyze's statistics over a labelled image are those of that map's rows."""
    from fake_benchmarks import make_benchmark_with_masks

    from clipseg_sparse.analysis.explain import explain
    from clipseg_sparse.analysis.statistics import analyze, attention_statistics, image_sums, normalize_rows, row_entropy
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.datasets.labels import patch_labels
    from clipseg_sparse.segment.images import load_image
    from clipseg_sparse.segment.regions import RegionFolder
    from test_corrclipv2 import Given

    clip, backbone = dino_b16
    rng = np.random.default_rng(7)
    rgb = (np.linspace(0, 255, 200)[None, :, None] * np.ones((120, 1, 3)) * 0.6 + rng.integers(0, 100, (120, 200, 3))).astype(np.uint8)
    regions = region_map(rng, 120, 200, n=7)
    settings = InferenceSettings(resolution=0, window=112, stride=56, pos_interp="scale")
    (view,) = explain(clip, rgb, "cat,sky", ["ovstitcher"], (101, 60), settings, templates="single", regions=Given(regions.numpy()))
    seg = Segmenter(clip, "cat,sky", "ovstitcher", settings, templates="single", regions=Given(regions.numpy()))
    run = seg.image_run(rgb, regions.numpy())
    with torch.no_grad():
        _, shape, published = published_ovstitcher(clip, backbone, run.pixels, run.regions, 112, 56, attention=True)
    assert view.query == (60 // 8, 101 // 8) and view.attention.shape == shape and view.heads == "mean of 1 heads"
    row = normalize_rows(published[0, view.query[0] * shape[1] + view.query[1]][None])
    np.testing.assert_allclose(view.attention, row[0].reshape(shape).numpy(), atol=1e-6)
    assert view.entropy == pytest.approx(float(row_entropy(row)), abs=1e-5)

    root, masks = make_benchmark_with_masks("voc21", tmp_path / "data", n=1, size=(120, 200))
    (sample,) = DATASETS.get("voc21").samples(root)
    overrides = {"resolution": 0, "window": 112, "stride": 56}
    record = analyze(clip, "voc21", root, "ovstitcher", "ovstitcher", overrides, regions=RegionFolder(masks), progress=False)
    image, labels = load_image(sample.image), DATASETS.get("voc21").load_label(sample.label)
    region = torch.from_numpy(np.asarray(RegionFolder(masks)(image, sample.id), dtype=np.int64))
    pixels = Segmenter(clip, "cat", "ovstitcher", PROTOCOLS.get("ovstitcher").settings("voc21", overrides), templates="single",
                       regions=RegionFolder(masks)).pixels(image)  # fmt: skip
    with torch.no_grad():
        _, shape, published = published_ovstitcher(clip, backbone, pixels, region, 112, 56, attention=True)
    grid = patch_labels(torch.from_numpy(labels.astype(np.int64))[: shape[0] * 8, : shape[1] * 8], 8)
    stats, classes = attention_statistics(published.double(), grid, None, has_cls=False)
    expected = image_sums(stats, classes)
    assert record["patches"] == expected["patches"] > 0
    assert record["metrics"]["entropy"] == pytest.approx(expected["sums"]["entropy"] / expected["patches"], abs=1e-6)
    assert record["metrics"]["diffusivity"] == pytest.approx(expected["sums"]["diffusivity"] / expected["patches"], abs=1e-6)


def test_ovstitcher_entmax_near_one_is_the_softmax_preset(dino_b16, image, softmax_features):
    clip, _ = dino_b16
    pixels, regions = image
    spec = resolve_spec("ovstitcher-entmax")
    near = stitched_features(stitch_run(clip, pixels, spec.replace(normalizer="entmax:1.0001"), regions))
    torch.testing.assert_close(near, softmax_features, rtol=0, atol=2e-3)
    assert spec.normalizer == "entmax:1.5" and spec.replace(normalizer="softmax") == resolve_spec("ovstitcher")
    far = stitched_features(stitch_run(clip, pixels, spec, regions))
    assert (far - softmax_features).abs().max() > 1e-2


def test_stitch_needs_its_tap_and_form(dino_b16, image):
    clip, _ = dino_b16
    pixels, regions = image
    with pytest.raises(ValueError, match="stitch:M"):
        clip.encode_dense(pixels[..., :112, :112], "ext:dino_vitb8.out[cos,scale:4,region:0.2]/softmax/cls:0/noffn", regions=regions[None, :112, :112])
    with pytest.raises(ValueError, match="stitch:M needs"):
        stitch_run(clip, pixels, "ext:dino_vitb8.qk[cos,scale:4,region:0.2]/softmax/cls:0/noffn/stitch:56", regions)
    with pytest.raises(ValueError, match="stitch:3.5"):
        resolve_spec("ovstitcher").parse("qk/softmax/stitch:3.5")


def test_ovstitcher_protocol_follows_the_configs():
    protocol = PROTOCOLS.get("ovstitcher")
    for dataset, (short, window, stride, thd) in {
        "voc21": (448, 336, 112, 0.1), "context60": (448, 336, 112, 0.1), "coco-object": (448, 336, 112, 0.2), "voc20": (448, 336, 112, 0.0),
        "context59": (448, 336, 112, 0.0), "ade20k": (448, 336, 112, 0.0), "coco-stuff": (448, 336, 224, 0.0), "cityscapes": (560, 224, 112, 0.0),
    }.items():  # fmt: skip  (cfg_coco_stuff164k.py: slide_stride=224)
        s = protocol.settings(dataset)
        assert (s.resolution, s.window, s.stride, s.bg_threshold, s.logit_scale) == (short, window, stride, thd, 40.0)
        assert s.stages == ("regionvote",) and s.pos_interp == "scale"
    assert "stitch:56" in str(resolve_spec(protocol.attention)) and "in:mean@11-22" in str(resolve_spec("ovstitcher-l14"))


def test_segment_cli_runs_a_stitched_spec(proxy, tmp_path):  # noqa: F811
    from test_corrclip import _segment

    (tmp_path / "img").mkdir()
    (tmp_path / "masks").mkdir()
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 255, (72, 100, 3), dtype=np.uint8)).save(tmp_path / "img" / "a.png")
    np.save(tmp_path / "masks" / "a.npy", region_map(rng, 72, 104)[:, :100].numpy().astype(np.int32))
    spec = "ext:dino_vitb8.out[cos,scale:4,region:0.2]/softmax/cls:0/noffn/in:mean@{}/mct:0.5/stitch:56"
    res = _segment(tmp_path, "--attn", spec.format("2-3"), "--regions", str(tmp_path / "masks"))
    lines = [line for line in res.output.splitlines() if line.strip()]
    # refused before any backbone or image: by the stitched check, or first by the model's depth check (check_spec)
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "re-runs block 3, but the model has 3 blocks" in lines[0] or "reads block 3, which is edited or past the last block" in lines[0], lines[0]
    res = _segment(tmp_path, "--attn", spec.format("1-2"), "--regions", str(tmp_path / "masks"))
    assert res.exit_code == 0, res.output
    labels = np.asarray(Image.open(tmp_path / "out" / "a.png"))
    assert labels.shape == (72, 100) and "stitch:56" in (tmp_path / "out" / "a.json").read_text()


def test_reproduce_grid_and_its_prompt_file(tmp_path):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("ovstitcher")).grid
    assert list(g.models) == ["ViT-B-16:openai", "ViT-B-16-quickgelu:metaclip_fullcc"] and g.protocol == "ovstitcher"
    assert set(g.attention_specs()) == {str(resolve_spec("ovstitcher").replace(normalizer=n)) for n in ("softmax", "entmax:1.5")}
    assert len(g.datasets) == 8 and len(g.cells()) == 2 * 8 * 2
    (tmp_path / "p.json").write_text('{"cat": "not a list"}')
    res = CliRunner().invoke(app, ["reproduce", "ovstitcher", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "out")], env={"COLUMNS": "300"})
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "p.json: class 'cat': expected a list" in lines[0], res.output
