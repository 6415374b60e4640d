"""An image as the network sees it: resize, CLIP's normalisation, rounding, and each window's geometry.

`prepare` is the one way every caller (segmentation, analysis, explain, FG-OVD, the benchmarks) turns an
image into network pixels, so that what is analysed is what is evaluated.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.grid import resize_regions
from ..errors import UserValueError
from ..models.clip import DenseCLIP
from .settings import REMAINDER_RULES, RESIZE_METHODS, SIZE_RULES, InferenceSettings


def resized_shape(height: int, width: int, short_side: int, long_cap: int = 2048) -> tuple[int, int]:
    """mmcv's keep-ratio rescale to (long_cap, short_side): scale = min(long_cap/long, short/short).
    short_side 0 keeps the size; long_cap 0 caps nothing."""
    if not short_side:
        return height, width
    scale = min(short_side / min(height, width), (long_cap or math.inf) / max(height, width))
    return int(height * scale + 0.5), int(width * scale + 0.5)


def window_boxes(height: int, width: int, window: int, stride: int) -> list[tuple[int, int, int, int]]:
    """(y1, y2, x1, x2) of mmseg's sliding windows; the last one is shifted back inside the image."""
    if not window:
        return [(0, height, 0, width)]
    rows = max(height - window + stride - 1, 0) // stride + 1
    cols = max(width - window + stride - 1, 0) // stride + 1
    boxes = []
    for r in range(rows):
        for c in range(cols):
            y2, x2 = min(r * stride + window, height), min(c * stride + window, width)
            boxes.append((max(y2 - window, 0), y2, max(x2 - window, 0), x2))
    return boxes


