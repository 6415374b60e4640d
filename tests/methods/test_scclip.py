"""SC-CLIP (preset `scclip`, `scclip-l14`; stage `lof`; protocol `scclip`) against a transcription of
SuleBai/SC-CLIP@0417ba9 on random-init ViT-B/16, and its configs' constants."""

import pytest
import torch
import torch.nn.functional as F

from conftest import structured_pixels
from clipseg_sparse.attention import AttentionSpec, attention_maps


def _lof(x, n_neighbors=30, contamination=0.05):
    """SuleBai/SC-CLIP@0417ba9 clip/model.py lof_pytorch, transcribed."""
    distances = torch.norm(x[:, None] - x[None, :], dim=2, p=2) ** 2
    knn_distances, knn_indices = torch.topk(distances, k=n_neighbors + 1, largest=False)
    knn_distances, knn_indices = knn_distances[:, 1:], knn_indices[:, 1:]
    k_distances = knn_distances[:, -1].unsqueeze(1).expand_as(knn_distances)
    reach_distances = torch.max(knn_distances, k_distances)
    LRD = n_neighbors / torch.nan_to_num(reach_distances.mean(dim=1), nan=1e-6)
    LOF = (LRD[knn_indices] / LRD.unsqueeze(1)).mean(dim=1)
    return torch.where(LOF > torch.quantile(LOF.to(torch.float32), 1 - contamination))[0]


def _mean_interpolation(fmap, cells):
    """SC-CLIP's mean_interpolation with an explicit loop over outlier cells (fmap: C x h x w)."""
    C, h, w = fmap.shape
    bad = {(int(r), int(c)) for r, c in cells}
    out = fmap.clone()
    for r, c in bad:
        good = [fmap[:, rr, cc] for rr in range(r - 1, r + 2) for cc in range(c - 1, c + 2)
                if (rr, cc) != (r, c) and 0 <= rr < h and 0 <= cc < w and (rr, cc) not in bad]
        if good:
            out[:, r, c] = torch.stack(good).mean(0)
    return out


def _scclip_reference(clip, pixels, pre=8, post=3, start=3, end=10, res_cls=0.3, beta=0.4, maps=None):
    """SC-CLIP's VisionTransformer.forward (return_all) for one image, batch first, then ln_post/proj/L2.
    `maps` (a list) receives the main path's H x N x N attention."""
    v = clip.visual
    x, (h, w) = clip._embed(pixels)
    blocks = v.transformer.resblocks
    feats = []
    for blk in blocks[:-1]:
        x = blk(x)
        feats.append(x)
    cls_token = x[:, :1]
    out_idx = _lof(x[0, 1:])
    cells = [(int(i) // w, int(i) % w) for i in out_idx]
    C = x.shape[-1]
    x = _mean_interpolation(x[0, 1:].T.reshape(C, h, w), cells).reshape(C, h * w).T[None]
    f = _mean_interpolation(feats[pre][0, 1:].T.reshape(C, h, w), cells).reshape(C, h * w).T[None]
    f = f / f.norm(dim=2, keepdim=True)
    before = f @ f.transpose(1, 2)
    mid = before.clone()
    before[before < beta] = 0.0

    def aggregate(t, corr):
        return (corr / (corr.sum(dim=-1, keepdim=True) + 1e-6)) @ t

    def custom_attn(blk, t):
        q, k, val = _qkv_plain(blk, t)
        m = (mid - torch.mean(mid)) * 3.0
        m[m < 0.0] = float("-inf")
        a = torch.softmax(m, -1) + torch.softmax(k @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
        a = a / 2
        if maps is not None:
            maps.append(a)
        return blk.attn.out_proj((a @ val).transpose(0, 1).reshape(1, -1, C))

    x = aggregate(x, before)
    x = custom_attn(blocks[-1], blocks[-1].ln_1(x)) + res_cls * cls_token
    g = feats[post][:, 1:] / feats[post][:, 1:].norm(dim=2, keepdim=True)
    after = g @ g.transpose(1, 2)
    after[after < beta] = 0.0
    x = aggregate(x, after)
    re = torch.zeros_like(feats[0])
    for i in range(start, end):
        re += feats[i]
    r = custom_attn(blocks[-1], blocks[-1].ln_1(re[:, 1:])) + res_cls * re[:, :1]
    x = x + aggregate(r, after)
    return F.normalize(v.ln_post(x) @ v.proj, dim=-1)


def _qkv_plain(blk, u):
    """q, k, v per head (H x N x d) of ln_1 output u (1 x N x C), as custom_attn does."""
    N, C = u.shape[1:]
    H = blk.attn.num_heads
    q, k, v = F.linear(u[0], blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, -1)
    return [t.reshape(N, H, C // H).transpose(0, 1) for t in (q, k, v)]


def test_scclip_matches_published_forward(vit_b16):
    """Changing any published constant (threshold 0.45, block 5 for 4, no LOF) moves the features by
    4e-4 or more here; the tolerance is 2e-5."""
    torch.manual_seed(6)
    pixels = structured_pixels(2, (224, 224))
    with torch.no_grad():
        ours = vit_b16.encode_dense(pixels, "scclip").reshape(2, 196, -1)
        ours_maps = attention_maps(vit_b16, pixels, "scclip")  # patch tokens only (cls:0.3)
        for b in range(2):  # the published code runs one window at a time
            ref_maps = []
            ref = _scclip_reference(vit_b16, pixels[b : b + 1], maps=ref_maps)
            assert torch.allclose(ours[b], ref[0], atol=2e-5), (ours[b] - ref[0]).abs().max()
            assert torch.allclose(ours_maps[b], ref_maps[0], atol=1e-6)


def test_scclip_l14_indices_are_the_authors():
    spec = AttentionSpec.parse("scclip-l14")
    assert spec.aggregate_in.startswith("x@17[") and spec.aggregate_out.startswith("x@7[")
    assert spec.inputs == ("sum@9-19",) and spec.cls_residual == 0.1 and spec.groups[0].terms[0].tap == "x@17"


# values typed from SuleBai/SC-CLIP@0417ba9 configs/cfg_*.py and SCCLIPForSegmentation's defaults
SCCLIP_PUBLISHED = {
    "voc21": dict(resolution=336, window=224, stride=112, logit_scale=50, bg_threshold=0.15, area_threshold=0.1, pamr=False),
    "voc20": dict(resolution=336, window=224, stride=112, logit_scale=40, bg_threshold=0),
    "context60": dict(resolution=336, logit_scale=40, bg_threshold=0.15, area_threshold=0),
    "coco-object": dict(resolution=336, logit_scale=55, bg_threshold=0.35),
    "coco-stuff": dict(resolution=336, window=224, logit_scale=40),
    "cityscapes": dict(resolution=560, window=224, stride=112),
}


@pytest.mark.parametrize("dataset", list(SCCLIP_PUBLISHED))
def test_scclip_protocol_matches_published_configs(dataset):
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    settings = PROTOCOLS.get("scclip").settings(dataset)
    for name, value in SCCLIP_PUBLISHED[dataset].items():
        assert getattr(settings, name) == pytest.approx(value), name
