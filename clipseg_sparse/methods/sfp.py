"""SFP (ICCV 2025): SC-CLIP with a CLS-attention outlier finder and (kk + qq + mid) / 3 in the last block.

Read from Kimsure/SFP@2804f5b (`SFP_ICCV/clip/model.py`: `VisionTransformer.forward`, `custom_attn`,
`sinkhorn_attn`, `mean_interpolation`, `adaptively_aggregate`; `SFP_ICCV/SFP_segmentor.py`;
`SFP_ICCV/configs/cfg_*.py`, `cls_*.txt`). In the engine's axes it is `scclip` (`methods/scclip.py`) with:

- the token stage `som` instead of `lof`: CLIP's own attention of the block before the last (`Stage.maps`),
  its CLS row scaled by 1.5, the head mean; salient patches are those the CLS attends to more than they attend
  to themselves, the 10 most attended by the CLS are outliers, repaired in the block input and in the layer
  the mid map reads as SC-CLIP repairs them (an outlier without a valid neighbour becomes 0 here);
- the mid map read from the thresholded cosine (tap `xcut@L:T`: cos(x@L) with entries below T set to 0, the
  map SC-CLIP's aggregation uses; SC-CLIP's mid map is the cosine before the threshold);
- three groups, `xcut@9:0.4[shift:1,scale:3,pos]+kk+qq` with `avg`: (softmax(mid) + softmax(kk) +
  softmax(qq)) / 3 (SC-CLIP: (mid + kk) / 2);
- the multi-level branch attending with the mid map alone (`in:sum@4-10(...)`; the code's `sinkhorn_attn`,
  which has no Sinkhorn in it).

Four normalizer slots (kk, qq, mid, and mid in the branch): `sfp-entmax` puts entmax:1.5 in each. Quirks copied
and fixed: `SFP_NOTES` (docs/datasets.md, Presets). Grid: `sweeps/grids/sfp.toml`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.presets import register_entmax_variant, register_preset
from ..attention.taps import TAPS, Tap
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, SCLIP_LINE, Protocol
from ..evaluation.published import register_published
from ..stages import STAGES, Stage
from . import scclip

SOM_TOP, SOM_CLS_SCALE = 10, 1.5  # SFP_ICCV/clip/model.py: selected_patches[:10]; res_cls 0.3 x res_scale 5.0


# -- the outlier finder ----------------------------------------------------------------------------------------
def som_outliers(maps: torch.Tensor, top: int = SOM_TOP, cls_scale: float = SOM_CLS_SCALE) -> torch.Tensor:
    """SFP's 'SOM' on one image's H x N x N attention (CLS first): a boolean mask over the N - 1 patches.

    The CLS -> patch row is scaled by `cls_scale`, heads averaged; salient patches are those whose CLS -> p entry
    exceeds their own p -> p entry; the `top` salient patches with the largest CLS -> p entry are outliers."""
    a = maps.float().clone()
    a[:, 0, 1:] *= cls_scale
    a = a.mean(0)
    cls_to_patch = a[0, 1:]
    salient = cls_to_patch > torch.diagonal(a[1:, 1:])
    ranked = cls_to_patch.masked_fill(~salient, float("-inf")).argsort(descending=True)
    outliers = torch.zeros_like(salient)
    outliers[ranked[: min(top, int(salient.sum()))]] = True
    return outliers


def som_repair(x: torch.Tensor, grid: tuple[int, int], taps: dict, maps: dict, top: int = SOM_TOP) -> torch.Tensor:
    """The outliers `som_outliers` finds in the block before the edited one (`maps[-1]`, B x H x N x N), per
    window, repaired in x and in the hidden states of `taps` by `scclip.repair_outliers` (isolated ones zeroed)."""
    if x.shape[1] != grid[0] * grid[1] + 1:
        raise UserValueError("stage som reads the CLS token's attention; this model's tokens have no CLS (SigLIP)")
    return scclip.repair_outliers(x, grid, taps, lambda b, patches: som_outliers(maps[-1][b], top), keep_isolated=False)


def _som_stage(args: str) -> Stage:
    if args and not (args.isdigit() and int(args) > 0):
        raise UserValueError(f"bad stage 'som:{args}': som[:K] takes the number of outliers K >= 1 (SFP's 10)")
    top = int(args) if args else SOM_TOP
    return Stage("token", f"som:{top}", lambda x, grid, taps, maps: som_repair(x, grid, taps, maps, top), taps=True, maps=(-1,))


STAGES.register(
    "som",
    _som_stage,
    help="token: SFP's outlier repair: the K (default 10) patches the CLS attends to most, among those it attends to "
    "more than they attend to themselves, in the block before the edited one; 3x3 neighbour means",
)


# -- the thresholded cosine the mid map reads --------------------------------------------------------------------
def _cut_arg(arg: str) -> tuple[int, float]:
    layer, colon, threshold = arg.partition(":")
    try:
        if layer.isdigit() and int(layer) >= 1 and colon:
            return int(layer), float(threshold)
    except ValueError:
        pass
    raise UserValueError(f"tap xcut@{arg}: write xcut@L:T (the cosine of the hidden state after block L, entries below T set to 0)")


def cut_cosine(ctx, arg: str) -> torch.Tensor:
    """B x 1 x N x N: cos(x@L) over the attended tokens with entries below T set to 0 (SFP's `pre_sim`)."""
    layer, threshold = _cut_arg(arg)
    a = F.normalize(ctx.hidden_state(layer).float(), dim=-1)
    s = a @ a.transpose(-2, -1)
    return s.masked_fill(s < threshold, 0.0)[:, None]


TAPS.register(
    "xcut",
    Tap(scores=cut_cosine, check=lambda arg: _cut_arg(arg) and None, hidden=lambda arg: {_cut_arg(arg)[0]}),
    help="xcut@L:T (cosine of the hidden state after block L, entries below T set to 0; SFP's mid map)",
)


# -- presets and protocol ---------------------------------------------------------------------------------------
MID = "xcut@9:0.4[shift:1,scale:3,pos]"
SFP = f"{MID}+kk+qq/softmax/cls:0.3/noffn/avg/aggin:x@9[cos,thresh:0.4]/aggout:x@4[cos,thresh:0.4]/in:sum@4-10({MID})/hook:som"
SFP_NOTES = (
    "copied: block 11's attention (nn.MultiheadAttention weights) with the CLS -> patch row x 1.5, head mean, "
    "salient = CLS -> p > p -> p, the 10 salient patches the CLS attends to most repaired by the mean of their "
    "non-outlier 3x3 neighbours in the block input and in block 9's output (not in block 4's or the multi-level "
    "sum), an outlier without a valid neighbour set to 0; the mid map from block 9's cosine after the '< 0.4 -> 0' "
    "threshold, (S - mean(S)) x 3 over the whole map, -inf below 0; (softmax(kk) + softmax(qq) + softmax(mid)) / 3 "
    "on the patch tokens, residual 0.3 x CLS; the multi-level branch (blocks 4..10 summed, CLS included) attending "
    "with softmax(mid) alone; aggregation by block 9 before and block 4 after, rows divided by sum + 1e-6; "
    "fixed: SOM and the mid-map mean per window (the code runs batch 1), outlier cells use the grid's column "
    "count (the code divides by the row count; identical on the square 224 windows); "
    "not copied: fp16 on GPU (choose --precision)"
)
register_preset(
    "sfp",
    SFP,
    "SFP (ICCV 2025), ViT-B/16: SC-CLIP with SFP's outlier finder (CLS attention of block 11), (kk + qq + mid) / 3 "
    "in the last block, the multi-level branch with the mid map alone",
    SFP_NOTES,
)
register_entmax_variant("sfp")

# SFP_ICCV/configs/cfg_*.py over base_config.py and SFPSegmentation's defaults: SC-CLIP's settings (336 short side,
# Cityscapes 560, 224/112 windows on every set, no PAMR) except ADE20K at 384, and class files that say `people`
# for `person` on VOC21, VOC20 and Cityscapes (the `sfp` name set).
PROTOCOL = PROTOCOLS.register(
    "sfp",
    Protocol(
        name="sfp",
        attention="sfp",
        class_names="sfp",
        source="Kimsure/SFP@2804f5b SFP_ICCV/configs/cfg_*.py, SFP_ICCV/SFP_segmentor.py",
        defaults=SCLIP_LINE,
        per_dataset={
            "ade20k": dict(resolution=384),
            "cityscapes": dict(resolution=560),
            "voc21": dict(logit_scale=50.0, bg_threshold=0.15, area_threshold=0.1),
            "context60": dict(bg_threshold=0.15),
            "coco-object": dict(logit_scale=55.0, bg_threshold=0.35),
        },
    ),
    help="SFP (ICCV 2025): SC-CLIP's settings, ADE20K at 384, its `people` class files",
)

# Reported mIoU, OpenAI CLIP ViT-B/16 (the repository's README has no table; the paper's Table 1 as ActiveSAM's
# Table 1 reprints it). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 63.9, "context60": 37.2, "coco-object": 37.9, "voc20": 84.5, "context59": 39.9,
     "coco-stuff": 26.4, "cityscapes": 41.1, "ade20k": 20.8},
    "SFP paper Table 1, as reprinted in VILA-Lab/ActiveSAM@41cad43 results/table1.png",
    printed_average=44.0,
)  # fmt: skip