def rounded_size(height: int, width: int, multiple: int, minimum: int = 0, rule: str = "each") -> tuple[int, int]:
    """The size an H x W network input is resized to so both sides are multiples of `multiple`, and at
    least `minimum` (the window); unchanged when both sides already are multiples (and >= minimum).

    rule "each": each side rounded up on its own. "longer" (Trident's `seg_utils/utils.py:
    preprocess_image`): both sides first scaled by (the longer side rounded up) / the longer side,
    truncated (`int(h * dst / longer)`), then each rounded up: 448 x 597 -> 464 x 608, not 448 x 608.
    """
    if rule not in SIZE_RULES:
        raise UserValueError(f"unknown size rule {rule!r}; choose {', '.join(SIZE_RULES)}")
    up = lambda side: -(-side // multiple) * multiple  # noqa: E731
    sides = (height, width)
    if rule == "longer" and (height % multiple or width % multiple):
        longer = max(sides)
        sides = tuple(int(side * up(longer) / longer) for side in sides)
    return tuple(max(up(side), minimum) for side in sides)


def round_up_pixels(pixels: torch.Tensor, multiple: int, minimum: int = 0, rule: str = "each") -> torch.Tensor:
    """B x 3 x H x W resized bilinearly (align_corners False) to `rounded_size`; unchanged if that is its size."""
    H, W = pixels.shape[-2:]
    size = rounded_size(H, W, multiple, minimum, rule)
    return pixels if size == (H, W) else F.interpolate(pixels, size=size, mode="bilinear", align_corners=False)


def to_pixels(image: np.ndarray, clip: DenseCLIP, size: tuple[int, int], method: str = "torch") -> torch.Tensor:
    """uint8 H x W x 3 -> 1 x 3 x size CLIP-normalised fp32, resized bilinearly (align_corners=False).

    method "torch": resize the float image (no rounding). "opencv": what mmcv's `imresize` does in the
    published pipelines, `cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)` on the uint8 image,
    whose fixed-point result is rounded to uint8 (up to about 0.8 grey levels from the float resize).
    """
    if method not in RESIZE_METHODS:
        raise UserValueError(f"unknown resize method {method!r}; choose {', '.join(RESIZE_METHODS)}")
    if method == "opencv" and tuple(image.shape[:2]) != tuple(size):
        import cv2

        image = cv2.resize(np.ascontiguousarray(image), (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()  # a copy: inputs may be read-only
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False).clamp(0, 255)
    mean = torch.tensor(clip.mean).view(1, 3, 1, 1) * 255
    std = torch.tensor(clip.std).view(1, 3, 1, 1) * 255
    return (x - mean) / std


def window_geometry(side: int, patch: int, rule: str = "pad", whole_image: bool = False) -> tuple[int, int, int, int]:
    """How a window side that is not a whole number of patches is encoded: (patches, pad before, pad
    after, upsampled size). A negative pad after drops pixels. The patch map is upsampled bilinearly to
    `upsampled` pixels and rows `pad before` .. `pad before + side` of it are the window's.

    pad (our default): zero-pad at the end; patch i covers pixels i*patch .. (i+1)*patch.
    centre (ClearCLIP's sliding windows, `compute_padsize`): zero-pad half before (rounded down), half
    after, then crop the upsampled map; a whole image (no windows) is encoded as with drop, as there.
    drop (SCLIP, NACLIP and ClearCLIP without windows): the patch convolution ignores the last
    side % patch pixels and the floor(side / patch) patch map is stretched over the whole side.
    """
    if rule not in REMAINDER_RULES:
        raise UserValueError(f"unknown remainder rule {rule!r}; choose {', '.join(REMAINDER_RULES)}")
    extra = -side % patch
    if rule == "drop" or (rule == "centre" and whole_image):
        if side < patch:
            raise UserValueError(f"a {side}-pixel window side is smaller than one {patch}-pixel patch")
        return side // patch, 0, -(side % patch), side
    before = extra // 2 if rule == "centre" else 0
    return (side + extra) // patch, before, extra - before, side + extra

def window_padding(box: tuple[int, int, int, int], patch: int, rule: str = "pad", whole_image: bool = False) -> tuple[int, int, int, int]:
    """`F.pad` widths (left, right, top, bottom) that turn the pixels of a window `box` = (y1, y2, x1, x2)
    into what the model encodes (`window_geometry` per side; negative widths drop pixels). Every window
    of an image has the same size, so one box gives the padding of all (crops of labels and regions too)."""
    y1, y2, x1, x2 = box
    _, top, bottom, _ = window_geometry(y2 - y1, patch, rule, whole_image)
    _, left, right, _ = window_geometry(x2 - x1, patch, rule, whole_image)
    return left, right, top, bottom


def prepare(
    image: np.ndarray,
    clip: DenseCLIP,
    settings: InferenceSettings,
    splices: bool = False,
    resize: str | None = None,
    multiple: int | None = None,
) -> torch.Tensor:
    """uint8 H x W x 3 -> the 1 x 3 x H' x W' CLIP-normalised pixels the windows are cut from: the keep-ratio
    resize (`resolution`, `max_long_side`) by `settings.resize`, then sides rounded up to
    `settings.size_multiple` by `settings.size_rule` (and to at least the window), as `Segmenter` does.

    splices: a global stage splices the windows (`Segmenter.global_stage`), which needs whole patches:
    without a size multiple, sides are rounded up to the patch size. resize / multiple replace
    `settings.resize` / the rounding multiple (0: none) for callers whose arithmetic is fixed otherwise
    (FG-OVD's region maps, the published-loop benchmark: the float resize, unrounded).
    """
    size = resized_shape(*image.shape[:2], settings.resolution, settings.max_long_side)
    pixels = to_pixels(image, clip, size, settings.resize if resize is None else resize)
    if multiple is None:
        multiple = settings.size_multiple or (clip.patch_size if splices else 0)
    return round_up_pixels(pixels, multiple, settings.window, settings.size_rule) if multiple else pixels


def input_regions(regions: np.ndarray | None, size: tuple[int, int]) -> torch.Tensor | None:
    """An image's H x W region ids (any integer array; None passes through) resized nearest to the network
    input's `size`, as int64: the region map every consumer of the input (segmentation, bank, analysis,
    explain) crops its windows from."""
    return None if regions is None else resize_regions(torch.from_numpy(np.asarray(regions, dtype=np.int64)), tuple(size))
