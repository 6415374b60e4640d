"""Proxy attention pieces: CLIP's values on a proxy grid, and CorrCLIP's and Trident's own steps.

ProxyCLIP (research/peers-sota.md 2.1) runs through the attention engine: `ext:NAME` features
(proxy_source.py), the term's cos metric, shift:1.2, scale:3 and pos support, any normalizer, and
`values_to_grid` below. The CorrCLIP and Trident steps the engine does not have yet are pure tensor
functions here, each split into the engine's axes (a score term, a support, a normalizer slot, values
shared across heads). Shapes: B images, M = I*J proxy tokens, N = h*w CLIP patch tokens, C channels.

Published arithmetic (quirks documented):
- CorrCLIP: S = cos(q + k) of DINO's last block; allowed(i, j) = same region, or (i or j unsegmented and
  S_ij > mean(S)); A = softmax(tau S) on the allowed set (tau = 4, no shift); regions merged by DBSCAN
  (eps 0.2, min_samples 1) on max(sim) - sim of region-mean features; a post vote gives every original
  region the most frequent label inside it.
- Trident: ProxyCLIP attention per window on DINO ViT-B/16 (its code batches the windows and takes one
  `torch.mean` over the whole batch, i.e. one mean for all windows of an image); windows' block
  outputs spliced onto the image grid (overlaps averaged); then SAM's last-block attention filtered by
  the cosine of SAM's values (kept where cos > min(0.9, cos_fac x row mean), heads averaged, rows
  re-normalised by their sum) smooths the spliced features.
The CorrCLIP and Trident details follow research/peers-sota.md (read from zdk258/CorrCLIP@103bc18 and
YuHengsss/Trident@a93b346 there); CorrCLIP's were re-read in CorrCLIPv2/open_clip/transformer.py and
CorrCLIPv2/corrclip_segmentor.py (the engine's `corrclip` presets use these functions, attention/scope.py).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from .normalizers import Normalizer, normalize

CORRCLIP_TAU, CORRCLIP_EPS = 4.0, 0.2


# -- score term and support ---------------------------------------------------------------------------
def feature_cosine(feats: torch.Tensor) -> torch.Tensor:
    """B x M x C features -> B x M x M cosine similarities (fp32)."""
    f = F.normalize(feats.float(), dim=-1)
    return f @ f.transpose(-2, -1)


def region_support(scores: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """CorrCLIP's scope, B x M x M bool. regions: B x M integer region ids on the proxy grid, < 0 =
    unsegmented. Allowed: same region, or (either token unsegmented) and S_ij > the image's mean(S)."""
    same = (regions[:, :, None] == regions[:, None, :]) & (regions[:, :, None] >= 0)
    unsegmented = (regions[:, :, None] < 0) | (regions[:, None, :] < 0)
    above = scores > scores.mean(dim=(-2, -1), keepdim=True)
    return same | (unsegmented & above)


