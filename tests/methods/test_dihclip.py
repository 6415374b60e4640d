"""DiH-CLIP (presets `dihclip`, `dihclip-entmax`, option `heads`, tap `sha`, protocol `dihclip`) against a
transcription of duan-song/DiH-CLIP@775b609 (`clip/model.py`: `VisionTransformer.forward`, `custom_attn`,
`vanilla_attn`, `adaptively_aggregate`; `clip_segmentor.py`: `forward_feature` with its unpacking of
`encode_image` fixed, `forward_slide`, `postprocess_result`), run on a random-init ViT-B/16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sclip_line_reference import embed, engine_pipeline, heads, labels_off_ties, merge, sclip_postprocess, slide_inference, structured, window_logits
from clipseg_sparse.attention import AttentionSpec, attention_maps
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.methods import dihclip


# -- transcription (model.py l.237-413) ----------------------------------------------------------------------------
def ref_full_values(v):
    """l.341-342: v (H x N x d) -> every token's full value, 1 x N x H*d."""
    H, N, d = v.shape
    return v.transpose(0, 1).contiguous().view(-1, N, H * d)


def ref_selected(maps, topk=4):
    """l.329-336: entropy of each head's whole map; the heads whose value is among the topk lowest."""
    prob = maps.reshape(maps.shape[0], -1)
    metrics = -torch.sum(prob * torch.log2(prob + 1e-6), dim=-1)
    sorted_metrics = torch.sort(metrics)[0][:topk]
    return [i for i in range(maps.shape[0]) if bool((sorted_metrics == metrics[i]).any())]


def ref_vanilla_attn(attn, u, topk=4):
    """l.361-408: the ordinary output, and SHA: the selected heads' (qk entropy) softmax(kk) on all values, summed."""
    q, k, v = heads(attn, u)
    scale = q.shape[-1] ** -0.5
    attn_weights = F.softmax((q * scale) @ k.transpose(1, 2), dim=-1)
    v_orig = ref_full_values(v)
    attn_mhsa = F.softmax((k * scale) @ k.transpose(1, 2), dim=-1)
    v_out = torch.zeros_like(v_orig)
    for i in ref_selected(attn_weights, topk):
        v_out += attn_mhsa[i].unsqueeze(0) @ v_orig
    return merge(attn, attn_weights @ v), attn.out_proj(v_out[0])


def ref_custom_attn(attn, u, mid_simi, topk=4, maps=None):
    """l.305-359: A = (softmax(mask(3 (mid - mean))) + softmax(s kk^T)) / 2; the topk lowest-entropy heads of A
    on all values, summed, / num_heads."""
    q, k, v = heads(attn, u)
    H = q.shape[0]
    m = (mid_simi - torch.mean(mid_simi)) * 3.0
    m[m < 0.0] = float("-inf")
    w = (F.softmax(m, dim=-1).unsqueeze(0).repeat(H, 1, 1) + F.softmax(k @ k.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)) / 2
    if maps is not None:
        maps.append(w)
    v_orig = ref_full_values(v)
    v_out = torch.zeros_like(v_orig)
    for i in ref_selected(w, topk):
        v_out += w[i].unsqueeze(0) @ v_orig
    return attn.out_proj((v_out / H)[0])


def ref_aggregate(feat, corrs):
    """l.410-413."""
    return (corrs / (corrs.sum(dim=-1, keepdim=True) + 1e-6)) @ feat


@torch.no_grad()
def ref_dihclip_encode(visual, img, maps=None):
    """forward(x, return_all=True) l.237-297: hw x 512 patch features."""
    x, _, _ = embed(visual, img)
    blocks = visual.transformer.resblocks
    feats_list, x_attn_out_list = [], []
    for idx, blk in enumerate(blocks[:-1], start=1):
        x_out, attn_out = ref_vanilla_attn(blk.attn, blk.ln_1(x))
        x = x + x_out
        x = x + blk.mlp(blk.ln_2(x))
        x_attn_out_list.append(x + attn_out)
        feats_list.append(x)
        if idx == len(blocks) - 1:
            cls_token, x = x[:1], x[1:]
    feats = x_attn_out_list[8][1:].clone()
    feats = feats / feats.norm(dim=-1, keepdim=True)
    before_simi = feats @ feats.T
    mid_simi = before_simi.clone()
    before_simi[before_simi < 0.4] = 0.0
    x = ref_aggregate(x, before_simi)
    last = blocks[-1]
    x = ref_custom_attn(last.attn, last.ln_1(x), mid_simi, maps=maps) + 0.3 * cls_token
    feats = feats_list[3][1:].clone()
    feats = feats / feats.norm(dim=-1, keepdim=True)
    after_simi = feats @ feats.T
    after_simi[after_simi < 0.4] = 0.0
    x = ref_aggregate(x, after_simi)
    re_feats = torch.zeros_like(feats_list[0])
    for i in range(3, 10):
        re_feats += feats_list[i]
    cls_token = re_feats[:1]
    re_feats = ref_custom_attn(last.attn, last.ln_1(re_feats[1:]), mid_simi) + 0.3 * cls_token
    x = x + ref_aggregate(re_feats, after_simi)
    return visual.ln_post(x) @ visual.proj


