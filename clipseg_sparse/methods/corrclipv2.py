"""CorrCLIPv2 (zdk258/CorrCLIP@103bc18, folder CorrCLIPv2/; research/peers-2026.md 2.2) as presets of the engine.

CorrCLIP v1's body (`methods/corrclip.py`: scope-restricted attention, spatial branch, mask class tokens) with
the foundation model's features computed once on the whole image (`ext:c_radio_v3_l.image`: C-RADIOv3-L at
the image's nearest supported size, resized to the network input, L2, cropped per window, resized to twice
CLIP's grid) and DBSCAN merging off (a bare `region` support), plus region retrieval from an image bank: the
retrieval stage `retrieve[:K[:ALPHA]]` (default 20, 0.5) fuses ALPHA x the image's own cosine map with
(1 - ALPHA) x the bank's support logits at the network input's size (`segment/bank.py`). The map correction
is the `regionvote` labels stage the protocol turns on. Banks: `clipseg-sparse bank build` (values: the
`corrclipv2-values` spec, CorrCLIP v1 with DINO ViT-B/8 q+k per window and no merging, as the published
builder's vendored open_clip). Quirks copied, fixed and not copied: `CORRCLIPV2_NOTES`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UserValueError
from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS
from ..evaluation.published import register_published
from ..segment.bank import NUM_SUPPORT, SUPPORT_WEIGHT
from ..stages import STAGES, Stage
from . import corrclip

CORRCLIPV2 = "ext:{proxy}.image[cos,scale:4,region]/softmax/cls:0/noffn/in:mean@{first}-{last}/mct:0.5/hook:retrieve"
#: the bank's values: CorrCLIP v1's pixel features as the published builder computes them (DINO B/8 q + k per
#: window, its open_clip with the DBSCAN merging commented out), at short side 448 with 336/112 windows
VALUES = "ext:dino_vitb8.qk[cos,scale:4,region]/softmax/cls:0/noffn/in:mean@{first}-{last}/mct:0.5"
VALUES_SETTINGS = dict(resolution=448, window=336, stride=112)
KEY_BACKBONE = "c_radio_v3_l"

CORRCLIPV2_NOTES = (
    "copied: C-RADIOv3-L run once per image on the original image in [0, 1] resized bilinearly to the nearest "
    "multiple of 16 (RADIO's get_nearest_supported_resolution; no maximum there nor in vfms/factory.py's "
    "extract_dense, which reads the image file itself: uncapped, so a 4000x3000 photo is 250 x 188 = 47,000 "
    "tokens), its spatial features resized bilinearly to the "
    "network input and L2-normalised; per window the crop (replicate-padded), resized to 2 x CLIP's grid and "
    "L2-normalised; scope = same region or (unsegmented and S > mean S), softmax(4 S), no DBSCAN merging (commented "
    "out in v2); the v1 branches (spatial blocks 6..10 / 11..22, mask class tokens 0.5); retrieval per region "
    "of the input-size map (every value, the unsegmented one too): q = L2(region mean of the features), top 20 by "
    "inner product (FAISS, IVF-PQ nlist 8 sqrt(N), m 32, 8 bits, nprobe min(256, nlist) for large banks), support "
    "= L2(mean of the 20 stored CLIP embeddings), logits = support . text painted on the region, the stores of "
    "the bank's other CLIPs (DFN) with their own text, averaged; 0.5 own + 0.5 support at the input size, then "
    "bilinear to the original size, x 40 softmax, synonym max, prob_thd, per-region mode (ties: the smaller "
    "label); bank values = L2(region mean of the windows' unnormalised projected features resized to the image), "
    "keys = region means of the whole-image features at the image's size, unsegmented pixels not stored; "
    "fixed: unsegmented = id -1 (the code takes each window's smallest id), windows padded bottom/right to "
    "CLIP's patch (the code pads centred to 56), fp32 (the code runs fp16 with autocast), a region without any "
    "neighbour gets zero support logits (NaN in the code); "
    "not copied: the default CLIP is the CLI's (the paper's is MetaCLIP: --model ViT-B-16-quickgelu "
    "--pretrained metaclip_fullcc, or ViT-L-14-quickgelu for corrclipv2-l14), EntitySeg masks (give --regions), "
    "flat search below 20000 bank regions (the code builds IVF-PQ for any size)"
)

def retrieval_fusion(cosine: torch.Tensor, support: torch.Tensor, inverse: torch.Tensor, alpha: float, band: int = 8192) -> torch.Tensor:
    """alpha x own cosine + (1 - alpha) x the bank's support logits (published forward_slide): cosine N x h x w,
    support R x N per region, inverse h x w region index. The support is painted by gather a band of `band`
    pixels at a time into the result (no N x h x w painted map), along the result's memory: rows of N values
    where the map is h x w x N memory (the windows forward's), else rows of pixels."""
    out = alpha * cosine  # keeps the cosine's memory layout
    index = inverse.flatten().to(out.device)
    weighted = ((1 - alpha) * support).to(out.device)  # R x N
    names_last = out.stride(0) == 1 and out.shape[0] > 1
    flat = out.permute(1, 2, 0).reshape(-1, out.shape[0]) if names_last else out.view(out.shape[0], -1)  # views
    table = weighted if names_last else weighted.T.contiguous()
    for start in range(0, index.numel(), band):
        if names_last:
            flat[start : start + band] += torch.index_select(table, 0, index[start : start + band])
        else:
            flat[:, start : start + band] += torch.index_select(table, 1, index[start : start + band])
    return out


def _retrieve_stage(args: str) -> Stage:
    """`retrieve[:K[:ALPHA]]`, default retrieve:20:0.5 (num_support, alpha)."""
    usage = "expected retrieve[:K[:ALPHA]] with K >= 1 neighbours and 0 <= ALPHA <= 1, e.g. retrieve:20:0.5"
    parts = args.split(":") if args else []
    try:
        k = int(parts[0]) if parts else NUM_SUPPORT
        alpha = float(parts[1]) if len(parts) > 1 else SUPPORT_WEIGHT
    except ValueError:
        raise UserValueError(f"bad stage 'retrieve:{args}': {usage}") from None
    if len(parts) > 2 or k < 1 or not 0.0 <= alpha <= 1.0:
        raise UserValueError(f"bad stage 'retrieve:{args}': {usage}")
    return Stage("retrieval", f"retrieve:{k}:{alpha:g}", lambda cosine, run: retrieval_fusion(cosine, *run.retrieve(k), alpha))


STAGES.register(
    "retrieve",
    _retrieve_stage,
    help="retrieval: CorrCLIPv2's image-bank support, ALPHA x own + (1 - ALPHA) x the logits of the K nearest bank regions per region (default 20:0.5; needs --bank)",
)

for _name, _first, _last, _what in (("corrclipv2", 6, 10, "ViT-B/16 block indices"), ("corrclipv2-l14", 11, 22, "ViT-L/14 block indices")):
    register_preset(
        _name,
        CORRCLIPV2.format(proxy=KEY_BACKBONE, first=_first, last=_last),
        f"CorrCLIPv2 (Zhang et al.), {_what}: C-RADIOv3-L whole-image features x 4 restricted to region masks (no "
        f"merging), spatial branch (blocks {_first}..{_last}), mask class tokens (0.5), region retrieval from an "
        f"image bank fused 0.5/0.5; needs --regions and --bank",
        CORRCLIPV2_NOTES,
    )
    register_entmax_variant(_name)
    register_preset(
        f"{_name}-values",
        VALUES.format(first=_first, last=_last),
        f"CorrCLIPv2's bank values ({_what}): CorrCLIP v1's pixel features without merging, as the published builder",
        CORRCLIPV2_NOTES,
    )


# CorrCLIPv2's configs (CorrCLIPv2/configs/cfg_*.py, base_config.py; segmentor defaults slide_crop 336,
# slide_stride 112): short side 336 (ADE20K 448, Cityscapes 784), windows 336/112 (Cityscapes 224/112), logit
# scale 40, prob_thd VOC21 0.2, Context60 0.15, COCO-Object 0.25; DBSCAN off (the spec's bare `region`); the
# map correction after the labels (stage regionvote).
PROTOCOL = PROTOCOLS.register(
    "corrclipv2",
    dataclasses.replace(
        corrclip.PROTOCOL,
        name="corrclipv2",
        attention="corrclipv2",
        source="zdk258/CorrCLIP@103bc18 CorrCLIPv2/configs/cfg_*.py, base_config.py, corrclip_segmentor.py (forward_slide, postprocess_result)",
        per_dataset={**corrclip.PROTOCOL.per_dataset, "cityscapes": dict(resolution=784, window=224)},
    ),
    help="CorrCLIPv2: CorrCLIP's settings with Cityscapes at short side 784 (224/112 windows); needs --regions and --bank",
)

# The README's table: CorrCLIPv2-B with the COCO bank (C-RADIOv3-L, EntitySeg masks, MetaCLIP B/16). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 82.2, "context60": 50.8, "coco-object": 54.6, "voc20": 93.6, "context59": 56.3, "coco-stuff": 38.5,
     "cityscapes": 58.7, "ade20k": 33.2},
    "zdk258/CorrCLIP@103bc18 CorrCLIPv2/README.md (CorrCLIPv2-B, COCO bank)",
    clip="ViT-B-16-quickgelu:metaclip_fullcc",
    printed_average=58.5,
    note="needs EntitySeg region masks (--regions) and a COCO train2017 bank (--bank); the README's own average is over 10 sets",
)  # fmt: skip
