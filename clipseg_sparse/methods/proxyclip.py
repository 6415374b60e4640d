"""ProxyCLIP (Lan et al., ECCV 2024): a vision foundation model's feature cosine as CLIP's last-block attention.

Read from mc-lan/ProxyCLIP@05c3c18 (`open_clip/transformer.py` `custom_attn`, `proxyclip_segmentor.py`,
`configs/cfg_*.py`). In the engine's axes: the score tap `ext:NAME` (the proxy backbone's last normed patch
tokens, `models/proxies.py`), the cos metric, `shift:1.2,scale:3,pos`, any normalizer, and CLIP's values
resized to the proxy grid (`attention.grid.values_to_grid`). Presets: `proxyclip` (DINO ViT-B/8) and its
`-dinov2` / `-sam` proxy options, each with an `-entmax` variant (entmax:1.5 in the normalizer slot, the
positive support kept). Quirks copied, fixed and not copied: `PROXYCLIP_NOTES` (docs/datasets.md, Presets). CorrCLIP
reuses this protocol (`methods/corrclip.py`). Protocols `proxyclip-metaclip` (MetaCLIP fullcc B/16) and
`proxyclip-laion-h14` (OpenCLIP ViT-H/14) name the other CLIPs the published tables report. Grid:
`sweeps/grids/proxyclip.toml` (OpenAI and MetaCLIP B/16 rows).
"""

from __future__ import annotations

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS, Protocol, register_weights_variant
from ..evaluation.published import register_published

PROXYCLIP = "ext:{}[cos,shift:1.2,scale:3,pos]/softmax/cls:0/noffn"
PROXYCLIP_NOTES = (
    "copied: cosine of the backbone's last normed patch tokens on its own grid; (S - 1.2 mean(S)) x 3 with the "
    "mean over each window's whole map; -inf below 0; one softmax map for all heads; the last block's values "
    "bilinearly resized to the backbone grid; W_o(A V) without residual, FFN or CLS; logits on the backbone grid "
    "resized to the window; the backbone sees the CLIP crop re-normalised with ImageNet mean/std at the crop's "
    "size (SAM: 1024 x 1024); DINO's own position-embedding interpolation; "
    "fixed: non-square crops use (H/p, W/p) (the code assumes square windows and transposes CLIP's grid); crops "
    "smaller than the window are padded bottom/right to CLIP's patch (the code pads centred to 56); "
    "not copied: CLIP's own positional embedding resized DINO-style, fp16, its ';'-separated class files; "
    "a window whose mean similarity exceeds 1/1.2 gives NaN, as in the published code"
)
for _name, _backbone, _what in (
    ("proxyclip", "dino_vitb8", "DINO ViT-B/8"),
    ("proxyclip-dinov2", "dinov2_vitb14_reg", "DINOv2 ViT-B/14 with registers"),
    ("proxyclip-sam", "sam_vitb", "SAM ViT-B image encoder (1024 x 1024 input, 256-d neck features)"),
):
    register_preset(
        _name,
        PROXYCLIP.format(_backbone),
        f"ProxyCLIP (Lan et al., ECCV 2024) with {_what} as the proxy: its feature cosine, shifted by 1.2 x mean, "
        f"scaled by 3, positive support, as the last block's attention; reduced block",
        PROXYCLIP_NOTES,
    )
    register_entmax_variant(_name)

# ProxyCLIP ships `; `-separated class files whose VOC21 / COCO-Object person and tvmonitor lines are single
# names (SCLIP's list several); the SCLIP set is the closest shipped here (docs/datasets.md, Protocols).
PROTOCOL = PROTOCOLS.register(
    "proxyclip",
    Protocol(
        name="proxyclip",
        attention="proxyclip",
        class_names="sclip",
        source="mc-lan/ProxyCLIP@05c3c18 configs/cfg_*.py, proxyclip_segmentor.py",
        defaults=dict(resolution=336, window=336, stride=112, logit_scale=40.0),
        per_dataset={
            "ade20k": dict(resolution=448),
            "cityscapes": dict(resolution=448, window=224),
            "voc21": dict(bg_threshold=0.2),
            "context60": dict(bg_threshold=0.15),
            "coco-object": dict(bg_threshold=0.25),
        },
    ),
    help="ProxyCLIP (ECCV 2024): short side 336 (ADE20K, Cityscapes 448), 336/112 windows (Cityscapes 224), logit scale 40",
)

# The other CLIPs of the published tables: MetaCLIP fullcc B/16 (OV-Stitcher's Table 1, atw617/OV-Stitcher@270b85a
# assets/quantitative.png: avg-8 43.9 vs 42.3 with OpenAI's) and OpenCLIP ViT-H/14 (configs/base_config.py names
# ('laion2b_s32b_b79k', 'ViT-H-14'); the paper's avg-8 44.4); same settings.
METACLIP = register_weights_variant(PROTOCOL, "metaclip", "ViT-B-16-quickgelu", "metaclip_fullcc", "OV-Stitcher's Table 1: avg-8 43.9")
LAION_H14 = register_weights_variant(PROTOCOL, "laion-h14", "ViT-H-14", "laion2b_s32b_b79k", "the paper's table: avg-8 44.4")

# The paper's numbers as Trident's table reprints them (OpenAI B/16, OpenCLIP H/14) and OV-Stitcher's (MetaCLIP B/16).
register_published(
    PROTOCOL,
    {"voc21": 61.3, "context60": 35.3, "coco-object": 37.5, "voc20": 80.3, "context59": 39.1, "coco-stuff": 26.5,
     "cityscapes": 38.1, "ade20k": 20.2},
    "ProxyCLIP paper Table 1, reprinted in YuHengsss/Trident@a93b346 assets/data_result.png",
    printed_average=42.3,
    note="mc-lan/ProxyCLIP#5: VOC20 / VOC21 below the paper with locally loaded weights (open); the code runs fp16",
)
register_published(
    METACLIP,
    {"voc21": 63.3, "context60": 37.5, "coco-object": 38.4, "voc20": 81.0, "context59": 40.8, "coco-stuff": 28.1,
     "cityscapes": 39.9, "ade20k": 22.5},
    "atw617/OV-Stitcher@270b85a assets/quantitative.png (MetaCLIP B/16 rows)",
    printed_average=43.9,
)
register_published(
    LAION_H14,
    {"voc21": 65.0, "context60": 35.4, "coco-object": 38.6, "voc20": 83.3, "context59": 39.6, "coco-stuff": 26.8,
     "cityscapes": 42.0, "ade20k": 24.2},
    "ProxyCLIP paper Table 1 (OpenCLIP ViT-H/14), reprinted in YuHengsss/Trident@a93b346 assets/data_result.png",
    printed_average=44.4,
)  # fmt: skip
