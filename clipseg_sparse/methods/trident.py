"""Trident (Shi et al., ICCV 2025): splice-then-segment with DINO ViT-B/16 and SAM ViT-B.

Read from `YuHengsss/Trident@a93b346`: `trident.py` (`get_trident_seg`, `get_sam_feat`, `get_windowed_imgs`,
`postprocess_result`), `open_clip/transformer.py` (`custom_attn`, `guidance_attn`, `get_sam_sim`),
`seg_utils/utils.py` (`preprocess_image`, `sam_refinement`), configs; tests/methods/test_trident_published.py runs a
transcription of them against this module. Steps and where they live:
1. mmseg's keep-ratio resize (cv2 on the uint8 image), then `preprocess_image`: both sides scaled by (the
   longer side rounded up to 16) / the longer side, each rounded up to 16 and to at least the window
   (`InferenceSettings.size_multiple`, `size_rule="longer"`); 336-px windows;
2. per window, ProxyCLIP's attention with DINO ViT-B/16 (`ext:dino_vitb16`, beta 1.2, gamma 3, -inf
   below 0), CLS dropped before the last block, reduced output W_o(A V) kept before ln_post: the
   engine's spec (preset `trident` below);
3. splice: the windows' outputs placed on the image's patch grid, overlaps averaged
   (`spliced_tokens`, the forward `splice` below);
4. SAM ViT-B (LayerNorm eps 1e-6, as segment_anything builds it) on the original image rounded up to
   multiples of 16 (`sam_image`; SAM's preprocessing: longest side 1024, padded), its last block's
   attention and values on the valid grid, filtered by value cosine (`sam_filtered_attention` below);
5. spliced tokens resized bilinearly to the SAM grid, F <- A F, then ln_post, proj; logits on the SAM
   grid resized to the original size (steps 4-5: the global stage `sam` here, and `grid_cosine`).
6. the optional SAM prompt refinement (`--sam_refine`; off in the published config, on in the
   published README's evaluation command): the refine stage `samrefine[:COARSE[:IOU]]`
   (`methods/trident_refine.py`, segment_anything's prompt encoder and mask decoder; `--protocol
   trident-samrefine` adds it with the per-dataset coarse_thresh). Step 4's pass over the whole image is kept
   for it (`SamEncoding` in `ImageRun.kept`), so SAM's encoder runs once where both read the same weights.
Quirks copied and fixed: `TRIDENT_NOTES` (docs/datasets.md, Presets). Protocols `trident-metaclip` (MetaCLIP fullcc B/16)
and `trident-laion-h14` (OpenCLIP ViT-H/14) name the other CLIPs of the published tables. Grid:
`sweeps/grids/trident.toml`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.normalizers import Normalizer, normalize
from ..attention.presets import register_preset
from ..attention.terms import parse_number
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol, register_weights_variant
from ..evaluation.published import register_published
from ..models.backbones import Backbone, sam_scores
from ..segment.maps import CosineMap, grid_cosine
from ..segment.plan import FORWARDS, ImageRun, Plan
from ..segment.preprocess import prepare
from ..segment.windows import GridSum, WindowsForward, iter_window_features
from ..stages import STAGES, Stage

SAM_BACKBONE = "sam_vitb"
SAM_PATCH = 16
SAM_ENCODING = "trident.sam_encoding"  # the `sam` stage's SamEncoding of the image, in ImageRun.kept


@dataclass(frozen=True)
class SamEncoding:
    """The `sam` stage's SAM pass over one whole image, kept for the prompt refinement of that image
    (`trident_refine`): SamPredictor's state after `set_image(sam_image(image))` short of SAM's last block and
    neck, which `embedding` runs only when the refinement prompts SAM."""

    backbone: Backbone
    last_input: torch.Tensor  # 1 x 64 x 64 x C, the hidden state entering SAM's last block
    input_size: tuple[int, int]  # the image resized to longest side 1024 (SamPredictor.input_size)
    original_size: tuple[int, int]  # sam_image(image)'s size (SamPredictor.original_size)

    def embedding(self) -> torch.Tensor:
        """SAM's image embedding, 1 x 256 x 64 x 64 (SamPredictor.features)."""
        return self.backbone.sam_embedding(self.last_input)


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


