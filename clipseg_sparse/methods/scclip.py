"""SC-CLIP (Bai et al., arXiv 2411.15869): self-calibrated CLIP, LOF outlier repair and multi-level aggregation.

Read from SuleBai/SC-CLIP@0417ba9 (`clip/model.py`: `lof_pytorch`, `mean_interpolation`, the last block's
forward; `scclip_segmentor.py`, `configs/cfg_*.py`); ViT-L/14 layer indices from the authors
(SuleBai/SC-CLIP#5). The spec's axes: the mid map `x@9[cos,shift:1,scale:3,pos]` averaged with softmax(kk),
input and output aggregation (`aggin:` / `aggout:`), the multi-level input sum (`in:sum@4-10`), residual
0.3 x CLS; the outlier repair is the token stage `lof` below. Quirks copied and fixed: `SCCLIP_NOTES` (docs/datasets.md,
Presets). Grids: `sweeps/grids/scclip.toml` (ViT-B/16), `scclip-l14.toml`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS, SCLIP_LINE, Protocol
from ..evaluation.published import register_published
from ..stages import STAGES, Stage


def lof_outliers(x: torch.Tensor, n_neighbors: int = 30, contamination: float = 0.05, chunk: int = 64) -> torch.Tensor:
    """SC-CLIP's `lof_pytorch` on N x C tokens: a boolean mask of the outliers (N).

    As published (`SuleBai/SC-CLIP@0417ba9:clip/model.py`): squared Euclidean distances, the k nearest
    after dropping the first (itself), reach distance max(d(p, o), k-distance of p) (the query's own
    k-distance, a simplification of LOF), LRD = k / mean reach, LOF = mean over neighbours of
    LRD(o) / LRD(p); outliers: LOF > the 0.95 quantile (float32). Distances are computed in row chunks
    (the same values, bounded memory).
    """
    dist = torch.cat([torch.norm(x[i : i + chunk, None] - x[None], dim=2, p=2) ** 2 for i in range(0, len(x), chunk)])
    knn_d, knn_i = torch.topk(dist, k=n_neighbors + 1, largest=False)
    knn_d, knn_i = knn_d[:, 1:], knn_i[:, 1:]
    reach = torch.max(knn_d, knn_d[:, -1:].expand_as(knn_d))
    lrd = n_neighbors / torch.nan_to_num(reach.mean(dim=1), nan=1e-6)
    lof = (lrd[knn_i] / lrd.unsqueeze(1)).mean(dim=1)
    return lof > torch.quantile(lof.to(torch.float32), 1 - contamination)


def neighbour_repair(tokens: torch.Tensor, outliers: torch.Tensor, grid: tuple[int, int], keep_isolated: bool = True) -> torch.Tensor:
    """SC-CLIP's `mean_interpolation`: each outlier token (N x C, row-major h x w grid) becomes the mean
    of its non-outlier 3 x 3 neighbours (zero padding counts as invalid); kept if it has none, or zeroed
    with `keep_isolated=False` (SFP's copy divides the empty sum by 1)."""
    h, w = grid
    C = tokens.shape[-1]
    fmap = tokens.T.reshape(1, C, h, w)
    keep = (~outliers).to(tokens.dtype).view(1, 1, h, w)
    kernel = torch.ones(C, 1, 3, 3, dtype=tokens.dtype, device=tokens.device)
    kernel[:, 0, 1, 1] = 0
    sums = F.conv2d(F.pad(fmap * keep, (1, 1, 1, 1)), kernel, groups=C)
    count = F.conv2d(F.pad(keep, (1, 1, 1, 1)), kernel[:1])
    update = outliers.to(tokens.dtype).view(1, 1, h, w)
    update = update * (count > 0).to(tokens.dtype) if keep_isolated else update
    mean = sums / count.clamp_min(1)  # SC-CLIP sets zero counts to 1
    return (fmap * (1 - update) + mean * update).reshape(C, h * w).T


def lof_repair(x: torch.Tensor, grid: tuple[int, int], taps: dict | None = None) -> torch.Tensor:
    """Outliers of the patch tokens of x (B x (P + h*w) x C; P = 1 CLS token, 0 for SigLIP), per image (the
    published code runs one window at a time), repaired in x and in every hidden state of `taps` at the
    same positions."""
    return repair_outliers(x, grid, taps, lambda b, patches: lof_outliers(patches))


def repair_outliers(
    x: torch.Tensor, grid: tuple[int, int], taps: dict | None, find: Callable[[int, torch.Tensor], torch.Tensor], keep_isolated: bool = True
) -> torch.Tensor:
    """x with the outliers `find(b, patches)` marks (a boolean mask over image b's h*w patch tokens) repaired
    by `neighbour_repair`, in x and at the same positions in every hidden state of `taps` (edited in place)."""
    x = x.clone()
    taps = taps if taps is not None else {}
    repaired = {layer: h.clone() for layer, h in taps.items()}
    p = x.shape[1] - grid[0] * grid[1]
    for b in range(x.shape[0]):
        outliers = find(b, x[b, p:])
        if outliers.any():
            x[b, p:] = neighbour_repair(x[b, p:], outliers, grid, keep_isolated)
            for h in repaired.values():
                h[b, p:] = neighbour_repair(h[b, p:], outliers, grid, keep_isolated)
    taps.update(repaired)
    return x


def _lof_stage(args: str) -> Stage:
    if args:
        raise UserValueError(f"bad stage 'lof:{args}': lof takes no arguments (SC-CLIP's k 30, contamination 0.05)")
    return Stage("token", "lof", lof_repair, taps=True)


STAGES.register(
    "lof",
    _lof_stage,
    help="token: SC-CLIP's outlier repair (LOF k 30, top 5 %, mean of the 3x3 non-outlier neighbours)",
)


# -- presets and protocol ------------------------------------------------------------------------------
SCCLIP = (
    "x@{pre}[cos,shift:1,scale:3,pos]+kk/softmax/cls:{cls}/noffn/avg/aggin:x@{pre}[cos,thresh:0.4]"
    "/aggout:x@{post}[cos,thresh:0.4]/in:sum@{first}-{last}/hook:lof"
)
SCCLIP_NOTES = (
    "copied: LOF on squared Euclidean distances with the query's own k-distance as reach distance (k 30, "
    "outliers strictly above the float32 0.95 quantile), 3x3 neighbour-mean repair of the block input and of "
    "the layer the mid map reads (not of the output-aggregation layer or the multi-level sum), mean of the mid "
    "map over the whole map including its diagonal, '< 0.4 -> 0' aggregation with rows divided by sum + 1e-6, "
    "the multi-level branch without input aggregation, residual 0.3 x CLS, no CLS token in the output; "
    "fixed: LOF, its quantile and the mid-map mean are taken per window (the published code runs batch 1 and "
    "mixes images when batched), outlier cells use the grid's column count (the code divides by the row count, "
    "wrong on non-square grids)"
)
register_preset(
    "scclip",
    SCCLIP.format(pre=9, post=4, first=4, last=10, cls=0.3),
    "SC-CLIP (Bai et al., arXiv 2411.15869), ViT-B/16 layer indices: LOF outlier repair, mid map from block 9 "
    "with shift 1, scale 3 and positive support averaged with softmax(kk), aggregation by block 9 before and "
    "block 4 after, multi-level input sum of blocks 4..10, residual 0.3 x CLS",
    SCCLIP_NOTES,
)
register_entmax_variant("scclip")
register_preset(
    "scclip-l14",
    SCCLIP.format(pre=17, post=7, first=9, last=19, cls=0.1),
    "SC-CLIP (Bai et al., arXiv 2411.15869), ViT-L/14 layer indices from the authors (SuleBai/SC-CLIP#5): mid "
    "map and input aggregation from block 17, output aggregation block 7, multi-level sum of blocks 9..19, "
    "residual 0.1 x CLS",
    SCCLIP_NOTES,
)
register_entmax_variant("scclip-l14")

# SC-CLIP's configs (SuleBai/SC-CLIP@0417ba9 configs/cfg_*.py, scclip_segmentor.py defaults): SCLIP's line
# at 336 everywhere (COCO-Stuff too; Cityscapes 560), 224/112 windows on every dataset, PAMR off
# (pamr_steps=0). ViT-L/14 runs the same settings with the `scclip-l14` preset.
PROTOCOL = PROTOCOLS.register(
    "scclip",
    Protocol(
        name="scclip",
        attention="scclip",
        class_names="sclip",
        source="SuleBai/SC-CLIP@0417ba9 configs/cfg_*.py, scclip_segmentor.py",
        defaults=SCLIP_LINE,
        per_dataset={
            "cityscapes": dict(resolution=560),
            "voc21": dict(logit_scale=50.0, bg_threshold=0.15, area_threshold=0.1),
            "context60": dict(bg_threshold=0.15),
            "coco-object": dict(logit_scale=55.0, bg_threshold=0.35),
        },
    ),
    help="SC-CLIP (arXiv 2411.15869); ViT-L/14 with preset scclip-l14",
)

# SC-CLIP's repository has no table; its paper's numbers as RF-CLIP's Table 1 reprints them (secondary). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 64.6, "context60": 36.8, "coco-object": 37.7, "voc20": 84.3, "context59": 40.1, "coco-stuff": 26.6,
     "cityscapes": 41.0, "ade20k": 20.1},
    "SC-CLIP paper (arXiv 2411.15869) Table 1 as RF-CLIP (arXiv 2511.16170) Table 1 reprints it",
    printed_average=43.9,
)  # fmt: skip