def restrict(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Scores with -inf outside `allowed`, so every normalizer gives those entries exactly 0."""
    return scores.masked_fill(~allowed, float("-inf"))


# -- whole attention maps ----------------------------------------------------------------------------
def corrclip_attention(
    q: torch.Tensor, k: torch.Tensor, regions: torch.Tensor, tau: float = CORRCLIP_TAU, normalizer: str | Normalizer = "softmax"
) -> torch.Tensor:
    """CorrCLIP's B x M x M attention. q, k: B x M x C (heads concatenated, patch tokens) of DINO's
    last block; regions: B x M ids on the same grid (< 0 unsegmented)."""
    s = feature_cosine(q + k)
    return normalize(restrict(tau * s, region_support(s, regions)), normalizer)


def sam_filtered_attention(
    attn: torch.Tensor | Iterable[torch.Tensor], v: torch.Tensor, cos_fac: float = 1.2, refine_neg_cos: bool = True
) -> torch.Tensor:
    """Trident's SAM stage map, B x N x N from SAM's last-block attention and values: keep attn where
    cos(v_i, v_j) > thr(i) = min(0.9, cos_fac * mean over heads and j of cos), average heads, divide rows
    by their sum. refine_neg_cos False: negative thresholds become 0.6 (its Cityscapes/ADE configs).
    attn: B x heads x N x N, or the heads' B x N x N maps one at a time (an iterable, so only one head's
    map need exist: 12 x 4096^2 floats is 0.8 GB at SAM's 64 x 64 grid); v: B x heads x N x d. The row
    mean of the cosine is v_i . mean_j(v_j) (unit vectors), so no N x N map is kept for it."""
    vn = F.normalize(v.float(), dim=-1)
    row_mean = (vn @ vn.mean(dim=2, keepdim=True).transpose(-2, -1))[..., 0]  # B x heads x N
    thr = (cos_fac * row_mean.mean(dim=1)).clamp(max=0.9)[:, :, None]  # B x N x 1
    if not refine_neg_cos:
        thr = torch.where(thr < 0, torch.full_like(thr, 0.6), thr)
    heads = attn.unbind(1) if isinstance(attn, torch.Tensor) else attn
    kept = None
    for h, a in enumerate(heads):
        term = a.float() * (vn[:, h] @ vn[:, h].transpose(-2, -1) > thr)
        kept = term if kept is None else kept.add_(term)
    return kept / kept.sum(-1, keepdim=True)


# -- values and windows -------------------------------------------------------------------------------
def values_to_grid(v: torch.Tensor, clip_grid: tuple[int, int], proxy_grid: tuple[int, int]) -> torch.Tensor:
    """CLIP's per-head patch values B x H x N x d (N = h*w) bilinearly resized (align_corners False) to
    the proxy grid: B x H x M x d."""
    B, H, N, d = v.shape
    if tuple(clip_grid) == tuple(proxy_grid):
        return v
    x = v.reshape(B * H, *clip_grid, d).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=tuple(proxy_grid), mode="bilinear", align_corners=False)
    return x.permute(0, 2, 3, 1).reshape(B, H, -1, d)


# -- CorrCLIP regions --------------------------------------------------------------------------------
def merge_regions(regions: torch.Tensor, feats: torch.Tensor, eps: float = CORRCLIP_EPS) -> torch.Tensor:
    """CorrCLIP's mask merging for one image: regions M (ids, < 0 unsegmented) on the feature grid,
    feats M x C. Region-mean features (unsegmented excluded), cosine sim between regions, distance
    max(sim) - sim; DBSCAN with min_samples 1 puts two regions in one cluster when a chain of distances
    <= eps links them (connected components). Returns M merged ids (cluster index; < 0 kept)."""
    ids = torch.unique(regions[regions >= 0])
    if len(ids) <= 1:
        return regions.clone()
    means = torch.stack([feats[regions == i].float().mean(0) for i in ids])
    sim = feature_cosine(means[None])[0]
    linked = ((sim.max() - sim) <= eps) | torch.eye(len(ids), dtype=torch.bool)  # every region is its own neighbour (rounding)
    cluster = torch.arange(len(ids))
    while True:  # label propagation: each region takes the smallest label among its linked regions
        new = torch.where(linked, cluster[None, :], len(ids)).min(dim=1).values
        if torch.equal(new, cluster):
            break
        cluster = new
    lookup = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
    lookup[ids] = torch.unique(cluster, return_inverse=True)[1]
    out = regions.clone()
    out[regions >= 0] = lookup[regions[regions >= 0]].to(regions.dtype)
    return out


def region_vote(labels: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """CorrCLIP's map correction: every region (id >= 0) of an H x W map gets the most frequent label
    inside it (ties: the smaller label); unsegmented pixels keep theirs."""
    out = labels.clone()
    for r in torch.unique(regions[regions >= 0]):
        inside = regions == r
        out[inside] = torch.bincount(labels[inside].flatten()).argmax()
    return out


def resize_regions(regions: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Nearest resize of an H x W integer region map to `size` (the proxy or CLIP grid)."""
    return F.interpolate(regions[None, None].float(), size=tuple(size), mode="nearest")[0, 0].to(regions.dtype)
