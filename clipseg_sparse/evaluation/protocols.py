"""Evaluation protocols: the inference settings each published repository uses per benchmark.

A protocol maps a dataset to `InferenceSettings` (short side, sliding window, logit scale, background
probability threshold `prob_thd`, SCLIP's `area_thd`, PAMR) and names the attention preset and
class-name set it pairs with. Values are read from the repositories' mmseg configs (`configs/cfg_*.py`)
and their segmentor defaults, at the commits given in `source`. The protocols also follow the code
below the configs: mmcv's OpenCV resize of the uint8 image (`resize="opencv"`), the positional-embedding
scale factor (n + 0.1) / native (`pos_interp="scale"`), window sides that are not whole patches cut by
the patch convolution (SCLIP, NACLIP) or zero-padded centred (ClearCLIP) (`remainder`), and the saved
probabilities (SCLIP's area threshold zeroes classes; NACLIP renormalises, `renormalize`). Precedence,
written once in `Protocol.settings`: overrides (command line) > protocol per dataset > protocol
defaults > `InferenceSettings` defaults.

Not reproduced: every published repository runs CLIP in fp16 on GPU (ClearCLIP creates its OpenCLIP
model with precision='fp16'; SCLIP and NACLIP load OpenAI's `clip`, whose `build_model` converts the
weights to half, cast back to float only on CPU): choose `--precision fp16` yourself on a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..attention import AttentionSpec
from ..attention.presets import resclip_text
from ..segment.settings import InferenceSettings
from ..registry import Registry


@dataclass(frozen=True)
class Protocol:
    """Per-dataset inference settings of one published evaluation, plus its default pairings."""

    name: str
    attention: str  # attention preset the protocol was published with
    class_names: str  # class-name set its repository ships
    source: str  # repository@commit the values are read from
    defaults: Mapping[str, Any] = field(default_factory=dict)  # for every dataset
    per_dataset: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # dataset -> the text of `attention` with that dataset's published constants (ResCLIP's lambda, tau, temp_thd)
    attention_per_dataset: Mapping[str, str] = field(default_factory=dict)

    def settings(self, dataset: str, overrides: Mapping[str, Any] | None = None) -> InferenceSettings:
        """InferenceSettings for `dataset`; `overrides` entries that are None are ignored, unknown ones
        raise ValueError."""
        return (
            InferenceSettings()
            .replace(**self.defaults)
            .replace(**self.per_dataset.get(dataset, {}))
            .replace(**dict(overrides or {}))
        )

    def spec_for(self, dataset: str, spec: AttentionSpec | str | None = None) -> AttentionSpec:
        """The spec to run on `dataset` (None: the protocol's preset). A spec that is the protocol's preset
        up to its normalizer (`resclip`, `resclip-entmax`, `resclip/entmax:1.3`) gets the dataset's
        published constants, its normalizer kept; any other spec runs as given."""
        from ..attention import PRESETS, resolve_spec

        spec = resolve_spec(spec if spec is not None else self.attention)
        variant = self.attention_per_dataset.get(dataset)
        base = PRESETS.get(self.attention).spec
        if variant is None or spec.replace(normalizer=base.normalizer) != base:
            return spec
        return AttentionSpec.parse(variant).replace(normalizer=spec.normalizer)


PROTOCOLS: Registry[Protocol] = Registry("protocol")

# What every published pipeline does below the configs (mmcv / mmseg, the repos' CLIP code): mmcv's
# cv2.resize of the uint8 image, positional embeddings by scale factor (n + 0.1) / native, and window or
# image sides that are not whole patches cut by the patch convolution (ClearCLIP pads its windows, centred).
_MMSEG_CODE = dict(resize="opencv", pos_interp="scale", remainder="drop")
# NACLIP's configs are SCLIP's with the logit scale and area threshold left at their defaults.
_SCLIP_LINE = dict(resolution=336, window=224, stride=112, logit_scale=40.0, **_MMSEG_CODE)
_SCLIP_LINE_SIZES = {"coco-stuff": dict(resolution=448), "cityscapes": dict(resolution=560)}
_BG_DATASETS = ("voc21", "context60", "coco-object")

PROTOCOLS.register(
    "sclip",
    Protocol(
        name="sclip",
        attention="sclip",
        class_names="sclip",
        source="wangf3014/SCLIP@57fa9aa configs/cfg_*.py, clip_segmentor.py",
        defaults=_SCLIP_LINE,
        per_dataset={
            **_SCLIP_LINE_SIZES,
            "voc21": dict(logit_scale=65.0, bg_threshold=0.1, area_threshold=0.1),
            "context60": dict(logit_scale=50.0, bg_threshold=0.1),
            "coco-object": dict(logit_scale=50.0, bg_threshold=0.1),
        },
    ),
    help="SCLIP (ECCV 2024)",
)

PROTOCOLS.register(
    "clearclip",
    Protocol(
        name="clearclip",
        attention="clearclip",
        class_names="plain",
        source="mc-lan/ClearCLIP@fd05ce4 configs/cfg_*.py, clearclip_segmentor.py",
        defaults={**_MMSEG_CODE, **dict(resolution=448, window=448, stride=224, logit_scale=50.0, remainder="centre")},
        per_dataset={
            "voc21": dict(bg_threshold=0.5),
            "context60": dict(bg_threshold=0.15),
            "coco-object": dict(bg_threshold=0.4),
            "cityscapes": dict(window=224),
        },
    ),
    help="ClearCLIP (ECCV 2024)",
)

_NACLIP_V2_DATASETS = {  # NACLIP v2's per-dataset values, which ResCLIP's configs share
    "cityscapes": dict(resolution=560),
    "voc21": dict(window=0, bg_threshold=0.1),
    "voc20": dict(window=0),
    "context60": dict(bg_threshold=0.1),
    "coco-object": dict(bg_threshold=0.1),
}
# NACLIP's configs after its "Update for v2" commit (research/peers.md section 4; issue 11): VOC21 and
# VOC20 on the whole image (slide_crop=0), COCO-Stuff at the common 336, PAMR on (pamr_steps=10, its
# segmentor default and test_all.sh's "on" for the main results).
PROTOCOLS.register(
    "naclip",
    Protocol(
        name="naclip",
        attention="naclip",
        class_names="sclip",
        source="sinahmr/NACLIP@0cac3a6 (Update for v2) configs/cfg_*.py, naclip.py, pamr.py",
        defaults={**_SCLIP_LINE, "pamr": True, "renormalize": True},
        per_dataset=_NACLIP_V2_DATASETS,
    ),
    help="NACLIP (WACV 2025), current configs (v2): PAMR on",
)

PROTOCOLS.register(
    "naclip-v1",
    Protocol(
        name="naclip-v1",
        attention="naclip",
        class_names="sclip",
        source="sinahmr/NACLIP@cbb720d configs/cfg_*.py (voc21: 8865082), naclip.py",
        defaults=_SCLIP_LINE,
        per_dataset={**_SCLIP_LINE_SIZES, **{d: dict(bg_threshold=0.1) for d in _BG_DATASETS}},
    ),
    help="NACLIP (WACV 2025) before v2, no PAMR",
)

# SC-CLIP's configs (SuleBai/SC-CLIP@0417ba9 configs/cfg_*.py, scclip_segmentor.py defaults): SCLIP's line
# at 336 everywhere (COCO-Stuff too; Cityscapes 560), 224/112 windows on every dataset, PAMR off
# (pamr_steps=0). ViT-L/14 runs the same settings with the `scclip-l14` preset.
PROTOCOLS.register(
    "scclip",
    Protocol(
        name="scclip",
        attention="scclip",
        class_names="sclip",
        source="SuleBai/SC-CLIP@0417ba9 configs/cfg_*.py, scclip_segmentor.py",
        defaults=_SCLIP_LINE,
        per_dataset={
            "cityscapes": dict(resolution=560),
            "voc21": dict(logit_scale=50.0, bg_threshold=0.15, area_threshold=0.1),
            "context60": dict(bg_threshold=0.15),
            "coco-object": dict(logit_scale=55.0, bg_threshold=0.35),
        },
    ),
    help="SC-CLIP (arXiv 2411.15869); ViT-L/14 with preset scclip-l14",
)

# GEM and CLIP Surgery publish no evaluation code (WalBouss/GEM#5; CLIP Surgery's README: "evaluation ...
# will be released later"). GEM's numbers on these benchmarks come from ClearCLIP's re-implementation,
# evaluated under ClearCLIP's protocol; CLIP Surgery gets the same protocol.
for _name, _paper, _why in (
    ("gem", "GEM (CVPR 2024)", "under which ClearCLIP re-evaluated GEM; GEM's repository has no evaluation"),
    ("clipsurgery", "CLIP Surgery (Pattern Recognition 2025)", "CLIP Surgery's repository has a demo, no evaluation"),
):
    PROTOCOLS.register(
        _name,
        dataclasses.replace(
            PROTOCOLS.get("clearclip"), name=_name, attention=_name, source=f"ClearCLIP's protocol (mc-lan/ClearCLIP@fd05ce4); {_why}"
        ),
        help=f"{_paper}, under ClearCLIP's protocol (its repository has no evaluation code)",
    )

# ProxyCLIP ships `; `-separated class files whose VOC21 / COCO-Object person and tvmonitor lines are single
# names (SCLIP's list several); the SCLIP set is the closest shipped here (datasets.md, Protocols).
PROTOCOLS.register(
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

# ResCLIP's configs (yvhangyang/ResCLIP@6b082d9 configs/cfg_*.py, ResCLIPSegmentation's defaults): NACLIP's
# line (336, 224/112 windows, logit scale 40; Cityscapes 560; VOC21 and VOC20 whole image), final PAMR off
# (pamr_steps=0; its first pass runs its own PAMR), probabilities renormalised after the synonym max, and
# per dataset temp_thd, attn_rcs_weights (tau, lambda), attn_sfr_weights (tau, lambda); every config sets
# delete_same_entity=True. The same configs serve ViT-L/14 (base_config.py's clip_path comment).
RESCLIP_CONSTANTS = {
    "voc21": (0.50, (2.0, 0.3), (2.2, 0.7)),
    "voc20": (0.10, (2.0, 0.6), (2.1, 0.6)),
    "context60": (0.30, (2.0, 0.3), (1.8, 0.7)),
    "context59": (0.25, (2.0, 0.4), (1.8, 0.7)),
    "coco-object": (0.11, (2.0, 0.4), (1.8, 0.7)),
    "coco-stuff": (0.11, (2.0, 0.4), (1.8, 0.7)),
    "cityscapes": (0.10, (2.0, 0.2), (2.1, 0.6)),
    "ade20k": (0.25, (2.0, 0.3), (2.1, 0.7)),
}
PROTOCOLS.register(
    "resclip",
    Protocol(
        name="resclip",
        attention="resclip",
        class_names="sclip",
        source="yvhangyang/ResCLIP@6b082d9 configs/cfg_*.py, resclip_segmentor.py, clip/model.py",
        defaults={**_SCLIP_LINE, "renormalize": True},
        per_dataset=_NACLIP_V2_DATASETS,
        attention_per_dataset={d: resclip_text(*c) for d, c in RESCLIP_CONSTANTS.items()},
    ),
    help="ResCLIP (CVPR 2025) on NACLIP: per-dataset lambda, tau and temp_thd in the spec, final PAMR off",
)

# Trident's configs (research/peers-sota.md 2.7): short side per dataset, 336-px windows with stride 224
# (VOC20 112), sides rounded up to multiples of 16 (`preprocess_image`), logit scale 40, `prob_thd`, and the
# SAM stage's cos_fac / refine_neg_cos (Cityscapes: SAM on the image's halves). Its `coarse_thresh` only
# serves the optional SAM prompt refinement (`--sam_refine`): protocol `trident-samrefine` below.
PROTOCOLS.register(
    "trident",
    Protocol(
        name="trident",
        attention="trident",
        class_names="sclip",
        source="YuHengsss/Trident@a93b346 configs/, trident.py (research/peers-sota.md 2.7)",
        defaults=dict(resolution=448, window=336, stride=224, logit_scale=40.0, size_multiple=16, stages=("sam:1.2",)),
        per_dataset={
            "voc21": dict(bg_threshold=0.2),
            "voc20": dict(resolution=336, stride=112, stages=("sam:0",)),
            "context60": dict(resolution=576, bg_threshold=0.15),
            "context59": dict(resolution=576),
            "coco-object": dict(bg_threshold=0.25),
            "cityscapes": dict(resolution=688, stages=("sam:3:neg0.6:halves",)),
            "ade20k": dict(resolution=576, stages=("sam:1.2:neg0.6",)),
        },
    ),
    help="Trident (ICCV 2025): short side 448 (VOC20 336, Context 576, ADE20K 576, Cityscapes 688), 336/224 windows "
    "(VOC20 112), sides multiples of 16, SAM stage constants per dataset",
)

# `--sam_refine` (off in the published config, passed by the published README's evaluation command): the
# refine stage samrefine with the config's `coarse_thresh` per dataset and `sam_iou_thresh` 0.8
TRIDENT_COARSE = {"voc21": 0.2, "voc20": 0.2, "context60": 0.15, "context59": 0.15, "coco-object": 0.25, "coco-stuff": 0.05, "cityscapes": 0.10, "ade20k": 0.05}
_TRIDENT = PROTOCOLS.get("trident")
PROTOCOLS.register(
    "trident-samrefine",
    dataclasses.replace(
        _TRIDENT,
        name="trident-samrefine",
        per_dataset={
            d: {**_TRIDENT.per_dataset.get(d, {}), "stages": (*_TRIDENT.per_dataset.get(d, {}).get("stages", _TRIDENT.defaults["stages"]), f"samrefine:{c:g}:0.8")}
            for d, c in TRIDENT_COARSE.items()
        },
    ),
    help="trident plus the SAM prompt refinement (--sam_refine, stage samrefine:COARSE:0.8, coarse_thresh per dataset); "
    "needs segment_anything and --proxy-weights sam_vitb=sam_vit_b_01ec64.pth",
)

# CorrCLIP's v1 configs are ProxyCLIP's (short side 336, Cityscapes 448, 336/112 windows, Cityscapes 224/112,
# logit scale 40, prob_thd 0.2 / 0.15 / 0.25; read for VOC21, Context60/59, COCO-Object and Cityscapes, the
# others not in the index: ADE20K 448 as research/peers-sota.md 2.8) with its map correction after the
# labels; it needs region masks (--regions). Its class files are `; `-separated with `people` in VOC21.
PROTOCOLS.register(
    "corrclip",
    dataclasses.replace(
        PROTOCOLS.get("proxyclip"),
        name="corrclip",
        attention="corrclip",
        source="zdk258/CorrCLIP@103bc18 CorrCLIPv1/configs/cfg_*.py (voc21, context59, context60, coco_object, "
        "city_scapes), CorrCLIPv2/corrclip_segmentor.py postprocess_result, CorrCLIPv1/demo_colab.py",
        defaults={**PROTOCOLS.get("proxyclip").defaults, "stages": ("regionvote",)},
    ),
    help="CorrCLIP (ICCV 2025): ProxyCLIP's settings plus the map correction (stage regionvote); needs --regions",
)
