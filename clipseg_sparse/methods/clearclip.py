"""ClearCLIP (Lan et al., ECCV 2024): q-q attention in the last block, residual and FFN dropped.

Read from mc-lan/ClearCLIP@fd05ce4 (vendored `open_clip/transformer.py`, `clearclip_segmentor.py`,
`configs/cfg_*.py`). Copied: the protocol's mmseg line (`evaluation.protocols.MMSEG_CODE`) with window
sides that are not whole patches zero-padded centred (`remainder="centre"`), its segmentor defaults (448,
448 / 224, logit scale 50) where it has no config (ADE20K, COCO-Stuff), its plain class names. Not copied:
its OpenCLIP model created with precision='fp16' (`--precision fp16`). GEM and CLIP Surgery run under this
protocol (`methods/gem.py`, `methods/clipsurgery.py`). Grids: `sweeps/grids/resolution.toml` and
`fgovd.toml` (with SCLIP and NACLIP).
"""

from __future__ import annotations

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import MMSEG_CODE, PROTOCOLS, Protocol
from ..evaluation.published import register_published

register_preset(
    "clearclip",
    "qq/softmax/nores/noffn",
    "ClearCLIP (Lan et al., ECCV 2024): q-q attention, residual and FFN dropped",
)
register_entmax_variant("clearclip")

PROTOCOL = PROTOCOLS.register(
    "clearclip",
    Protocol(
        name="clearclip",
        attention="clearclip",
        class_names="plain",
        source="mc-lan/ClearCLIP@fd05ce4 configs/cfg_*.py, clearclip_segmentor.py",
        defaults={**MMSEG_CODE, **dict(resolution=448, window=448, stride=224, logit_scale=50.0, remainder="centre")},
        per_dataset={
            "voc21": dict(bg_threshold=0.5),
            "context60": dict(bg_threshold=0.15),
            "coco-object": dict(bg_threshold=0.4),
            "cityscapes": dict(window=224),
        },
    ),
    help="ClearCLIP (ECCV 2024)",
)

# The paper's Table 1 (OpenAI B/16): the five sets without background from the repository's results image, the
# three with background as ResCLIP's table reprints them. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 51.8, "context60": 32.6, "coco-object": 33.0, "voc20": 80.9, "context59": 35.9, "coco-stuff": 23.9,
     "cityscapes": 30.0, "ade20k": 16.7},
    "mc-lan/ClearCLIP assets/results.png (no background); yvhangyang/ResCLIP figs/main_results_w.png (VOC21, PC60, Object)",
    printed_average=38.1,
)  # fmt: skip
