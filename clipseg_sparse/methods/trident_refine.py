"""Trident's optional SAM prompt refinement (step 6, `--sam_refine`): the refine stage `samrefine`.

Copied from YuHengsss/Trident@a93b346 `seg_utils/utils.py` `sam_refinement` (with `split_connected_regions`,
`map_refinement_coarse`, `map_failed_regions`), called from `trident.py` `postprocess_result`:
1. the labels (after the background threshold) and the class probabilities are brought to half
   resolution (H // 2 x W // 2: labels nearest, probabilities bilinear); there, pixels whose top
   probability is below `coarse_thresh` form one more class, never prompted;
2. every 8-connected component of a class with at least 225 pixels (classes whose half-resolution
   probability never reaches `coarse_thresh` skipped) prompts SAM with its box (inclusive corners) and its
   highest-probability point, both in half-resolution pixels mapped to SAM's 1024 frame as if the image
   were that half-resolution one, and with the class's half-resolution probabilities, resized to the
   original image's 256-px low-resolution frame, zero padded, x 0.005 where above `coarse_thresh` (0
   elsewhere), as one 1 x 256 x 256 mask input shared by the class's prompts (SAM's mask embedding then
   normalises it over rows, as its LayerNorm2d does on an unbatched input);
3. SAM (segment_anything's SamPredictor, `multimask_output=False`) runs on the image the `sam` stage sees
   (`trident.sam_image`: each side rounded up to 16); its low-resolution logits are upsampled to that
   image's size, then bilinearly to the original size when it differs;
4. masks with predicted IoU > `iou_thresh` are kept; a class's score is the max over its kept masks of
   sigmoid(logit) x its probability, times the union of those masks (logit > 0); classes without a kept
   mask score 0; where any class scores above 0 the label becomes the arg-max of the scores, elsewhere it
   stays. Masks that fail the IoU test change no label (the published `map_failed_regions` only lifts
   the returned probabilities: its label test compares them with a maximum that already includes them).
`--protocol trident-samrefine` adds the stage with the config's coarse_thresh per dataset (`TRIDENT_COARSE`).
SAM's encoder runs once per image: where the `sam` stage ran on the whole image (not `halves`) with the
predictor's weights (`same_encoder`: a checkpoint file through timm's converter; not weights "none", whose
random draws differ, nor bf16 / fp16), the predictor gets that pass's image embedding (`set_encoding`: the
last block and neck finished from its `trident.SamEncoding`, equal to segment_anything's to float rounding,
tests/methods/test_trident_refine.py), else `SamPredictor.set_image` encodes the image (fp32).
Not copied: the saved probabilities are the ones before refinement; the embedding is fp32 (the published code
reuses its fp16 features of the `sam` stage). Grid: none of its own (`sweeps/grids/trident.toml` runs without it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS
from ..runtime.weights import WeightsUnavailableError, require_extra
from ..stages import STAGES, Stage
from . import trident

HALF_AREA = 225  # minimum component area at half resolution (`minimal_area`)
MASK_SCALE = 0.005  # the class probabilities' scale as SAM's mask input (`sam_mask_coff`)
CHUNK = 16  # prompts per SAM decoder call (bounds the B x H x W logits)


@dataclass(frozen=True)
class Prompt:
    """One component at half resolution: its class, box (x0, y0, x1, y1; corners inclusive, as
    torchvision's `masks_to_boxes`) and point (x, y), in half-resolution pixels."""

    cls: int
    box: tuple[int, int, int, int]
    point: tuple[int, int]


def _linear_taps(size_in: int, size_out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first index, second index, weight of the second) of each output sample of a linear resize
    (align_corners False), as torch's bilinear kernel computes them (fp32, negative sources clamped)."""
    scale = torch.tensor(size_in / size_out, dtype=torch.float32)
    src = ((torch.arange(size_out, dtype=torch.float32) + 0.5) * scale - 0.5).clamp(min=0)
    i0 = src.long()
    return i0, (i0 + 1).clamp(max=size_in - 1), src - i0


def half_probabilities(maps) -> torch.Tensor:
    """C x (H // 2) x (W // 2) bilinear resize (align_corners False, as `F.interpolate`) of a ClassMaps'
    C x H x W probabilities, band by band (only a quarter of the whole map is ever held)."""
    C, H, W = maps.shape
    dh, dw = H // 2, W // 2
    y0, y1, wy = _linear_taps(H, dh)
    x0, x1, wx = _linear_taps(W, dw)
    out = torch.zeros((C, dh, dw))
    for a, b in maps.bands:
        p = maps.rows(a, b).float().cpu()
        cols = p[:, :, x0] * (1 - wx) + p[:, :, x1] * wx  # C x (b - a) x dw
        for rows, weight in ((y0, 1 - wy), (y1, wy)):
            inside = ((rows >= a) & (rows < b)).nonzero()[:, 0]
            out.index_add_(1, inside, cols[:, rows[inside] - a] * weight[inside].view(1, -1, 1))
    return out


def component_prompts(labels_half: np.ndarray, probs_half: torch.Tensor, coarse_thresh: float, min_area: int = HALF_AREA) -> list[Prompt]:
    """`split_connected_regions` on the half-resolution labels (h x w) and probabilities (C x h x w):
    pixels whose top probability is below coarse_thresh (when > 0) are never prompted; per class present
    whose probability reaches coarse_thresh somewhere, its 8-connected components of >= min_area pixels,
    each with its box and the first pixel of highest class probability inside it; in class order."""
    import cv2

    coarse = labels_half.copy()
    if coarse_thresh > 0:
        coarse[(probs_half.max(0).values < coarse_thresh).numpy()] = -1
    out = []
    for c in np.unique(coarse):
        if c < 0 or probs_half[c].max() < coarse_thresh:
            continue
        count, comp = cv2.connectedComponents((coarse == c).astype(np.uint8), connectivity=8)
        for k in range(1, count):
            region = comp == k
            if region.sum() < min_area:
                continue
            ys, xs = np.nonzero(region)
            best = int(torch.argmax(probs_half[c] * torch.from_numpy(region)))
            out.append(Prompt(int(c), (int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())), (best % region.shape[1], best // region.shape[1])))
    return out


def mask_input(probs_half: torch.Tensor, size: tuple[int, int], coarse_thresh: float, low: tuple[int, int]) -> torch.Tensor:
    """One class's 1 x 256 x 256 mask input from its h x w half-resolution probabilities: resized
    bilinearly to `low` (the original H x W `size` with its longest side 256), zero padded, x 0.005
    where above coarse_thresh, 0 elsewhere (`sam_refinement`)."""
    r = F.interpolate(probs_half[None, None], size=low, mode="bilinear", align_corners=False)[0]
    r = F.pad(r, (0, 256 - low[1], 0, 256 - low[0]))
    return torch.where(r > coarse_thresh, MASK_SCALE * r, torch.zeros_like(r))


# predict(prompts of one class, its 1 x 256 x 256 mask input) -> (logits B x H x W at the original size, IoU B)
Predict = Callable[[Sequence[Prompt], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def refine_labels(
    labels: torch.Tensor, maps, probs_half: torch.Tensor, prompts: Sequence[Prompt], predict: Predict,
    coarse_thresh: float, iou_thresh: float, chunk: int = CHUNK,
) -> torch.Tensor:
    """labels: H x W int64 (after the background threshold); maps: the image's ClassMaps; probs_half:
    `half_probabilities(maps)`. Returns the refined H x W labels by the rule in the module docstring,
    calling `predict` on at most `chunk` prompts of one class at a time (memory: (K + chunk) x H x W
    floats for the K classes with a kept mask)."""
    H, W = labels.shape
    scale = 256 * 1.0 / max(H, W)  # ResizeLongestSide.get_preprocess_shape(H, W, 256)
    low = (int(H * scale + 0.5), int(W * scale + 0.5))
    best: dict[int, torch.Tensor] = {}  # class -> max over its kept masks of sigmoid(logit)
    union: dict[int, torch.Tensor] = {}  # class -> its kept masks' union
    for c in dict.fromkeys(q.cls for q in prompts):
        mine = [q for q in prompts if q.cls == c]
        masks = mask_input(probs_half[c], (H, W), coarse_thresh, low)
        for i in range(0, len(mine), chunk):
            logits, iou = predict(mine[i : i + chunk], masks)
            for logit, score in zip(logits.float(), iou.float()):
                if score > iou_thresh:
                    sig = torch.sigmoid(logit).cpu()
                    best[c] = sig if c not in best else torch.maximum(best[c], sig)
                    inside = logit.cpu() > 0
                    union[c] = inside if c not in union else union[c] | inside
    if not best:
        return labels
    classes = sorted(best)
    scores = torch.empty((len(classes), H, W))
    for y0, y1 in maps.bands:
        scores[:, y0:y1] = maps.rows(y0, y1)[classes].float().cpu()
    for i, c in enumerate(classes):  # max_m(sigmoid_m x p) = p x max_m sigmoid_m exactly (p >= 0)
        scores[i] = best[c] * scores[i] * union[c]
    top, arg = scores.max(0)
    return torch.where(top > 0, torch.as_tensor(classes)[arg], labels)


def same_encoder(predictor, backbone) -> bool:
    """Whether the predictor's image encoder holds exactly the weights of `backbone` (timm's SAM ViT, the
    `sam` stage's), mapped by timm's converter of SAM checkpoints: then that stage's pass is set_image's."""
    from timm.models.vision_transformer_sam import checkpoint_filter_fn

    ours = backbone.model.state_dict()
    theirs = checkpoint_filter_fn({f"image_encoder.{k}": v for k, v in predictor.model.image_encoder.state_dict().items()}, backbone.model)
    return ours.keys() == theirs.keys() and all(
        ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k].to(ours[k].device)) for k in ours
    )


def set_encoding(predictor, encoding: trident.SamEncoding) -> None:
    """SamPredictor's state after `set_image(trident.sam_image(image))` from the `sam` stage's pass over that
    image (`set_torch_image`'s assignments, its encoder's output replaced by the encoding's embedding)."""
    predictor.reset_image()
    predictor.original_size = encoding.original_size
    predictor.input_size = encoding.input_size
    predictor.features = encoding.embedding().to(predictor.device)
    predictor.is_image_set = True


def sam_predict(predictor, image: np.ndarray, half: tuple[int, int], encoding: trident.SamEncoding | None = None) -> Predict:
    """`Predict` through a segment_anything SamPredictor set to `trident.sam_image(image)` (the `sam`
    stage's image): from `encoding`, that stage's pass over it, when given (its encoder must hold the
    predictor's weights: `same_encoder`), else by `set_image`; boxes and points (label 1) of the `half`-size
    frame mapped by SAM's transform as if that were the image, the class's mask input, multimask_output
    False; the low-resolution logits upsampled by SAM to its image's size, then bilinearly to the original size."""
    if encoding is not None:
        set_encoding(predictor, encoding)
    else:
        predictor.set_image(trident.sam_image(image))
    size = image.shape[:2]
    device = predictor.device

    def predict(prompts: Sequence[Prompt], masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        boxes = torch.tensor([q.box for q in prompts], dtype=torch.float32, device=device)
        points = torch.tensor([[q.point] for q in prompts], dtype=torch.float32, device=device)
        _, iou, low = predictor.predict_torch(
            point_coords=predictor.transform.apply_coords_torch(points, half),
            point_labels=torch.ones(points.shape[:2], device=device),
            boxes=predictor.transform.apply_boxes_torch(boxes, half),
            mask_input=masks.to(device),
            multimask_output=False,
        )
        logits = predictor.model.postprocess_masks(low, predictor.input_size, predictor.original_size)
        if tuple(logits.shape[-2:]) != tuple(size):
            logits = F.interpolate(logits, size, mode="bilinear", align_corners=False)
        return logits[:, 0], iou[:, 0]

    return predict


def load_sam_predictor(weights: str, device: torch.device):
    """segment_anything's ViT-B SamPredictor: weights a local `sam_vit_b_01ec64.pth` (the file holds the
    encoder, prompt encoder and mask decoder), or "none" for seeded random weights. The Hub tag the `sam`
    stage reads holds the image encoder only, so "hub" is refused with a one-line error."""
    sa = require_extra("segment_anything", "stage samrefine (SAM's prompt encoder and mask decoder)")
    if weights == "hub":
        raise WeightsUnavailableError(
            "stage samrefine needs SAM's full checkpoint (sam_vit_b_01ec64.pth, encoder + prompt encoder + mask decoder; "
            "the timm Hub tag holds the encoder only): give --proxy-weights sam_vitb=PATH"
        )
    if weights == "none":
        torch.manual_seed(0)
        sam = sa.sam_model_registry["vit_b"](checkpoint=None)
    else:
        try:
            sam = sa.sam_model_registry["vit_b"](checkpoint=weights)
        except (OSError, RuntimeError) as e:
            raise WeightsUnavailableError(f"{weights}: cannot load as SAM ViT-B weights: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return sa.SamPredictor(sam.to(device).eval())


def sam_predictor(backbones, device: torch.device | str):
    """The SamPredictor of the run's sam_vitb weights (`models.proxies.ProxyBackbones`, `--proxy-weights`) on
    `device`, loaded once per weights and device and held by those backbones."""
    weights = backbones.resolved_weights(trident.SAM_BACKBONE)
    return backbones.held(("sam_predictor", weights, str(torch.device(device))), lambda: load_sam_predictor(weights, torch.device(device)))


def sam_refine(
    labels: torch.Tensor, maps, image: np.ndarray, predictor, coarse_thresh: float = 0.2, iou_thresh: float = 0.8,
    encoding: trident.SamEncoding | None = None,
) -> torch.Tensor:
    """The refine stage on one image: H x W labels, its ClassMaps, the H x W x 3 uint8 image, a SamPredictor
    (`sam_predictor`), the `sam` stage's pass over the image when it may serve (`kept_encoding`) -> labels."""
    H, W = labels.shape
    half = (H // 2, W // 2)
    probs_half = half_probabilities(maps)
    labels_half = F.interpolate(labels[None, None].float(), size=half, mode="nearest")[0, 0].long().numpy()
    prompts = component_prompts(labels_half, probs_half, coarse_thresh)
    if not prompts:
        return labels
    with torch.inference_mode():
        return refine_labels(labels, maps, probs_half, prompts, sam_predict(predictor, image, half, encoding), coarse_thresh, iou_thresh)


def kept_encoding(run, predictor) -> trident.SamEncoding | None:
    """The `sam` stage's pass over this run's image (`trident.SAM_ENCODING`) when its encoder holds the
    predictor's weights (`same_encoder`, checked once per pair and held with the run's backbones): always with
    a checkpoint file, never with weights "none" (segment_anything's and timm's random draws differ)."""
    encoding = run.kept.get(trident.SAM_ENCODING)
    if encoding is None:
        return None
    same = run.backbones.held(("sam_same_encoder", predictor, encoding.backbone), lambda: same_encoder(predictor, encoding.backbone))
    return encoding if same else None


# -- the refine stage `samrefine[:COARSE[:IOU]]` (step 6) ---------------------------------------------------
def _samrefine_stage(args: str) -> Stage:
    usage = "expected samrefine[:COARSE[:IOU]], e.g. samrefine:0.2:0.8 (thresholds in [0, 1])"
    parts = args.split(":") if args else []
    try:
        coarse, iou = (float(parts[0]) if parts else 0.2), (float(parts[1]) if len(parts) > 1 else 0.8)
    except ValueError:
        raise UserValueError(f"bad stage 'samrefine:{args}': {usage}") from None
    if len(parts) > 2 or not (0 <= coarse <= 1 and 0 <= iou <= 1):
        raise UserValueError(f"bad stage 'samrefine:{args}': {usage}")

    def run(labels: torch.Tensor, maps, image) -> torch.Tensor:
        predictor = sam_predictor(image.backbones, maps.rows(0, 1).device)
        return sam_refine(labels, maps, image.image, predictor, coarse, iou, kept_encoding(image, predictor))

    # its weights: --proxy-weights sam_vitb=...; SAM's predictor, not the `sam_vitb` encoder, is what it loads
    return Stage("refine", f"samrefine:{coarse:g}:{iou:g}", run, backbones=(trident.SAM_BACKBONE,), load=sam_predictor)


STAGES.register(
    "samrefine",
    _samrefine_stage,
    help="refine: Trident's SAM prompt refinement (--sam_refine): components of the coarse map (top prob >= COARSE, "
    "default 0.2) prompt SAM ViT-B (box, point, probabilities); masks with predicted IoU > IOU (0.8) rescore their "
    "class by sigmoid(logit) x prob (needs segment_anything and --proxy-weights sam_vitb=sam_vit_b_01ec64.pth)",
)

# `--sam_refine` (off in the published config, passed by the published README's evaluation command): the
# refine stage samrefine with the config's `coarse_thresh` per dataset and `sam_iou_thresh` 0.8
TRIDENT_COARSE = {"voc21": 0.2, "voc20": 0.2, "context60": 0.15, "context59": 0.15, "coco-object": 0.25, "coco-stuff": 0.05, "cityscapes": 0.10, "ade20k": 0.05}
_TRIDENT = trident.PROTOCOL
PROTOCOL = PROTOCOLS.register(
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
