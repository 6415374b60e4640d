"""Trident's optional SAM prompt refinement (step 6, `--sam_refine`): the refine stage `samrefine`.

From research/peers-sota.md 2.7 (YuHengsss/Trident `seg_utils/utils.py` `sam_refinement`; that file is
not in the search index, so the arithmetic rests on those notes): on the coarse arg-max map (pixels whose
top probability is below `coarse_thresh` form one more class), every 8-connected component of a class
with at least 225 pixels at half resolution prompts SAM (segment_anything's SamPredictor, one mask per
prompt) with its box, its highest-probability point and the class probabilities (x 0.005 where above
`coarse_thresh`, 0 elsewhere) as the mask input. Masks whose predicted IoU exceeds `iou_thresh` are kept;
a class's refined score is the max over its kept masks of sigmoid(SAM logit) x its probability. Where
the notes leave details open (ours): components whose mask is dropped keep the class probability inside
them; classes without a kept mask keep their probabilities; only pixels inside a kept mask (logit > 0)
change label, to the arg-max of the refined scores over the classes of the coarse map; elsewhere the
labels (background rules included) stay. `--protocol trident-samrefine` adds the stage with the config's
coarse_thresh per dataset (`TRIDENT_COARSE`). Grid: none of its own (`sweeps/grids/trident.toml` runs without it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..evaluation.protocols import PROTOCOLS
from ..models.proxies import PROXIES
from ..runtime.weights import WeightsUnavailableError, require_extra
from ..stages import STAGES, Stage
from . import trident

HALF_AREA = 225  # minimum component area at half resolution
MASK_SCALE = 0.005  # the class probabilities' scale as SAM's mask input
CHUNK = 16  # prompts per SAM decoder call (bounds the B x H x W logits)


@dataclass(frozen=True)
class Prompt:
    """One component: its class, box (x0, y0, x1, y1) and point (x, y) in original pixels, and its
    pixels at the original size (H x W bool)."""

    cls: int
    box: tuple[int, int, int, int]
    point: tuple[int, int]
    mask: np.ndarray


def component_prompts(coarse: np.ndarray, top: np.ndarray, min_area: int = HALF_AREA) -> list[Prompt]:
    """Prompts from the H x W coarse class map (-1: below coarse_thresh, never prompted) and the H x W top
    probability: 8-connected components per class on the half-resolution map (every second pixel), area
    >= min_area there, in class order then cv2's component order; coordinates scaled back by 2."""
    import cv2

    half, half_top = coarse[::2, ::2], top[::2, ::2]
    h, w = coarse.shape
    out = []
    for c in np.unique(half):
        if c < 0:
            continue
        count, comp = cv2.connectedComponents((half == c).astype(np.uint8), connectivity=8)
        for k in range(1, count):
            region = comp == k
            if region.sum() < min_area:
                continue
            ys, xs = np.nonzero(region)
            best = np.argmax(np.where(region, half_top, -np.inf))
            py, px = np.unravel_index(best, region.shape)
            full = np.repeat(np.repeat(region, 2, 0), 2, 1)[:h, :w]
            box = (int(xs.min()) * 2, int(ys.min()) * 2, int(xs.max()) * 2 + 1, int(ys.max()) * 2 + 1)
            out.append(Prompt(int(c), box, (int(px) * 2, int(py) * 2), full))
    return out


