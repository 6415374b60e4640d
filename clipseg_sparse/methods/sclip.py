"""SCLIP (Wang et al., ECCV 2024): correlative self-attention softmax(qq) + softmax(kk) in the last block.

Read from wangf3014/SCLIP@57fa9aa (`clip/model.py` `custom_attn`, `clip_segmentor.py`, `configs/cfg_*.py`).
Copied: the sum of the two normalised maps, residual and FFN kept; the protocol's mmseg line below the
configs (`evaluation.protocols.SCLIP_LINE`: OpenCV resize, positional embedding by (n + 0.1) / native,
window sides that are not whole patches cut) and its area threshold (`area_thd`, VOC21), which zeroes the
dropped classes in the saved probabilities too. Not copied: fp16 on GPU (`--precision fp16`). Quirks of
the protocol: docs/datasets.md, Protocols. Grids: `sweeps/grids/resolution.toml` and `fgovd.toml` (with ClearCLIP
and NACLIP); `sources-normalizers.toml` runs every source under this protocol.
"""

from __future__ import annotations

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS, SCLIP_LINE, SCLIP_LINE_SIZES, Protocol
from ..evaluation.published import register_published

register_preset(
    "sclip",
    "qq+kk/softmax",
    "SCLIP (Wang et al., ECCV 2024): correlative self-attention softmax(qq)+softmax(kk); residual and FFN kept",
)
register_entmax_variant("sclip")

PROTOCOL = PROTOCOLS.register(
    "sclip",
    Protocol(
        name="sclip",
        attention="sclip",
        class_names="sclip",
        source="wangf3014/SCLIP@57fa9aa configs/cfg_*.py, clip_segmentor.py",
        defaults=SCLIP_LINE,
        per_dataset={
            **SCLIP_LINE_SIZES,
            "voc21": dict(logit_scale=65.0, bg_threshold=0.1, area_threshold=0.1),
            "context60": dict(logit_scale=50.0, bg_threshold=0.1),
            "coco-object": dict(logit_scale=50.0, bg_threshold=0.1),
        },
    ),
    help="SCLIP (ECCV 2024)",
)

# The paper's Table 1 (OpenAI B/16) as ResCLIP's and Trident's tables reprint it. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 59.1, "context60": 30.4, "coco-object": 30.5, "voc20": 80.4, "context59": 34.2, "coco-stuff": 22.4,
     "cityscapes": 32.2, "ade20k": 16.1},
    "SCLIP paper Table 1, reprinted in yvhangyang/ResCLIP figs/main_results_w.png + main_results_wo.png and "
    "YuHengsss/Trident@a93b346 assets/data_result.png",
    printed_average=38.2,
    note="SCLIP's README re-run (wangf3014/SCLIP README.md): 59.63 / 31.74 / 33.52 / 81.54 / 34.46 / 22.77 / 32.34 / "
    "16.45; the published code runs CLIP in fp16 on a GPU",
)  # fmt: skip