@torch.no_grad()
def ref_dihclip_predict(visual, img, text, query_idx, ori_shape, logit_scale, prob_thd, area_thd):
    """clip_segmentor.py predict -> forward_slide (224 / 112, no PAMR) -> postprocess_result."""
    preds = slide_inference(lambda c: window_logits(ref_dihclip_encode(visual, c), text, c), img)
    logits = F.interpolate(preds, size=ori_shape, mode="bilinear", align_corners=False)[0]
    return (logits, *sclip_postprocess(logits, query_idx, logit_scale, prob_thd, area_thd))



# -- the preset against the transcription ------------------------------------------------------------------------
def test_dihclip_equals_the_published_forward(vit_b16):
    """Each window alone through the published forward; the engine runs both in one batch."""
    pixels = structured(2, (224, 224), seed=3)
    with torch.no_grad():
        ours = vit_b16.encode_dense(pixels, "dihclip").reshape(2, 196, -1)
        ours_maps = attention_maps(vit_b16, pixels, "dihclip")
    for b in range(2):
        ref_maps = []
        ref = F.normalize(ref_dihclip_encode(vit_b16.visual, pixels[b : b + 1], ref_maps), dim=-1)
        assert (ours[b] - ref).abs().max() < 1e-4, (ours[b] - ref).abs().max()
        assert (ours_maps[b] - ref_maps[0]).abs().max() < 1e-5


def test_dihclip_pipeline_equals_the_published_one(vit_b16):
    """Two windows, synonyms, VOC21's logit scale, prob_thd and area_thd: cosine and probabilities within 1e-4,
    labels equal off near-ties."""
    pixels = structured(1, (224, 336), seed=5)
    text = F.normalize(torch.randn(6, 512, generator=torch.Generator().manual_seed(1)), dim=-1)
    query_idx = [0, 0, 1, 2, 3, 4]
    logits, probs, labels = ref_dihclip_predict(vit_b16.visual, pixels, text, query_idx, (240, 360), 50.0, 0.15, 0.1)
    cos, our_probs, our_labels = engine_pipeline(vit_b16, pixels, "dihclip", text, query_idx, (240, 360), 50.0, 0.15, 0.1)
    assert (cos - logits).abs().max() < 1e-4
    assert (our_probs - probs).abs().max() < 1e-4
    sure = labels_off_ties(probs)
    assert sure.float().mean() > 0.9 and torch.equal(our_labels[sure], labels[sure])


# -- the engine features DiH-CLIP brought -------------------------------------------------------------------------
def test_lowest_entropy_heads_keep_ties_at_the_last_value():
    g = torch.Generator().manual_seed(0)
    maps = torch.randn(2, 6, 5, 5, generator=g).softmax(-1)
    maps[1, 4] = maps[1, 2]  # a tie
    keep = dihclip.lowest_entropy_heads(maps, 3)
    for b in range(2):
        assert keep[b].nonzero().flatten().tolist() == ref_selected(maps[b], 3)
    assert int(keep[0].sum()) == 3


def test_heads_option_applies_selected_maps_to_every_heads_values(tiny_clip):
    """`kk/softmax/noffn/heads:1,2` = out_proj(softmax(kk) of the lowest-entropy head @ all values / 2) + x."""
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        tokens = tiny_clip.dense_tokens(pixels, "kk/softmax/noffn/heads:1,2")[0]
        x, _ = tiny_clip._embed(pixels)
        blocks = tiny_clip.visual.transformer.resblocks
        for blk in blocks[:-1]:
            x = blk(x)
        last = blocks[-1]
        q, k, v = heads(last.attn, last.ln_1(x[0]))
        w = F.softmax(k @ k.transpose(1, 2) * k.shape[-1] ** -0.5, dim=-1)
        (h,) = ref_selected(w, 1)
        expected = x[0] + last.attn.out_proj(w[h] @ ref_full_values(v)[0] / 2)
    assert (tokens.reshape(-1, expected.shape[-1]) - expected[1:]).abs().max() < 1e-5


