"""Grid and region maths the engine uses: feature cosine, CorrCLIP's region scope and region merging, CLIP's
values on a proxy grid.

ProxyCLIP (research/peers-sota.md 2.1) runs through the attention engine: `ext:NAME` features
(models/proxies.py), the term's cos metric, shift:1.2, scale:3 and pos support, any normalizer, and
`values_to_grid` below. The methods' own steps are in their rooms: CorrCLIP's whole attention and map
correction in `methods/corrclip.py`, Trident's SAM map in `methods/trident.py` (its splice of the windows'
features is `segment/windows.py`). Shapes: B images, M = I*J proxy tokens, N = h*w CLIP patch tokens, C
channels.

Published arithmetic (quirks documented):
- CorrCLIP's scope (the `region:EPS` support, attention/scope.py): allowed(i, j) = same region, or (i or j
  unsegmented and S_ij > mean(S)); regions merged by DBSCAN (eps 0.2, min_samples 1) on max(sim) - sim of
  region-mean features (zdk258/CorrCLIP@103bc18 via research/peers-sota.md, re-read in
  CorrCLIPv2/open_clip/transformer.py and CorrCLIPv2/corrclip_segmentor.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CORRCLIP_EPS = 0.2


# -- score term and support ---------------------------------------------------------------------------
def feature_cosine(feats: torch.Tensor) -> torch.Tensor:
    """B x M x C features -> B x M x M cosine similarities (fp32)."""
    f = F.normalize(feats.float(), dim=-1)
    return f @ f.transpose(-2, -1)


def region_support(scores: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """CorrCLIP's scope, B x M x M bool. regions: B x M integer region ids on the proxy grid, < 0 =
    unsegmented. Allowed: same region, or (either token unsegmented) and S_ij > the image's mean(S)."""
    return region_rows_support(scores, regions, regions, scores.mean(dim=(-2, -1), keepdim=True))


def region_rows_support(scores: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, mean: torch.Tensor | float) -> torch.Tensor:
    """The scope for some rows of the map (OV-Stitcher's image-wide map, a block of rows at a time):
    scores ... x R x M, rows ... x R and cols ... x M region ids, mean = mean(S) over the whole map."""
    same = (rows[..., :, None] == cols[..., None, :]) & (rows[..., :, None] >= 0)
    unsegmented = (rows[..., :, None] < 0) | (cols[..., None, :] < 0)
    return same | (unsegmented & (scores > mean))


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


def resize_regions(regions: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Nearest resize of an H x W integer region map to `size` (the proxy or CLIP grid)."""
    return F.interpolate(regions[None, None].float(), size=tuple(size), mode="nearest")[0, 0].to(regions.dtype)