# predict(prompts, mask inputs B x H x W) -> (logits B x H x W at the original size, predicted IoU B)
Predict = Callable[[Sequence[Prompt], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def refine_labels(
    labels: torch.Tensor, probs: torch.Tensor, classes: Sequence[int], prompts: Sequence[Prompt],
    predict: Predict, coarse_thresh: float, iou_thresh: float, chunk: int = CHUNK,
) -> torch.Tensor:
    """labels: H x W int64; probs: K x H x W probabilities of `classes` (the coarse map's classes).
    Returns the refined H x W labels by the rule in the module docstring, calling `predict` on at most
    `chunk` prompts at a time (memory: (K + chunk) x H x W floats)."""
    row = {c: i for i, c in enumerate(classes)}
    refined: dict[int, torch.Tensor] = {}
    failed: dict[int, torch.Tensor] = {}
    inside = torch.zeros(labels.shape, dtype=torch.bool)
    for i in range(0, len(prompts), chunk):
        part = prompts[i : i + chunk]
        p = probs[[row[q.cls] for q in part]]
        logits, iou = predict(part, torch.where(p > coarse_thresh, p * MASK_SCALE, torch.zeros_like(p)))
        for q, logit, score, prob in zip(part, logits.float(), iou.float(), p):
            if score > iou_thresh:
                s = torch.sigmoid(logit).cpu() * prob
                refined[q.cls] = s if q.cls not in refined else torch.maximum(refined[q.cls], s)
                inside |= logit.cpu() > 0
            else:
                failed[q.cls] = failed.get(q.cls, torch.zeros_like(inside)) | torch.from_numpy(q.mask)
    if not refined:
        return labels
    scores = probs.clone()
    for c, s in refined.items():
        keep = failed.get(c)
        scores[row[c]] = s if keep is None else torch.maximum(s, probs[row[c]] * keep)
    best = torch.as_tensor(list(classes))[scores.argmax(0)]
    return torch.where(inside, best, labels)


def coarse_maps(maps, coarse_thresh: float) -> tuple[np.ndarray, np.ndarray, list[int], torch.Tensor]:
    """From a ClassMaps (bands of C x h x W probabilities): the H x W coarse map (-1 below coarse_thresh),
    the H x W top probability, the classes the coarse map holds and their K x H x W probabilities (two
    passes over the bands; only those K classes are kept)."""
    _, height, width = maps.shape
    top = torch.empty((height, width))
    arg = torch.empty((height, width), dtype=torch.int64)
    for y0, y1 in maps.bands:
        t, a = maps.rows(y0, y1).float().max(0)
        top[y0:y1], arg[y0:y1] = t.cpu(), a.cpu()
    coarse = torch.where(top < coarse_thresh, -1, arg)
    classes = [int(c) for c in torch.unique(coarse) if c >= 0]
    probs = torch.empty((len(classes), height, width))
    for y0, y1 in maps.bands:
        probs[:, y0:y1] = maps.rows(y0, y1)[classes].float().cpu()
    return coarse.numpy(), top.numpy(), classes, probs


def sam_predict(predictor, image: np.ndarray) -> Predict:
    """`Predict` through a segment_anything SamPredictor on the H x W x 3 uint8 RGB image (encoded once):
    box, point (label 1) and mask input per prompt, multimask_output False, logits at the original size.
    The mask inputs are brought to SAM's 256 x 256 low-resolution frame (longest side 256, zero padding)."""
    import torch.nn.functional as F

    predictor.set_image(image)
    size = image.shape[:2]
    low = predictor.transform.get_preprocess_shape(size[0], size[1], 256)
    device = predictor.device

    def predict(prompts: Sequence[Prompt], masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        boxes = torch.tensor([q.box for q in prompts], dtype=torch.float32, device=device)
        points = torch.tensor([[q.point] for q in prompts], dtype=torch.float32, device=device)
        m = F.interpolate(masks[:, None].to(device), size=low, mode="bilinear", align_corners=False)
        m = F.pad(m, (0, 256 - low[1], 0, 256 - low[0]))
        logits, iou, _ = predictor.predict_torch(
            point_coords=predictor.transform.apply_coords_torch(points, size),
            point_labels=torch.ones(points.shape[:2], device=device),
            boxes=predictor.transform.apply_boxes_torch(boxes, size),
            mask_input=m,
            multimask_output=False,
            return_logits=True,
        )
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


_PREDICTORS: dict = {}


def sam_predictor(device: torch.device | str):
    """The SamPredictor of `--proxy-weights`'s sam_vitb weights on `device`, loaded once per weights and device."""
    key = (PROXIES.resolved_weights("sam_vitb"), str(torch.device(device)))
    if key not in _PREDICTORS:
        _PREDICTORS[key] = load_sam_predictor(key[0], torch.device(device))
    return _PREDICTORS[key]


def sam_refine(labels: torch.Tensor, maps, image: np.ndarray, coarse_thresh: float = 0.2, iou_thresh: float = 0.8, predictor=None) -> torch.Tensor:
    """The refine stage on one image: H x W labels, its ClassMaps, the H x W x 3 uint8 image -> labels.
    predictor: a SamPredictor (default: `sam_predictor` on the probabilities' device)."""
    coarse, top, classes, probs = coarse_maps(maps, coarse_thresh)
    prompts = component_prompts(coarse, top)
    if not prompts:
        return labels
    predictor = predictor or sam_predictor(maps.rows(0, 1).device)
    with torch.inference_mode():
        return refine_labels(labels, probs, classes, prompts, sam_predict(predictor, image), coarse_thresh, iou_thresh)


# -- the refine stage `samrefine[:COARSE[:IOU]]` (step 6) ---------------------------------------------------
def _samrefine_stage(args: str) -> Stage:
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

    return Stage("refine", f"samrefine:{coarse:g}:{iou:g}", run, backbones=(trident.SAM_BACKBONE,))  # its weights: --proxy-weights


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