def test_sha_tap_is_the_hidden_state_plus_the_selected_head_output(vit_b16):
    """`sha@9[cos]` maps = softmax of cos(x_9 + SHA_9) (SHA from block 9 on x_8, heads by qk-map entropy)."""
    pixels = structured(1, (224, 224), seed=4)
    with torch.no_grad():
        maps = attention_maps(vit_b16, pixels, "sha@9[cos]/softmax/cls:0/noffn")
        x, _, _ = embed(vit_b16.visual, pixels)
        blocks = vit_b16.visual.transformer.resblocks
        for blk in blocks[:8]:
            x = blk(x[None])[0]
        x_out, sha = ref_vanilla_attn(blocks[8].attn, blocks[8].ln_1(x))
        x9 = x + x_out
        x9 = x9 + blocks[8].mlp(blocks[8].ln_2(x9))
        f = F.normalize((x9 + sha)[1:], dim=-1)
    assert (maps[0, 0] - (f @ f.T).softmax(-1)).abs().max() < 1e-5


@pytest.mark.parametrize("bad", ["kk/softmax/heads:0,12", "kk/softmax/heads:4", "kk/softmax/heads:4,0", "sha@1[cos]/softmax", "sha@9:x[cos]/softmax"])
def test_bad_heads_and_sha_arguments_are_refused(bad):
    with pytest.raises(UserValueError):
        AttentionSpec.parse(bad)


# -- entmax, protocol, grid, published numbers ----------------------------------------------------------------------
def test_dihclip_entmax_tends_to_dihclip(vit_b16):
    pixels = structured(1, (224, 224), seed=3)
    with torch.no_grad():
        soft = vit_b16.encode_dense(pixels, "dihclip")
        near = vit_b16.encode_dense(pixels, "dihclip/entmax:1.0001")
        sparse = vit_b16.encode_dense(pixels, "dihclip-entmax")
    assert (near - soft).abs().max() < 1e-3
    assert (sparse - soft).abs().max() > 2e-3  # unit features; entmax:1.5 changes the last block's maps
    assert AttentionSpec.parse("dihclip-entmax") == AttentionSpec.parse("dihclip").replace(normalizer="entmax:1.5")


# typed from duan-song/DiH-CLIP@775b609 configs/cfg_*.py and the segmentor's defaults
DIHCLIP_PUBLISHED = {
    "voc21": dict(resolution=336, window=224, stride=112, logit_scale=50, bg_threshold=0.15, area_threshold=0.1, pamr=False),
    "context60": dict(resolution=336, logit_scale=40, bg_threshold=0.15),
    "coco-object": dict(resolution=336, logit_scale=55, bg_threshold=0.35),
    "voc20": dict(resolution=336, window=224, logit_scale=40, bg_threshold=0),
    "context59": dict(resolution=336, logit_scale=40),
    "coco-stuff": dict(resolution=336, window=224, logit_scale=40),
    "cityscapes": dict(resolution=560, window=224, stride=112),
    "ade20k": dict(resolution=336, window=224, stride=112, logit_scale=40, bg_threshold=0),
}


@pytest.mark.parametrize("dataset", list(DIHCLIP_PUBLISHED))
def test_dihclip_protocol_matches_the_published_configs(dataset):
    settings = dihclip.PROTOCOL.settings(dataset)
    for name, value in DIHCLIP_PUBLISHED[dataset].items():
        assert getattr(settings, name) == pytest.approx(value), name
    assert dihclip.PROTOCOL.attention == "dihclip" and dihclip.PROTOCOL.class_names == "sclip"


def test_dihclip_grid_and_published_numbers():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("dihclip")).grid
    assert g.protocol == "dihclip" and list(g.presets) == ["dihclip"] and list(g.normalizers) == ["softmax", "entmax:1.5"]
    assert set(g.datasets) == set(DATASETS.names())
    from clipseg_sparse.evaluation.published import PUBLISHED

    row = PUBLISHED.get("dihclip")
    assert set(row.miou) == set(DATASETS.names())
    assert sum(row.miou.values()) / 8 == pytest.approx(43.6, abs=0.05)  # the table's avg-8
