"""SFP (presets `sfp`, `sfp-entmax`, token stage `som`, tap `xcut`, protocol `sfp`) against a transcription of
Kimsure/SFP@2804f5b (`SFP_ICCV/clip/model.py`: `VisionTransformer.forward` with pm='SOM', `custom_attn`,
`sinkhorn_attn`, `mean_interpolation`, `adaptively_aggregate`; `SFP_ICCV/SFP_segmentor.py`: `forward_feature`,
`forward_slide`, `postprocess_result`), run on a random-init ViT-B/16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sclip_line_reference import (
    block, embed, engine_pipeline, heads, labels_off_ties, merge, sclip_postprocess, slide_inference, structured, window_logits,
)
from clipseg_sparse.attention import AttentionSpec, attention_maps
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.methods import sfp


# -- transcription (model.py l.242-446) ----------------------------------------------------------------------------
def ref_som(attn_map: torch.Tensor, feat_w: int):
    """l.264 + 271-287: block 11's H x N x N map, CLS -> patch row x 1.5, head mean, salient = CLS -> p > p -> p,
    the 10 most CLS-attended salient patches; cells (loc // feat_w, loc % feat_w)."""
    a = attn_map.clone()
    a[:, 0, 1:] *= 0.3 * 5.0
    a = a.mean(dim=0)
    cls_to_patch = a[0, 1:]
    salient_mask = cls_to_patch > torch.diag(a[1:, 1:])
    salient_locs = torch.nonzero(salient_mask, as_tuple=False).squeeze(1)
    _, order_idx = torch.sort(cls_to_patch[salient_mask], descending=True)
    return [(int(loc) // feat_w, int(loc) % feat_w) for loc in salient_locs[order_idx[:10]]]


def ref_mean_interpolation(fmap: torch.Tensor, keep_pixels) -> torch.Tensor:
    """l.416-441: each listed cell <- mean of its non-listed 3x3 neighbours; none valid: sum / 1 = 0."""
    if len(keep_pixels) == 0:
        return fmap
    _, c, h, w = fmap.shape
    kernel = torch.ones((c, 1, 3, 3), dtype=fmap.dtype)
    kernel[:, :, 1, 1] = 0
    xy = torch.tensor(keep_pixels, dtype=torch.long)
    spatial = torch.ones((1, 1, h, w), dtype=fmap.dtype)
    spatial[:, :, xy[:, 0], xy[:, 1]] = 0
    neigh_sum = F.conv2d(F.pad(fmap * spatial, (1, 1, 1, 1)), kernel, groups=c)
    neigh_cnt = F.conv2d(F.pad(spatial, (1, 1, 1, 1)), kernel[:, :1], groups=1)
    neigh_cnt[neigh_cnt == 0] = 1
    upd = torch.zeros((1, 1, h, w), dtype=fmap.dtype)
    upd[:, :, xy[:, 0], xy[:, 1]] = 1
    return fmap * (1 - upd) + neigh_sum / neigh_cnt * upd


def _repair(tokens, rows, cols, outliers):
    C = tokens.shape[-1]
    return ref_mean_interpolation(tokens.T.reshape(1, C, rows, cols), outliers).reshape(C, rows * cols).T


def ref_aggregate(feat, sim):
    """l.443-446."""
    return (sim / (sim.sum(dim=-1, keepdim=True) + 1e-6)) @ feat


def ref_custom_attn(attn, u, sim, maps=None):
    """l.358-378: (softmax(s kk^T) + softmax(s qq^T) + softmax(mask(3 (sim - mean sim)))) / 3."""
    q, k, v = heads(attn, u)
    scale = q.shape[-1] ** -0.5
    s = (sim - torch.mean(sim)) * 3.0
    s[s < 0.0] = float("-inf")
    w = (F.softmax(k @ k.transpose(1, 2) * scale, -1) + F.softmax(q @ q.transpose(1, 2) * scale, -1) + F.softmax(s, -1).unsqueeze(0)) / 3
    if maps is not None:
        maps.append(w)
    return merge(attn, w @ v)


def ref_sinkhorn_attn(attn, u, sim):
    """l.380-394: softmax(mask(3 (sim - mean))) on the values alone."""
    _, _, v = heads(attn, u)
    s = (sim - torch.mean(sim)) * 3.0
    s[s < 0.0] = float("-inf")
    return merge(attn, F.softmax(s, dim=-1).unsqueeze(0) @ v)


@torch.no_grad()
def ref_sfp_encode(visual, img, found=None, maps=None):
    """forward(x, return_each=True), pm='SOM': patch features (rows*cols) x D before L2-normalisation."""
    x, rows, cols = embed(visual, img[0:1])
    blocks = visual.transformer.resblocks
    hidden = []
    for idx, blk in enumerate(blocks[:-1], start=1):
        x, amap = block(blk, x, want=True)
        hidden.append(x)
        if idx == len(blocks) - 1:
            outliers = ref_som(amap, rows)
            patch_token = _repair(x[1:], rows, cols, outliers)
            hidden.append(x)
    if found is not None:
        found.append(outliers)
    patch_state = torch.stack(hidden[3:10]).sum(0)
    ref = _repair(hidden[8][1:].clone(), rows, cols, outliers)
    ref = ref / ref.norm(dim=-1, keepdim=True)
    pre_sim = ref @ ref.T
    pre_sim[pre_sim < 0.4] = 0.0
    patch_token = ref_aggregate(patch_token, pre_sim)
    last = blocks[-1]
    patch_token = ref_custom_attn(last.attn, last.ln_1(patch_token), pre_sim, maps) + 0.3 * x[:1]
    aux = hidden[3][1:].clone()
    aux = aux / aux.norm(dim=-1, keepdim=True)
    post_sim = aux @ aux.T
    post_sim[post_sim < 0.4] = 0.0
    patch_token = ref_aggregate(patch_token, post_sim)
    ps = ref_sinkhorn_attn(last.attn, last.ln_1(patch_state[1:]), pre_sim) + 0.3 * patch_state[:1]
    patch_token = patch_token + ref_aggregate(ps, post_sim)
    return visual.ln_post(patch_token) @ visual.proj


@torch.no_grad()
def ref_sfp_predict(visual, img, text, query_idx, ori_shape, logit_scale, prob_thd, area_thd):
    """SFP_segmentor.py predict -> forward_slide (224 / 112, no PAMR) -> postprocess_result."""
    preds = slide_inference(lambda c: window_logits(ref_sfp_encode(visual, c), text, c), img)
    logits = F.interpolate(preds, size=ori_shape, mode="bilinear", align_corners=False)[0]
    return (logits, *sclip_postprocess(logits, query_idx, logit_scale, prob_thd, area_thd))



# -- the preset against the transcription ------------------------------------------------------------------------
def test_sfp_equals_the_published_forward(vit_b16):
    """Each window alone through the published forward; the engine runs both in one batch."""
    pixels = structured(2, (224, 224), seed=3)
    with torch.no_grad():
        ours = vit_b16.encode_dense(pixels, "sfp").reshape(2, 196, -1)
        ours_maps = attention_maps(vit_b16, pixels, "sfp")
    for b in range(2):
        found, ref_maps = [], []
        ref = F.normalize(ref_sfp_encode(vit_b16.visual, pixels[b : b + 1], found, ref_maps), dim=-1)
        assert found[0], "SOM finds outliers on these weights (the repair is exercised)"
        assert (ours[b] - ref).abs().max() < 1e-4, (ours[b] - ref).abs().max()
        assert (ours_maps[b] - ref_maps[0]).abs().max() < 1e-5


def test_sfp_pipeline_equals_the_published_one(vit_b16):
    """Two windows, synonyms, VOC21's logit scale, prob_thd and area_thd: cosine and probabilities within 1e-4,
    labels equal off near-ties."""
    pixels = structured(1, (224, 336), seed=5)
    text = F.normalize(torch.randn(6, 512, generator=torch.Generator().manual_seed(1)), dim=-1)
    query_idx = [0, 0, 1, 2, 3, 4]
    logits, probs, labels = ref_sfp_predict(vit_b16.visual, pixels, text, query_idx, (240, 360), 50.0, 0.15, 0.1)
    cos, our_probs, our_labels = engine_pipeline(vit_b16, pixels, "sfp", text, query_idx, (240, 360), 50.0, 0.15, 0.1)
    assert (cos - logits).abs().max() < 1e-4
    assert (our_probs - probs).abs().max() < 1e-4
    sure = labels_off_ties(probs)
    assert sure.float().mean() > 0.9 and torch.equal(our_labels[sure], labels[sure])


def test_som_finds_the_published_outliers():
    """On random maps with few and many salient patches, and on a non-square grid read with the column count."""
    g = torch.Generator().manual_seed(0)
    for rows, cols, bias in ((6, 6, 0.0), (6, 6, 3.0), (5, 7, 1.0)):
        logits = torch.randn(4, 1 + rows * cols, 1 + rows * cols, generator=g)
        logits[:, 0, 1:] += bias  # more salient patches as the CLS row grows
        maps = logits.softmax(-1)
        ours = sfp.som_outliers(maps).view(rows, cols)
        cells = ref_som(maps, cols)  # the published cells with feat_w = the column count (the code's is the row count)
        expected = torch.zeros(rows, cols, dtype=torch.bool)
        for r, c in cells:
            expected[r, c] = True
        assert torch.equal(ours, expected) and 0 < len(cells) <= 10


def test_an_outlier_without_a_valid_neighbour_becomes_zero():
    """SFP's mean_interpolation divides an empty sum by 1 (SC-CLIP's keeps the token)."""
    torch.manual_seed(0)
    tokens = torch.randn(25, 8)
    cells = [(r, c) for r in range(1, 4) for c in range(1, 4)]  # a 3x3 block: its centre has no valid neighbour
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for r, c in cells:
        mask[r, c] = True
    x = torch.cat([torch.randn(1, 1, 8), tokens[None]], dim=1)
    out = sfp.scclip.repair_outliers(x, (5, 5), {}, lambda b, patches: mask.flatten(), keep_isolated=False)
    assert torch.allclose(out[0, 1:], _repair(tokens, 5, 5, cells), atol=1e-6) and not out[0, 1 + 12].any()


# -- the engine features SFP brought -----------------------------------------------------------------------------
def test_an_extra_input_attends_with_its_own_terms(tiny_clip):
    """`in:sum@1-2(kk)` runs the last block on the sum with softmax(kk) alone, whatever the main terms."""
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        both = tiny_clip.encode_dense(pixels, "qq/softmax/cls:0.3/noffn/in:sum@1-2(kk)")
        main = tiny_clip.encode_dense(pixels, "qq/softmax/cls:0.3/noffn")
        x, grid = tiny_clip._embed(pixels)
        blocks = tiny_clip.visual.transformer.resblocks
        hidden = []
        for blk in blocks[:-1]:
            x = blk(x)
            hidden.append(x)
        r = hidden[0] + hidden[1]
        q, k, v = heads(blocks[-1].attn, blocks[-1].ln_1(r[0, 1:]))
        y = merge(blocks[-1].attn, torch.softmax(k @ k.transpose(1, 2) * k.shape[-1] ** -0.5, -1) @ v) + 0.3 * r[0, :1]
        main_tokens = tiny_clip.dense_tokens(pixels, "qq/softmax/cls:0.3/noffn")[0].reshape(-1, x.shape[-1])
        expected = F.normalize(tiny_clip.visual.ln_post(main_tokens + y) @ tiny_clip.visual.proj, dim=-1)
    assert not torch.allclose(both, main, atol=1e-3)
    assert (both.reshape(-1, expected.shape[-1]) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("text", ["kk/softmax/in:sum@1-2(qq+0.5*kk[cos])", "kk/softmax/in:0.5*mean@1-2((kk&qq))"])
def test_input_terms_round_trip(text):
    spec = AttentionSpec.parse(text)
    assert AttentionSpec.parse(str(spec)) == spec and spec.block_inputs[0].source


@pytest.mark.parametrize("bad", ["kk/softmax/in:sum@1-2()", "kk/softmax/in:sum@1-2(kk", "kk/softmax/in:sum@1-2(zz)"])
def test_bad_input_terms_are_refused(bad):
    with pytest.raises(ValueError):
        AttentionSpec.parse(bad)


def test_a_token_stage_cannot_read_an_edited_block(tiny_clip):
    """som reads the block before the edited one; with every block edited there is none."""
    with pytest.raises(UserValueError, match="blocks 1..0 run before"):
        tiny_clip.encode_dense(torch.randn(1, 3, 64, 64), "kk/softmax/layers:3/hook:som")


def test_xcut_is_the_thresholded_cosine(tiny_clip):
    """`xcut@1:0.4[shift:1,scale:3,pos]` = SFP's mid map: cos(x_1), < 0.4 -> 0, then (S - mean) x 3, -inf below 0."""
    torch.manual_seed(2)
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        maps = attention_maps(tiny_clip, pixels, "xcut@1:0.4[shift:1,scale:3,pos]/softmax/cls:0/noffn")
        x, _ = tiny_clip._embed(pixels)
        x1 = tiny_clip.visual.transformer.resblocks[0](x)[0, 1:]
        s = F.normalize(x1, dim=-1) @ F.normalize(x1, dim=-1).T
        s[s < 0.4] = 0.0
        s = (s - s.mean()) * 3.0
        s[s < 0] = float("-inf")
    assert (maps[0, 0] - s.softmax(-1)).abs().max() < 1e-6


# -- entmax, protocol, grid ---------------------------------------------------------------------------------------
def test_sfp_entmax_tends_to_sfp(vit_b16):
    pixels = structured(1, (224, 224), seed=3)
    with torch.no_grad():
        soft = vit_b16.encode_dense(pixels, "sfp")
        near = vit_b16.encode_dense(pixels, "sfp/entmax:1.0001")
        sparse = vit_b16.encode_dense(pixels, "sfp-entmax")
    assert (near - soft).abs().max() < 1e-3
    assert (sparse - soft).abs().max() > 1e-2
    assert AttentionSpec.parse("sfp-entmax") == AttentionSpec.parse("sfp").replace(normalizer="entmax:1.5")


# typed from Kimsure/SFP@2804f5b SFP_ICCV/configs/cfg_*.py and SFPSegmentation's defaults
SFP_PUBLISHED = {
    "voc21": dict(resolution=336, window=224, stride=112, logit_scale=50, bg_threshold=0.15, area_threshold=0.1, pamr=False),
    "context60": dict(resolution=336, logit_scale=40, bg_threshold=0.15, area_threshold=0),
    "coco-object": dict(resolution=336, logit_scale=55, bg_threshold=0.35),
    "voc20": dict(resolution=336, window=224, logit_scale=40, bg_threshold=0),
    "context59": dict(resolution=336, logit_scale=40),
    "coco-stuff": dict(resolution=336, window=224, logit_scale=40),
    "cityscapes": dict(resolution=560, window=224, stride=112),
    "ade20k": dict(resolution=384, window=224, stride=112, logit_scale=40, bg_threshold=0),
}


@pytest.mark.parametrize("dataset", list(SFP_PUBLISHED))
def test_sfp_protocol_matches_the_published_configs(dataset):
    settings = sfp.PROTOCOL.settings(dataset)
    for name, value in SFP_PUBLISHED[dataset].items():
        assert getattr(settings, name) == pytest.approx(value), name


@pytest.mark.parametrize("dataset,line", [("voc21", 16), ("voc20", 15), ("cityscapes", 12)])
def test_sfp_class_files_say_people(dataset, line):
    from clipseg_sparse.datasets import class_vocabulary

    vocab, version = class_vocabulary(dataset, "sfp")
    sclip, _ = class_vocabulary(dataset, "sclip")
    differs = [i for i, (a, b) in enumerate(zip(vocab.names, sclip.names)) if a != b]
    assert differs == [line - 1] and vocab.names[line - 1][0] == "people"
    assert version.startswith("sfp/")
    assert class_vocabulary("ade20k", "sfp")[0].names == class_vocabulary("ade20k", "sclip")[0].names


def test_sfp_grid_crosses_the_preset_with_softmax_and_entmax():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("sfp")).grid
    assert g.protocol == "sfp" and list(g.presets) == ["sfp"] and list(g.normalizers) == ["softmax", "entmax:1.5"]
    assert set(g.datasets) == set(DATASETS.names()) and list(g.models) == ["ViT-B-16"]


def test_published_numbers_cover_the_8_benchmarks():
    from clipseg_sparse.datasets import DATASETS

    from clipseg_sparse.evaluation.published import PUBLISHED

    row = PUBLISHED.get("sfp")
    assert set(row.miou) == set(DATASETS.names()) and "table1" in row.source
    assert sum(row.miou.values()) / 8 == pytest.approx(44.0, abs=0.05)  # the table's avg-8
