"""NACLIP (Hajimiri et al., WACV 2025): k-k attention plus a Gaussian neighbourhood prior, residual and FFN dropped.

Read from sinahmr/NACLIP@0cac3a6 ("Update for v2": `naclip.py`, `pamr.py`, `configs/cfg_*.py`; v1 at cbb720d,
VOC21 at 8865082). Copied: the Gaussian prior (sigma 5 patches) added to the logits; SCLIP's mmseg line with
the logit scale and area threshold left at their defaults; the v2 configs' whole-image VOC21 / VOC20, PAMR on
(10 iterations, dilations 8, 16: the stage `pamr`, `clipseg_sparse/stages.py`, quirks there) and the saved
probabilities renormalised after the synonym max. Not copied: PAMR's silent skip on GPU out-of-memory and
its fp16 cast; fp16 on GPU. `naclip-v1` keeps the values before v2, without PAMR. ResCLIP builds on NACLIP
(`methods/resclip.py` shares `V2_DATASETS`). Grids: `sweeps/grids/resolution.toml` and `fgovd.toml` (with
SCLIP and ClearCLIP).
"""

from __future__ import annotations

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import BG_DATASETS, PROTOCOLS, SCLIP_LINE, SCLIP_LINE_SIZES, Protocol
from ..evaluation.published import register_published

register_preset(
    "naclip",
    "kk/softmax/gauss:5/nores/noffn",
    "NACLIP (Hajimiri et al., WACV 2025): k-k attention plus a Gaussian neighbourhood prior (sigma 5 patches); "
    "residual and FFN dropped",
)
register_entmax_variant("naclip")

V2_DATASETS = {  # NACLIP v2's per-dataset values, which ResCLIP's configs share
    "cityscapes": dict(resolution=560),
    "voc21": dict(window=0, bg_threshold=0.1),
    "voc20": dict(window=0),
    "context60": dict(bg_threshold=0.1),
    "coco-object": dict(bg_threshold=0.1),
}
# NACLIP's configs after its "Update for v2" commit (research/peers.md section 4; issue 11): VOC21 and
# VOC20 on the whole image (slide_crop=0), COCO-Stuff at the common 336, PAMR on (pamr_steps=10, its
# segmentor default and test_all.sh's "on" for the main results).
PROTOCOL = PROTOCOLS.register(
    "naclip",
    Protocol(
        name="naclip",
        attention="naclip",
        class_names="sclip",
        source="sinahmr/NACLIP@0cac3a6 (Update for v2) configs/cfg_*.py, naclip.py, pamr.py",
        defaults={**SCLIP_LINE, "pamr": True, "renormalize": True},
        per_dataset=V2_DATASETS,
    ),
    help="NACLIP (WACV 2025), current configs (v2): PAMR on",
)

PROTOCOL_V1 = PROTOCOLS.register(
    "naclip-v1",
    Protocol(
        name="naclip-v1",
        attention="naclip",
        class_names="sclip",
        source="sinahmr/NACLIP@cbb720d configs/cfg_*.py (voc21: 8865082), naclip.py",
        defaults=SCLIP_LINE,
        per_dataset={**SCLIP_LINE_SIZES, **{d: dict(bg_threshold=0.1) for d in BG_DATASETS}},
    ),
    help="NACLIP (WACV 2025) before v2, no PAMR",
)

# NACLIP's README "main results" (its repository's re-run, with PAMR: the v2 configs) and the paper's Table
# (v1, no PAMR) as ResCLIP's and Trident's tables reprint it. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 64.07, "context60": 34.99, "coco-object": 36.19, "voc20": 83.03, "context59": 38.35, "coco-stuff": 25.69,
     "cityscapes": 38.27, "ade20k": 19.05},
    "sinahmr/NACLIP README.md (main results, with PAMR)",
    printed_average=42.46,
)
register_published(
    PROTOCOL_V1,
    {"voc21": 58.9, "context60": 32.2, "coco-object": 33.2, "voc20": 79.7, "context59": 35.2, "coco-stuff": 23.3,
     "cityscapes": 35.5, "ade20k": 17.4},
    "NACLIP paper Table 1 (no PAMR), reprinted in yvhangyang/ResCLIP figs/main_results_w.png + main_results_wo.png "
    "and YuHengsss/Trident@a93b346 assets/data_result.png",
    printed_average=39.4,
)  # fmt: skip