def sam_maps(
    image: np.ndarray, backbone: Backbone, kept: dict | None = None
) -> tuple[torch.Tensor, Iterator[torch.Tensor], torch.Tensor, tuple[int, int]]:
    """SAM's last block on one image (SamPredictor's input): (values 1 x heads x n x d on the valid
    grid, an iterator over the heads' 1 x N x N attention logits on the whole padded grid, the n indices
    of the valid tokens among the N, the valid grid (h, w) with n = h*w). The valid grid is the part SAM's
    padded input covers (`get_sam_feat`: input_size // 16). kept: where to leave the pass (`SamEncoding`)."""
    side = backbone.info.input_size
    resized, size = sam_preprocess(image, side)
    feats = backbone.features(sam_pixels(resized, backbone, side), want=("qkv",) if kept is None else ("qkv", "last_input"))
    if kept is not None:
        kept[SAM_ENCODING] = SamEncoding(backbone, feats.last_input, size, image.shape[:2])
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


def sam_attention(
    image: np.ndarray, backbone: Backbone, cos_fac: float, refine_neg_cos: bool, normalizer: str, kept: dict | None = None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The SAM stage's 1 x n x n map on the valid grid (h, w), n = h*w (kept: `sam_maps`).

    normalizer "softmax": Trident's: SAM's softmax over the whole padded grid, cropped to the valid grid,
    kept where the value cosine passes its threshold (`sam_filtered_attention`), heads averaged, rows
    divided by their sum. Any other normalizer (entmax:A, sparsemax) replaces that threshold and sum:
    the heads' logits on the valid grid, normalised by it, averaged over heads (cos_fac unused)."""
    v, heads, keep, valid = sam_maps(image, backbone, kept)
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
    cos_fac: float = 1.2, refine_neg_cos: bool = True, halves: bool = False, kept: dict | None = None,
) -> torch.Tensor:
    """Trident's steps 4-5 on spliced tokens 1 x h x w x C (before ln_post): the original uint8 image
    resized up to multiples of 16 (cv2 bilinear), SAM's map on it (`sam_attention`; `halves`: on its left
    and right halves separately, Cityscapes), the tokens resized bilinearly (align_corners False) to the
    SAM grid and multiplied by the map: 1 x h' x w' x C on the SAM grid (no W_v, W_o or residual).
    kept: where SAM's pass over the whole image is left for the prompt refinement (`SamEncoding`; not with
    `halves`, whose passes see other pixels than SamPredictor's)."""
    image = sam_image(image)
    w = image.shape[1]
    parts = [image[:, : w // 2], image[:, w // 2 :]] if halves else [image]
    maps = [sam_attention(part, backbone, cos_fac, refine_neg_cos, normalizer, None if halves else kept) for part in parts]
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
        cos_fac = parse_number(parts[0], "sam") if parts else 1.2
    except ValueError:
        raise UserValueError(f"bad stage 'sam:{args}': {usage}") from None
    flags = parts[1:]
    if any(f not in ("neg0.6", "halves") for f in flags) or len(set(flags)) != len(flags):
        raise UserValueError(f"bad stage 'sam:{args}': {usage}")
    refine_neg_cos, halves = "neg0.6" not in flags, "halves" in flags
    name = f"sam:{cos_fac:g}" + ("" if refine_neg_cos else ":neg0.6") + (":halves" if halves else "")

    def run(tokens: torch.Tensor, image) -> torch.Tensor:
        return sam_smooth(tokens, image.image, image.backbone(SAM_BACKBONE), image.normalizer, cos_fac, refine_neg_cos, halves, image.kept)

    return Stage("global", name, run, backbones=(SAM_BACKBONE,), forward="splice")


STAGES.register(
    "sam",
    _sam_stage,
    help="global: Trident's SAM stage: SAM ViT-B attention on the whole image, filtered by value cosine (> min(0.9, "
    "COS_FAC x mean), default 1.2; neg0.6: negative thresholds -> 0.6; halves: left/right halves), smooths the spliced tokens",
)


# -- the forward `splice` (steps 3-5): the windows' tokens spliced, then the global stage over the image ------------
def spliced_tokens(run: ImageRun) -> torch.Tensor:
    """Trident's splice: every window's last-block tokens before ln_post (`DenseCLIP.dense_tokens`,
    h x w cells per window) placed at the window's corner on the image's grid of cells, overlaps
    averaged: 1 x Gh x Gw x C. Windows must tile that grid: the window side a whole number of cells and
    every corner on a cell boundary (for CLIP's grid: image sides, window and stride multiples of the
    patch size; `InferenceSettings.size_multiple`)."""
    clip, stages = run.clip, run.plan.added_token_stages()
    _, _, H, W = run.pixels.shape

    def encode(crops, spec, pos_interp, regions, context):
        return clip.dense_tokens(crops, spec, stages, pos_interp, context=context)

    boxes, feats = [], []
    for chunk, f in iter_window_features(run, encode=encode):
        boxes += chunk
        feats.append(f)
    feats = torch.cat(feats)
    (y1, y2, x1, x2), (h, w) = boxes[0], feats.shape[1:3]
    cell_h, cell_w = (y2 - y1) // h, (x2 - x1) // w
    if (y2 - y1) % h or (x2 - x1) % w or H % cell_h or W % cell_w or any(b[0] % cell_h or b[2] % cell_w for b in boxes):
        raise UserValueError(
            f"splicing windows needs the image ({H}x{W}), window and stride on the {cell_h}x{cell_w}-pixel cell grid "
            f"(set size_multiple={clip.patch_size}, a window and stride multiple of {clip.patch_size})"
        )
    corners = [(b[0] // cell_h, b[2] // cell_w) for b in boxes]
    return splice_windows(feats, corners, (H // cell_h, W // cell_w))[None]


def splice_windows(feats: torch.Tensor, corners: list[tuple[int, int]], grid: tuple[int, int]) -> torch.Tensor:
    """Trident's splice: window features W x h x w x C placed at their top-left patch corners on an
    image grid (H x W patches), overlaps averaged: H x W x C. Every cell must be covered."""
    total = GridSum(grid)
    total.add(feats, corners)
    return total.mean()


class SpliceForward(WindowsForward):
    """The windows' last-block tokens spliced on the image's patch grid, then the one global stage over the
    whole image (Trident's `sam`), ln_post, proj and the cosine on its grid. Its attention, what analyze and
    explain read, is the windows' (the global stage acts on the spliced tokens after it)."""

    name = "splice"
    kinds = frozenset({"token", "global"})

    def check(self, plan: Plan) -> None:
        found = plan.of_kind("global")
        if len(found) > 1:
            raise UserValueError(f"one global stage at a time (got {', '.join(s.name for s in found)})")

    def refusal(self, stage: Stage, plan: Plan) -> str:
        g = plan.of_kind("global")[0].name
        if stage.kind == "match":
            return f"match stage {stage.name} works on each window's cosine map; it cannot run with the global stage {g}"
        if stage.kind == "windows":
            return (f"stage {stage.name} works on each window's patch map; it cannot run with the global stage {g}, "
                    f"which splices the windows into one image-wide map before any map is made")  # fmt: skip
        if stage.kind == "retrieval":
            return f"stage {stage.name} works on the windows' averaged map; it cannot run with the global stage {g}"
        return super().refusal(stage, plan)

    def check_model(self, plan: Plan, clip) -> None:
        s, patch = plan.settings, clip.patch_size
        if s.window and (s.window % patch or s.stride % patch):
            g = plan.of_kind("global")[0].name
            raise UserValueError(f"stage {g} splices the windows: window and stride must be multiples of the patch size {patch} (got {s.window} / {s.stride})")

    def pixels(self, image: np.ndarray, clip, settings) -> torch.Tensor:
        return prepare(image, clip, settings, splices=True)  # whole patches

    def cosine(self, run: ImageRun) -> CosineMap:
        tokens = run.plan.of_kind("global")[0](spliced_tokens(run), run)
        return grid_cosine(run.clip.project(tokens[0]), run.text, run.out_size)


FORWARDS.register("splice", SpliceForward(), help="Trident: the windows' tokens spliced on the image grid for one global stage (`sam`)")

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

# The paper's table (OpenAI B/16, OpenCLIP H/14) from the repository's image, and OV-Stitcher's (MetaCLIP B/16).
register_published(
    PROTOCOL,
    {"voc21": 67.1, "context60": 38.6, "coco-object": 41.1, "voc20": 84.5, "context59": 42.2, "coco-stuff": 28.3,
     "cityscapes": 42.9, "ade20k": 21.9},
    "YuHengsss/Trident@a93b346 assets/data_result.png",
    printed_average=45.8,
    note="the README evaluates with --sam_refine; whether the table's row includes SAM refinement is not said",
)
register_published(
    METACLIP,
    {"voc21": 68.4, "context60": 39.9, "coco-object": 41.7, "voc20": 85.4, "context59": 46.1, "coco-stuff": 29.8,
     "cityscapes": 43.6, "ade20k": 23.7},
    "atw617/OV-Stitcher@270b85a assets/quantitative.png (Trident, MetaCLIP B/16)",
    printed_average=47.4,
)
register_published(
    LAION_H14,
    {"voc21": 70.8, "context60": 40.1, "coco-object": 42.2, "voc20": 88.7, "context59": 44.3, "coco-stuff": 28.6,
     "cityscapes": 47.6, "ade20k": 26.7},
    "YuHengsss/Trident@a93b346 assets/data_result.png (OpenCLIP ViT-H/14)",
    printed_average=48.6,
)  # fmt: skip
