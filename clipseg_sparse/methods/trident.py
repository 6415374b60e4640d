"""Trident (Shi et al., ICCV 2025): splice-then-segment with DINO ViT-B/16 and SAM ViT-B.

Read from `YuHengsss/Trident@a93b346`: `trident.py` (`get_trident_seg`, `get_sam_feat`, `get_windowed_imgs`,
`postprocess_result`), `open_clip/transformer.py` (`custom_attn`, `guidance_attn`, `get_sam_sim`),
`seg_utils/utils.py` (`preprocess_image`, `sam_refinement`), configs; tests/test_trident_published.py runs a
transcription of them against this module. Steps and where they live:
1. mmseg's keep-ratio resize (cv2 on the uint8 image), then `preprocess_image`: both sides scaled by (the
   longer side rounded up to 16) / the longer side, each rounded up to 16 and to at least the window
   (`InferenceSettings.size_multiple`, `size_rule="longer"`); 336-px windows;
2. per window, ProxyCLIP's attention with DINO ViT-B/16 (`ext:dino_vitb16`, beta 1.2, gamma 3, -inf
   below 0), CLS dropped before the last block, reduced output W_o(A V) kept before ln_post: the
   engine's spec (preset `trident` below);
3. splice: the windows' outputs placed on the image's patch grid, overlaps averaged
   (`spliced_tokens`, segment/);
4. SAM ViT-B (LayerNorm eps 1e-6, as segment_anything builds it) on the original image rounded up to
   multiples of 16 (`sam_image`; SAM's preprocessing: longest side 1024, padded), its last block's
   attention and values on the valid grid, filtered by value cosine (`sam_filtered_attention` below);
5. spliced tokens resized bilinearly to the SAM grid, F <- A F, then ln_post, proj; logits on the SAM
   grid resized to the original size (steps 4-5: the global stage `sam` here, and `grid_cosine`).
6. the optional SAM prompt refinement (`--sam_refine`; off in the published config, on in the
   published README's evaluation command): the refine stage `samrefine[:COARSE[:IOU]]`
   (`methods/trident_refine.py`, segment_anything's prompt encoder and mask decoder; `--protocol
   trident-samrefine` adds it with the per-dataset coarse_thresh).
Quirks copied and fixed: `TRIDENT_NOTES` (datasets.md, Presets). Protocols `trident-metaclip` (MetaCLIP fullcc B/16)
and `trident-laion-h14` (OpenCLIP ViT-H/14) name the other CLIPs of the published tables. Grid:
`sweeps/grids/trident.toml`.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..attention.normalizers import Normalizer, normalize
from ..attention.presets import register_preset
from ..evaluation.protocols import PROTOCOLS, Protocol, register_weights_variant
from ..models.backbones import Backbone, sam_scores
from ..models.proxies import PROXIES
from ..stages import STAGES, Stage

SAM_BACKBONE = "sam_vitb"
SAM_PATCH = 16


def sam_preprocess(image: np.ndarray, side: int = 1024) -> tuple[np.ndarray, tuple[int, int]]:
    """SamPredictor.set_image's resize: uint8 H x W x 3 RGB -> the image resized (PIL bilinear, as
    torchvision's resize of a PIL image) so its longest side is `side` (ResizeLongestSide: new size
    int(old * side / longest + 0.5)), and that size."""
    from PIL import Image

    h, w = image.shape[:2]
    scale = side / max(h, w)
    size = (int(h * scale + 0.5), int(w * scale + 0.5))
    return np.asarray(Image.fromarray(image).resize(size[::-1], Image.BILINEAR)), size


def sam_pixels(resized: np.ndarray, backbone: Backbone, side: int) -> torch.Tensor:
    """SAM's `preprocess`: (x - mean) / std with SAM's pixel statistics (ImageNet's x 255), then zero
    padding at the bottom and right to side x side: 1 x 3 x side x side."""
    x = torch.from_numpy(np.array(resized)).permute(2, 0, 1)[None].float()
    mean = torch.tensor(backbone.info.mean).view(1, 3, 1, 1) * 255
    std = torch.tensor(backbone.info.std).view(1, 3, 1, 1) * 255
    x = (x - mean) / std
    return F.pad(x, (0, side - x.shape[-1], 0, side - x.shape[-2]))


def sam_maps(image: np.ndarray, backbone: Backbone) -> tuple[torch.Tensor, Iterator[torch.Tensor], torch.Tensor, tuple[int, int]]:
    """SAM's last block on one image (SamPredictor's input): (values 1 x heads x n x d on the valid
    grid, an iterator over the heads' 1 x N x N attention logits on the whole padded grid, the n indices
    of the valid tokens among the N, the valid grid (h, w) with n = h*w). The valid grid is the part SAM's
    padded input covers (`get_sam_feat`: input_size // 16)."""
    side = backbone.info.input_size
    resized, size = sam_preprocess(image, side)
    feats = backbone.features(sam_pixels(resized, backbone, side), want=("qkv",))
    gh, gw = feats.grid
    valid = (size[0] // SAM_PATCH, size[1] // SAM_PATCH)
    keep = (torch.arange(valid[0])[:, None] * gw + torch.arange(valid[1])[None]).flatten().to(feats.q.device)
    attn = backbone.model.blocks[-1].attn
    heads = (sam_scores(attn, feats.q[:, h : h + 1], feats.k[:, h : h + 1], (gh, gw))[:, 0].float() for h in range(feats.q.shape[1]))
    return feats.v[:, :, keep], heads, keep, valid


def sam_filtered_attention(
    attn: torch.Tensor | Iterable[torch.Tensor], v: torch.Tensor, cos_fac: float = 1.2, refine_neg_cos: bool = True
) -> torch.Tensor:
    """Trident's SAM stage map, B x N x N from SAM's last-block attention and values: keep attn where
    cos(v_i, v_j) > thr(i) = min(0.9, cos_fac * mean over heads and j of cos), average heads, divide rows
    by their sum. refine_neg_cos False: negative thresholds become 0.6 (its Cityscapes/ADE configs).
    attn: B x heads x N x N, or the heads' B x N x N maps one at a time (an iterable, so only one head's
    map need exist: 12 x 4096^2 floats is 0.8 GB at SAM's 64 x 64 grid); v: B x heads x N x d. The row
    mean of the cosine is v_i . mean_j(v_j) (unit vectors), so no N x N map is kept for it."""
    vn = F.normalize(v.float(), dim=-1)
    row_mean = (vn @ vn.mean(dim=2, keepdim=True).transpose(-2, -1))[..., 0]  # B x heads x N
    thr = (cos_fac * row_mean.mean(dim=1)).clamp(max=0.9)[:, :, None]  # B x N x 1
    if not refine_neg_cos:
        thr = torch.where(thr < 0, torch.full_like(thr, 0.6), thr)
    heads = attn.unbind(1) if isinstance(attn, torch.Tensor) else attn
    kept = None
    for h, a in enumerate(heads):
        term = a.float() * (vn[:, h] @ vn[:, h].transpose(-2, -1) > thr)
        kept = term if kept is None else kept.add_(term)
    return kept / kept.sum(-1, keepdim=True)


def sam_attention(image: np.ndarray, backbone: Backbone, cos_fac: float, refine_neg_cos: bool, normalizer: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """The SAM stage's 1 x n x n map on the valid grid (h, w), n = h*w.

    normalizer "softmax": Trident's: SAM's softmax over the whole padded grid, cropped to the valid grid,
    kept where the value cosine passes its threshold (`sam_filtered_attention`), heads averaged, rows
    divided by their sum. Any other normalizer (entmax:A, sparsemax) replaces that threshold and sum:
    the heads' logits on the valid grid, normalised by it, averaged over heads (cos_fac unused)."""
    v, heads, keep, valid = sam_maps(image, backbone)
    if Normalizer.parse(normalizer).kind == "softmax":
        cropped = (s.softmax(-1)[:, keep][:, :, keep] for s in heads)
        return sam_filtered_attention(cropped, v, cos_fac, refine_neg_cos), valid
    total = None
    for s in heads:
        a = normalize(s[:, keep][:, :, keep], normalizer)
        total = a if total is None else total.add_(a)
    return total / v.shape[1], valid


def sam_image(image: np.ndarray) -> np.ndarray:
    """The image Trident gives SAM (`get_trident_seg`'s tmp_img; the prompt refinement reuses it): the
    original uint8 image with each side rounded up to a multiple of 16 (cv2 bilinear)."""
    import cv2

    h, w = (-(-s // SAM_PATCH) * SAM_PATCH for s in image.shape[:2])
    if (h, w) == image.shape[:2]:
        return image
    return cv2.resize(np.ascontiguousarray(image), (w, h), interpolation=cv2.INTER_LINEAR)


def sam_smooth(
    tokens: torch.Tensor, image: np.ndarray, backbone: Backbone, normalizer: str = "softmax",
    cos_fac: float = 1.2, refine_neg_cos: bool = True, halves: bool = False,
) -> torch.Tensor:
    """Trident's steps 4-5 on spliced tokens 1 x h x w x C (before ln_post): the original uint8 image
    resized up to multiples of 16 (cv2 bilinear), SAM's map on it (`sam_attention`; `halves`: on its left
    and right halves separately, Cityscapes), the tokens resized bilinearly (align_corners False) to the
    SAM grid and multiplied by the map: 1 x h' x w' x C on the SAM grid (no W_v, W_o or residual)."""
    image = sam_image(image)
    w = image.shape[1]
    parts = [image[:, : w // 2], image[:, w // 2 :]] if halves else [image]
    maps = [sam_attention(part, backbone, cos_fac, refine_neg_cos, normalizer) for part in parts]
    grid = (maps[0][1][0], sum(valid[1] for _, valid in maps))
    x = F.interpolate(tokens.permute(0, 3, 1, 2).float(), size=grid, mode="bilinear", align_corners=False)
    out, x0 = [], 0
    for a, (gh, gw) in maps:
        part = x[:, :, :, x0 : x0 + gw].flatten(2).transpose(1, 2)  # 1 x n x C
        out.append((a.to(part.device) @ part).view(1, gh, gw, -1))
        x0 += gw
    return torch.cat(out, dim=2).to(tokens.dtype)


# -- the global stage `sam[:COS_FAC[:neg0.6][:halves]]` ---------------------------------------------------
def _sam_stage(args: str) -> Stage:
    usage = "expected sam[:COS_FAC[:neg0.6][:halves]], e.g. sam:1.2 or sam:3:neg0.6:halves"
    parts = args.split(":") if args else []
    try:
        cos_fac = float(parts[0]) if parts else 1.2
    except ValueError:
        raise UserValueError(f"bad stage 'sam:{args}': {usage}") from None
    flags = parts[1:]
    if any(f not in ("neg0.6", "halves") for f in flags) or len(set(flags)) != len(flags):
        raise UserValueError(f"bad stage 'sam:{args}': {usage}")
    refine_neg_cos, halves = "neg0.6" not in flags, "halves" in flags
    name = f"sam:{cos_fac:g}" + ("" if refine_neg_cos else ":neg0.6") + (":halves" if halves else "")

    def run(tokens: torch.Tensor, image: np.ndarray, normalizer: str) -> torch.Tensor:
        backbone = PROXIES.get(SAM_BACKBONE, tokens.device)
        return sam_smooth(tokens, image, backbone, normalizer, cos_fac, refine_neg_cos, halves)

    return Stage("global", name, run, backbones=(SAM_BACKBONE,))


STAGES.register(
    "sam",
    _sam_stage,
    help="global: Trident's SAM stage: SAM ViT-B attention on the whole image, filtered by value cosine (> min(0.9, "
    "COS_FAC x mean), default 1.2; neg0.6: negative thresholds -> 0.6; halves: left/right halves), smooths the spliced tokens",
)

TRIDENT_NOTES = (
    "copied: mmseg's resize by cv2, then preprocess_image's size rule (both sides scaled by the longer side rounded "
    "up to 16 / the longer side, then each rounded up: 448 x 597 -> 464 x 608), CLIP's positional embedding by "
    "scale factor (n + 0.1) / native; ProxyCLIP's attention per 336-px window with DINO ViT-B/16 on CLIP's 21 x 21 grid (shift 1.2 x mean, "
    "scale 3, -inf below 0, one map for all heads), CLS dropped before the last block, W_o(A V) before ln_post "
    "spliced on the image's patch grid with overlaps averaged; SAM ViT-B (LayerNorm eps 1e-6) on the original image resized up to multiples of 16 (cv2 bilinear), then SAM's "
    "own longest-side-1024 resize and zero padding, its last block's softmax over the padded grid cropped to the "
    "valid grid, kept where the per-head value cosine exceeds min(0.9, cos_fac x the row's mean cosine over heads "
    "and tokens), heads averaged, rows divided by their sum; spliced tokens resized bilinearly to the SAM grid and "
    "multiplied by that map, then ln_post and proj, logits on the SAM grid resized to the original size; "
    "Cityscapes: SAM on the left and right halves; "
    "fixed: the DINO shift mean is per window (the code batches an image's windows and takes one mean over all of "
    "them, so a window's attention depends on the others), the image comes from memory instead of being re-read "
    "from disk with OpenCV (same pixels for PNG; JPEG decoders may differ), halves of unequal valid width are "
    "concatenated (the code doubles the left half's), fp32 unless --precision fp16; "
    "the optional SAM prompt refinement (--sam_refine, step 6) is the stage samrefine (--protocol trident-samrefine)"
)
TRIDENT = "ext:dino_vitb16[cos,shift:1.2,scale:3,pos]/{}/cls:0/noffn/hook:sam"
register_preset(
    "trident",
    TRIDENT.format("softmax"),
    "Trident (Shi et al., ICCV 2025): ProxyCLIP attention with DINO ViT-B/16 per window, windows spliced before "
    "ln_post, SAM ViT-B attention filtered by value cosine smooths the spliced features over the whole image",
    TRIDENT_NOTES,
)
register_preset(
    "trident-entmax",
    TRIDENT.format("entmax:1.5"),
    "trident with alpha-entmax (alpha 1.5) in the DINO proxy attention and, in the SAM stage, on SAM's own "
    "logits in place of the value-cosine threshold and sum normalisation (this project)",
    TRIDENT_NOTES,
)

# Trident's configs (a93b346 configs/): short side per dataset, 336-px windows with stride 224
# (VOC20 112), sides rounded up to multiples of 16 (`preprocess_image`), logit scale 40, `prob_thd`, and the
# SAM stage's cos_fac / refine_neg_cos (Cityscapes: SAM on the image's halves). Its `coarse_thresh` only
# serves the optional SAM prompt refinement (`--sam_refine`): protocol `trident-samrefine` below.
PROTOCOL = PROTOCOLS.register(
    "trident",
    Protocol(
        name="trident",
        attention="trident",
        class_names="sclip",
        source="YuHengsss/Trident@a93b346 configs/, trident.py, seg_utils/utils.py (preprocess_image)",
        defaults=dict(
            resolution=448, window=336, stride=224, logit_scale=40.0, size_multiple=16, size_rule="longer", stages=("sam:1.2",),
            resize="opencv", pos_interp="scale",  # mmcv's Resize on the uint8 image; open_clip's (n + 0.1) pos. embedding
        ),
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

# The other CLIPs of the published tables: MetaCLIP fullcc B/16 (OV-Stitcher's Table 1: avg-8 47.4 vs 45.8 with
# OpenAI's) and OpenCLIP ViT-H/14 (Trident's table, assets/data_result.png: avg-8 48.6; the tag is ProxyCLIP's
# configs/base_config.py one, the code Trident builds on: Trident's own configs are not in the search index).
METACLIP = register_weights_variant(PROTOCOL, "metaclip", "ViT-B-16-quickgelu", "metaclip_fullcc", "OV-Stitcher's Table 1: avg-8 47.4")
LAION_H14 = register_weights_variant(PROTOCOL, "laion-h14", "ViT-H-14", "laion2b_s32b_b79k", "the paper's table: avg-8 48.6")
