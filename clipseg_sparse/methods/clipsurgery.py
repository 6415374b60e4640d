"""CLIP Surgery (Li et al., Pattern Recognition 2025): v-v attention on a parallel path and feature surgery.

Read from xmed-lab/CLIP_Surgery@d4696d4 (`clip/clip_surgery_model.py`, `clip/clip.py`
`clip_feature_surgery`). The spec: v-v self-attention on a parallel path over the last 6 blocks (residual
kept, no FFN, CLS from the original path); feature surgery on the text side is the match stage `surgery`
below. Quirks copied, fixed and not copied: `CLIPSURGERY_NOTES` (docs/datasets.md, Presets). CLIP Surgery's repository has a
demo and no evaluation ("will be released later"), so its protocol is ClearCLIP's (`clearclip.PROTOCOL`).
Grid: `sweeps/grids/clipsurgery.toml`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS
from ..evaluation.published import register_published
from ..stages import register_plain_stage
from . import clearclip


def feature_surgery(cosine: torch.Tensor, cls: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """`xmed-lab/CLIP_Surgery@d4696d4:clip/clip.py clip_feature_surgery` on cosine maps.

    Published: p = softmax(2 cos(CLS, t)) over the names, w = p / mean(p); e_ic = f_i * t_c * w_c (element-
    wise), r_i = mean_c e_ic, similarity = sum over dims of (e_ic - r_i). Summed over dims this is
    w_c cos_ic - mean_c(w_c cos_ic), computed here on the cosine directly (same value, no B x N x T x D
    tensor). Per window (the published reshape of w only works for batch 1). Its `t` argument is unused
    there (2 is hard-coded); copied.
    cosine: B x T x h x w; cls: B x D; text: T x D (all L2-normalised).
    """
    prob = torch.softmax(2 * cls.float() @ text.float().T, dim=-1)  # B x T
    w = (prob / prob.mean(-1, keepdim=True)).to(cosine.dtype)[:, :, None, None]
    weighted = cosine * w
    return weighted - weighted.mean(1, keepdim=True)


register_plain_stage(
    "surgery", "match", feature_surgery,
    help="match: CLIP Surgery's feature surgery (class weights from softmax(2 cos(CLS, t)), redundant mean removed)",
)  # fmt: skip


CLIPSURGERY_NOTES = (
    "copied: 6 blocks (range(1, 7)), v-v attention with the usual 1/sqrt(d) and no normalisation (ViT "
    "setting), the new path reads ln_1 of the original path, feature surgery with its hard-coded factor 2 "
    "(its t argument is unused); fixed: feature surgery per window (the published reshape works for batch 1 "
    "only); not copied (protocol or demo matters): the positional embedding resized bilinearly and written "
    "back into the model, the 85 templates, min-max normalised maps"
)
register_preset(
    "clipsurgery",
    "vv/softmax/noffn/layers:6/parallel/hook:surgery",
    "CLIP Surgery (Li et al., Pattern Recognition 2025): v-v self-attention on a parallel path over the last "
    "6 blocks (residual kept, no FFN, CLS from the original path) and feature surgery on the text side",
    CLIPSURGERY_NOTES,
)
register_entmax_variant("clipsurgery")

PROTOCOL = PROTOCOLS.register(
    "clipsurgery",
    dataclasses.replace(
        clearclip.PROTOCOL,
        name="clipsurgery",
        attention="clipsurgery",
        source="ClearCLIP's protocol (mc-lan/ClearCLIP@fd05ce4); CLIP Surgery's repository has a demo, no evaluation",
    ),
    help="CLIP Surgery (Pattern Recognition 2025), under ClearCLIP's protocol (its repository has no evaluation code)",
)

# CLIP Surgery's repository has no benchmark table; a later paper's Table 1 lists it (secondary). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 59.0, "context60": 30.1, "coco-object": 30.2, "voc20": 80.1, "context59": 33.9, "coco-stuff": 22.1,
     "cityscapes": 31.8, "ade20k": 15.8},
    "arXiv 2512.07360 Table 1 (secondary: CLIP Surgery publishes no table)",
    printed_average=37.9,
    note="the table does not say under which protocol it ran CLIP Surgery; ResCLIP lists PC60 29.3, Stuff 21.9, City 31.4",
)  # fmt: skip
