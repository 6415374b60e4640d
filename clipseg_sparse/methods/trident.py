"""Trident (Shi et al., ICCV 2025): splice-then-segment with DINO ViT-B/16 and SAM ViT-B.

Read from `YuHengsss/Trident` (`trident.py` `get_trident_seg`, `get_sam_feat`, `get_windowed_imgs`;
re-read at 04bf5f8) and research/peers-sota.md 2.7 (`open_clip/transformer.py` `guidance_attn`,
`get_sam_sim`, `seg_utils/utils.py` `preprocess_image`, configs; those files are not in the search
index, so their arithmetic rests on those notes). Steps and where they live:
1. the image resized so both sides are multiples of 16 and at least the window
   (`InferenceSettings.size_multiple`); 336-px windows;
2. per window, ProxyCLIP's attention with DINO ViT-B/16 (`ext:dino_vitb16`, beta 1.2, gamma 3, -inf
   below 0), CLS dropped before the last block, reduced output W_o(A V) kept before ln_post: the
   engine's spec (preset `trident` below);
3. splice: the windows' outputs placed on the image's patch grid, overlaps averaged
   (`inference.spliced_tokens`);
4. SAM ViT-B on the whole image (SAM's preprocessing: longest side 1024, padded), its last block's
   attention and values on the valid grid, filtered by value cosine (`proxy.sam_filtered_attention`);
5. spliced tokens resized bilinearly to the SAM grid, F <- A F, then ln_post, proj; logits on the SAM
   grid resized to the original size (steps 4-5: the global stage `sam` here, and `grid_cosine`).
6. the optional SAM prompt refinement (`--sam_refine`; off in the published config, on in the
   published README's evaluation command): the refine stage `samrefine[:COARSE[:IOU]]`
   (`sam_refine.py`, segment_anything's prompt encoder and mask decoder; `--protocol trident-samrefine`
   adds it with the per-dataset coarse_thresh).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.presets import register_preset
from ..models.backbones import Backbone, sam_scores
from ..attention.normalizers import Normalizer, normalize
from ..attention.grid import sam_filtered_attention
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


def sam_smooth(
    tokens: torch.Tensor, image: np.ndarray, backbone: Backbone, normalizer: str = "softmax",
    cos_fac: float = 1.2, refine_neg_cos: bool = True, halves: bool = False,
) -> torch.Tensor:
    """Trident's steps 4-5 on spliced tokens 1 x h x w x C (before ln_post): the original uint8 image
    resized up to multiples of 16 (cv2 bilinear), SAM's map on it (`sam_attention`; `halves`: on its left
    and right halves separately, Cityscapes), the tokens resized bilinearly (align_corners False) to the
    SAM grid and multiplied by the map: 1 x h' x w' x C on the SAM grid (no W_v, W_o or residual)."""
    import cv2

    h, w = (-(-s // SAM_PATCH) * SAM_PATCH for s in image.shape[:2])
    if (h, w) != image.shape[:2]:
        image = cv2.resize(np.ascontiguousarray(image), (w, h), interpolation=cv2.INTER_LINEAR)
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
        raise ValueError(f"bad stage 'sam:{args}': {usage}") from None
    flags = parts[1:]
    if any(f not in ("neg0.6", "halves") for f in flags) or len(set(flags)) != len(flags):
        raise ValueError(f"bad stage 'sam:{args}': {usage}")
    refine_neg_cos, halves = "neg0.6" not in flags, "halves" in flags
    name = f"sam:{cos_fac:g}" + ("" if refine_neg_cos else ":neg0.6") + (":halves" if halves else "")

    def run(tokens: torch.Tensor, image: np.ndarray, normalizer: str) -> torch.Tensor:
        from ..models.proxies import PROXIES

        backbone = PROXIES.get(SAM_BACKBONE, tokens.device)
        return sam_smooth(tokens, image, backbone, normalizer, cos_fac, refine_neg_cos, halves)

    return Stage("global", name, run, backbones=(SAM_BACKBONE,))


STAGES.register(
    "sam",
    _sam_stage,
    help="global: Trident's SAM stage: SAM ViT-B attention on the whole image, filtered by value cosine (> min(0.9, "
    "COS_FAC x mean), default 1.2; neg0.6: negative thresholds -> 0.6; halves: left/right halves), smooths the spliced tokens",
)

# -- the refine stage `samrefine[:COARSE[:IOU]]` (step 6) ---------------------------------------------------
def _samrefine_stage(args: str) -> Stage:
    from .trident_refine import sam_refine

    usage = "expected samrefine[:COARSE[:IOU]], e.g. samrefine:0.2:0.8 (thresholds in [0, 1])"
    parts = args.split(":") if args else []
    try:
        coarse, iou = (float(parts[0]) if parts else 0.2), (float(parts[1]) if len(parts) > 1 else 0.8)
    except ValueError:
        raise ValueError(f"bad stage 'samrefine:{args}': {usage}") from None
    if len(parts) > 2 or not (0 <= coarse <= 1 and 0 <= iou <= 1):
        raise ValueError(f"bad stage 'samrefine:{args}': {usage}")

    def run(labels: torch.Tensor, maps, image: np.ndarray) -> torch.Tensor:
        return sam_refine(labels, maps, image, coarse, iou)

    return Stage("refine", f"samrefine:{coarse:g}:{iou:g}", run, backbones=(SAM_BACKBONE,))  # its weights: --proxy-weights


STAGES.register(
    "samrefine",
    _samrefine_stage,
    help="refine: Trident's SAM prompt refinement (--sam_refine): components of the coarse map (top prob >= COARSE, "
    "default 0.2) prompt SAM ViT-B (box, point, probabilities); masks with predicted IoU > IOU (0.8) rescore their "
    "class by sigmoid(logit) x prob (needs segment_anything and --proxy-weights sam_vitb=sam_vit_b_01ec64.pth)",
)

_TRIDENT_NOTES = (
    "copied: ProxyCLIP's attention per 336-px window with DINO ViT-B/16 on CLIP's 21 x 21 grid (shift 1.2 x mean, "
    "scale 3, -inf below 0, one map for all heads), CLS dropped before the last block, W_o(A V) before ln_post "
    "spliced on the image's patch grid with overlaps averaged; the image resized so both sides are multiples of 16 "
    "and >= the window; SAM ViT-B on the original image resized up to multiples of 16 (cv2 bilinear), then SAM's "
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
_TRIDENT = "ext:dino_vitb16[cos,shift:1.2,scale:3,pos]/{}/cls:0/noffn/hook:sam"
register_preset(
    "trident",
    _TRIDENT.format("softmax"),
    "Trident (Shi et al., ICCV 2025): ProxyCLIP attention with DINO ViT-B/16 per window, windows spliced before "
    "ln_post, SAM ViT-B attention filtered by value cosine smooths the spliced features over the whole image",
    _TRIDENT_NOTES,
)
register_preset(
    "trident-entmax",
    _TRIDENT.format("entmax:1.5"),
    "trident with alpha-entmax (alpha 1.5) in the DINO proxy attention and, in the SAM stage, on SAM's own "
    "logits in place of the value-cosine threshold and sum normalisation (this project)",
    _TRIDENT_NOTES,
)
