"""CorrCLIP (Zhang et al., ICCV 2025) as presets of the attention engine.

The published forward (zdk258/CorrCLIP@103bc18, research/peers-sota.md 2.8), in the engine's axes:
`ext:dino_vitb8.qk[cos,scale:4,region:0.2]` is the scope-restricted attention (DINO ViT-B/8 last-block
q + k cosine, x 4, allowed = same merged region or (either token unsegmented and S > mean S), regions
merged by DBSCAN eps 0.2), one map for all heads, softmax; `cls:0/noffn` the reduced block W_o(A V) on
the DINO grid; `in:mean@6-10` the spatial branch (mean of the outputs of blocks 6..10 through the same
attention, weight 1.0); `mct:0.5` the semantic branch (mask class tokens, weight 0.5; with it every
branch passes ln_post on its own). The map correction is the `regionvote` labels stage, which the
`corrclip` protocol turns on. Region maps come from a folder or SAM2 (`segment/regions.py`); the region
scope and merging are engine maths (`attention/grid.py`). `corrclip_attention` is the whole published map in
one function (the engine's reference in the tests). Quirks copied, fixed and not copied: `CORRCLIP_NOTES`
(docs/datasets.md, Presets). Protocols `corrclip-metaclip` and `corrclip-l14-metaclip` load the paper's own CLIP
(MetaCLIP fullcc, quickgelu, B/16 and L/14). Grids: `sweeps/grids/corrclip.toml` (ViT-B/16), `corrclip-l14.toml`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..attention.grid import feature_cosine, region_support
from ..attention.normalizers import Normalizer, normalize
from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS, register_weights_variant
from ..evaluation.published import register_published
from ..stages import register_plain_stage
from . import proxyclip

CORRCLIP_TAU = 4.0


def restrict(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Scores with -inf outside `allowed`, so every normalizer gives those entries exactly 0."""
    return scores.masked_fill(~allowed, float("-inf"))


def corrclip_attention(
    q: torch.Tensor, k: torch.Tensor, regions: torch.Tensor, tau: float = CORRCLIP_TAU, normalizer: str | Normalizer = "softmax"
) -> torch.Tensor:
    """CorrCLIP's B x M x M attention. q, k: B x M x C (heads concatenated, patch tokens) of DINO's
    last block; regions: B x M ids on the same grid (< 0 unsegmented)."""
    s = feature_cosine(q + k)
    return normalize(restrict(tau * s, region_support(s, regions)), normalizer)


