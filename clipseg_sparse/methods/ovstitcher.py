"""OV-Stitcher (CVPR 2026 Findings, arXiv 2604.08110) as presets of the attention engine.

Read from atw617/OV-Stitcher@91a9489 (`ov_stitcher_segmentor.py`: `forward_feature`, `get_windowed_imgs`,
`stitch_features_from_batch`, `postprocess_result`, `generate_category_embeddings`; `open_clip/transformer.py`:
`VisionTransformer.forward`) and its configs @2bb6586 (`configs/base_config.py`, `configs/cfg_*.py`);
research/peers-2026.md 2.1. OV-Stitcher is CorrCLIP (`methods/corrclip.py`) with the windows stitched into
image-wide attention. In the engine's axes: `stitch:56` (windows zero-padded centred to a multiple of 56,
stitched onto the image grid; `segment/stitch.py`, `attention/stitched.py`); `ext:dino_vitb8.out[cos,scale:4,
region:0.2]`, the scope of the last block built once per image from DINO ViT-B/8's last block re-run over the
stitched image (cosine x tau 4, CorrCLIP's region scope after DBSCAN merging, eps 0.2), one map for all
heads, the spec's normalizer; `cls:0/noffn` W_o(A V); `in:mean@6-10` the spatial branch (blocks 6..10 re-run
over the stitched image, mean, weight 1.0; ViT-L/14: blocks 11..22, the code's NUM_SPATIAL 12); `mct:0.5` the
semantic branch (mask class tokens per window, stitched, weight 0.5); the map correction is CorrCLIP's
`regionvote` labels stage, which the `ovstitcher` protocol turns on. Per-class description prompts (the
code's `class_biased_template.json`) are `--prompts FILE`, for any preset. Quirks: `OVSTITCHER_NOTES`.
"""

from __future__ import annotations

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS, Protocol
from . import corrclip

OVSTITCHER = "ext:dino_vitb8.out[cos,scale:{tau},region:0.2]/softmax/cls:0/noffn/in:mean@{first}-{last}/mct:0.5/stitch:56"

OVSTITCHER_NOTES = (
    "copied: mmseg's sliding windows, each zero-padded centred to a multiple of 56; tokens stitched onto the image "
    "grid with the window corner at (y1 // patch, x1 // patch) (floor: the last row/column of windows, shifted back "
    "to H - window, lands up to patch - 1 pixels off), padded patches dropped, overlaps averaged; DINO ViT-B/8's "
    "last-block q, k, v and penultimate tokens (after DINO's final norm) stitched, its last block re-run over the "
    "image (per head softmax(q k^T / 8) v, residual from those normed penultimate tokens, proj, MLP), L2-normalised; "
    "the region map resized nearest to that grid, merged there (DBSCAN eps 0.2 on region means), scope = same merged "
    "region, or either token unsegmented and S > mean(S) over the image; softmax(4 S) one N x N map for all heads; "
    "blocks 6..10 (ViT-L/14: 11..22) re-run over the image from the stitched inputs and q, k, v with all heads as one "
    "(q k^T over all channels x head_dim^-1/2), residual and MLP, mean = the spatial branch; last block: the "
    "stitched windows' values and the spatial branch's values, bilinear to the DINO grid, W_o(A V); mask class "
    "tokens per window from the merged map (resized nearest to the input, cropped, resized to the window's CLIP "
    "grid), their last-block outputs painted on each window's DINO grid and stitched; ln_post on each branch, "
    "weights 1.0 / 0.5; cosine on the DINO grid, bilinear to the network input, then to the original size; "
    "logit scale 40, prob_thd per dataset, the map correction (regionvote) on the original regions; "
    "fixed: unsegmented = id -1 (the code: each image's smallest id); padded window pixels unsegmented; a padded "
    "window keeps (y2 - y1) // patch cells on both grids (the code's DINO stitch fails its coverage assert where its "
    "count differs); "
    "every image-wide attention a block of rows at a time (the code holds the whole N x N map: 2.3 GB fp16 at "
    "560 x 1120); fp32 (the code: fp16); "
    "not copied: the paper's MetaCLIP rows need --model ViT-B-16-quickgelu --pretrained metaclip_fullcc (the "
    "default CLIP is OpenAI's); its class files ('; '-separated); its prompt file is given with --prompts"
)

for _name, _first, _last, _what in (("ovstitcher", 6, 10, "ViT-B/16 block indices"), ("ovstitcher-l14", 11, 22, "ViT-L/14 block indices")):
    register_preset(
        _name,
        OVSTITCHER.format(tau=4, first=_first, last=_last),
        f"OV-Stitcher (CVPR 2026 Findings), {_what}: CorrCLIP with the windows stitched into image-wide attention "
        f"(DINO ViT-B/8's last block re-run over the image for the region-scoped map, blocks {_first}..{_last} re-run "
        f"over the image for the spatial branch); needs region masks (--regions)",
        OVSTITCHER_NOTES,
    )
    register_entmax_variant(_name)


# configs/cfg_*.py @2bb6586: short side 448 (Cityscapes 560), long side <= 2048, 336/112 windows (Cityscapes
# 224/112), prob_thd 0.1 (VOC21, Context60), 0.2 (COCO-Object), else 0; logit scale 40 (the segmentor's
# default); mmseg's Resize (cv2 on uint8) and the (n + 0.1) / native positional-embedding scale of its open_clip
# fork; the map correction after the labels; region masks from --regions.
PROTOCOL = PROTOCOLS.register(
    "ovstitcher",
    Protocol(
        name="ovstitcher",
        attention="ovstitcher",
        class_names=corrclip.PROTOCOL.class_names,
        source="atw617/OV-Stitcher@2bb6586 configs/base_config.py, configs/cfg_*.py; @91a9489 ov_stitcher_segmentor.py",
        defaults=dict(resolution=448, window=336, stride=112, logit_scale=40.0, resize="opencv", pos_interp="scale", stages=("regionvote",)),
        per_dataset={
            "cityscapes": dict(resolution=560, window=224),
            "voc21": dict(bg_threshold=0.1),
            "context60": dict(bg_threshold=0.1),
            "coco-object": dict(bg_threshold=0.2),
        },
    ),
    help="OV-Stitcher (CVPR 2026): short side 448 (Cityscapes 560), 336/112 windows (Cityscapes 224), logit scale 40, "
    "the map correction (regionvote); needs --regions; its description prompts with --prompts",
)