def region_vote(labels: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """CorrCLIP's map correction: every region (id >= 0) of an H x W map gets the most frequent label
    inside it (ties: the smaller label); unsegmented pixels keep theirs."""
    out = labels.clone()
    for r in torch.unique(regions[regions >= 0]):
        inside = regions == r
        out[inside] = torch.bincount(labels[inside].flatten()).argmax()
    return out


CORRCLIP = "ext:dino_vitb8.qk[cos,scale:4,region:0.2]/softmax/cls:0/noffn/in:mean@{first}-{last}/mct:0.5"

CORRCLIP_NOTES = (
    "copied: DINO ViT-B/8 last-block q + k (the qkv projection, CLS dropped), L2-normalised, cosine on the DINO "
    "grid (crop/8); the window's regions resized nearest to that grid and merged per window: region means of the "
    "normalised features (unsegmented excluded), cosine, DBSCAN (eps 0.2, min_samples 1) on max(sim) - sim; "
    "allowed = same merged region, or either token unsegmented and S > mean(S) over the window's whole map; "
    "softmax(4 S) for all heads; the last block's values without CLS bilinearly resized to the DINO grid; "
    "W_o(A V) without residual or FFN; spatial branch = mean of the outputs of blocks 6..10 (ViT-L/14: 11..22) "
    "through the same attention; semantic branch = one CLS copy (after ln_pre) per region id present on CLIP's "
    "grid (the merged map resized nearest; the unsegmented id included) attending in every block to the CLS "
    "and its region's patches only (not to itself), its full last-block output given to every DINO-grid cell "
    "of its region (nearest); ln_post on each branch, weights 1.0 and 0.5; padded window pixels form one more "
    "region (the code pads with 10000); map correction (stage regionvote, on in the corrclip protocol) on the "
    "original un-merged regions at the original size, ties to the smaller label; "
    "fixed: unsegmented = id -1 (the code takes the smallest id present in each window as unsegmented, so a "
    "window without unsegmented pixels loses its smallest region's scope; the map correction likewise skips "
    "the image's smallest id); windows padded bottom/right to CLIP's patch (the code pads centred to 56); "
    "non-square crops use (H/p, W/p); fp32; the semantic branch batched over windows (the code runs batch 1); "
    "not copied: the default CLIP is OpenAI's (the paper's is MetaCLIP: --model ViT-B-16-quickgelu --pretrained "
    "metaclip_fullcc), CLIP's positional embedding resized DINO-style, fp16, its '; '-separated class files "
    "(VOC21 'people')"
)

for _name, _first, _last, _what in (("corrclip", 6, 10, "ViT-B/16 block indices"), ("corrclip-l14", 11, 22, "ViT-L/14 block indices")):
    register_preset(
        _name,
        CORRCLIP.format(first=_first, last=_last),
        f"CorrCLIP (Zhang et al., ICCV 2025), {_what}: DINO ViT-B/8 q+k cosine x 4 restricted to merged region "
        f"masks, spatial branch (mean of blocks {_first}..{_last}), semantic branch of mask class tokens (0.5); "
        f"needs region masks (--regions)",
        CORRCLIP_NOTES,
    )
    register_entmax_variant(_name)


# CorrCLIP's map correction (zdk258/CorrCLIP postprocess_result), on the original region map
register_plain_stage(
    "regionvote", "labels", region_vote,
    help="labels: CorrCLIP's map correction, every region of the image's region map takes its most frequent label",
)  # fmt: skip

# CorrCLIP's v1 configs are ProxyCLIP's (short side 336, Cityscapes 448, 336/112 windows, Cityscapes 224/112,
# logit scale 40, prob_thd 0.2 / 0.15 / 0.25; read for VOC21, Context60/59, COCO-Object and Cityscapes, the
# others not in the index: ADE20K 448 as research/peers-sota.md 2.8) with its map correction after the
# labels; it needs region masks (--regions). Its class files are `; `-separated with `people` in VOC21.
PROTOCOL = PROTOCOLS.register(
    "corrclip",
    dataclasses.replace(
        proxyclip.PROTOCOL,
        name="corrclip",
        attention="corrclip",
        source="zdk258/CorrCLIP@103bc18 CorrCLIPv1/configs/cfg_*.py (voc21, context59, context60, coco_object, "
        "city_scapes), CorrCLIPv2/corrclip_segmentor.py postprocess_result, CorrCLIPv1/demo_colab.py",
        defaults={**proxyclip.PROTOCOL.defaults, "stages": ("regionvote",)},
    ),
    help="CorrCLIP (ICCV 2025): ProxyCLIP's settings plus the map correction (stage regionvote); needs --regions",
)

# The paper's own CLIP (CorrCLIPv1's default `--model ViT-B-16-quickgelu --pretrained metaclip_fullcc`; L/14 with
# the corrclip-l14 block indices): README avg-8 51.0 (B/16, SAM2_32 masks) and 53.6 (L/14); OpenAI B/16 48.7.
METACLIP = register_weights_variant(PROTOCOL, "metaclip", "ViT-B-16-quickgelu", "metaclip_fullcc", "CorrCLIPv1's default CLIP; README avg-8 51.0")
METACLIP_L14 = PROTOCOLS.register(
    "corrclip-l14-metaclip",
    dataclasses.replace(METACLIP, name="corrclip-l14-metaclip", attention="corrclip-l14", model="ViT-L-14-quickgelu"),
    help="CorrCLIP (ICCV 2025) at L/14: ProxyCLIP's settings plus the map correction, preset corrclip-l14; CLIP "
    "ViT-L-14-quickgelu:metaclip_fullcc (CorrCLIPv1's L/14; README avg-8 53.6); needs --regions",
)

# CorrCLIPv1's README (MetaCLIP B/16, SAM2_32 masks) and, for OpenAI B/16, OV-Stitcher's Table 1. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 72.2, "context60": 41.6, "coco-object": 40.7, "voc20": 88.7, "context59": 47.1, "coco-stuff": 30.7,
     "cityscapes": 44.6, "ade20k": 23.7},
    "atw617/OV-Stitcher@270b85a assets/quantitative.png (CorrCLIP, OpenAI B/16)",
    printed_average=48.7,
    note="with the map correction (regionvote) and SAM2 masks (--regions); 46.8 without the correction",
)
register_published(
    METACLIP,
    {"voc21": 74.8, "context60": 44.2, "coco-object": 43.7, "voc20": 88.8, "context59": 48.8, "coco-stuff": 31.6,
     "cityscapes": 49.4, "ade20k": 26.9},
    "zdk258/CorrCLIP@103bc18 CorrCLIPv1/README.md (MetaCLIP B/16, SAM2_32 masks)",
    printed_average=51.0,
    note="SAM2 masks as region input (--regions); the masks' generator changes the number (README: 50.3-52.4)",
)  # fmt: skip
