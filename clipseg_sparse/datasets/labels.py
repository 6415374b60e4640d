"""Reading and writing single-channel label PNGs (palette or grayscale), as mmseg stores segmentations;
the PASCAL VOC colour map they are written with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import UserValueError
from .errors import DatasetError

IGNORE_INDEX = 255  # the label value of pixels no benchmark scores (void)


def read_label_png(path: Path) -> np.ndarray:
    """H x W int64 raw label values (palette indices or gray levels), no decoding."""
    try:
        with Image.open(path) as img:
            mode = img.mode
            arr = np.array(img)
    except FileNotFoundError:
        raise DatasetError(f"{path}: label file not found") from None
    except Exception as e:  # truncated or not an image
        raise DatasetError(f"{path}: cannot read label image ({type(e).__name__}: {e})") from e
    if arr.ndim != 2:
        raise DatasetError(f"{path}: a label must be a single-channel (palette or grayscale) PNG, got mode {mode}")
    return arr.astype(np.int64)


def voc_palette(n: int = 256) -> np.ndarray:
    """n x 3 uint8 PASCAL VOC colour map: the bits of index i spread over R, G, B from the high bit down."""
    palette = np.zeros((n, 3), np.uint8)
    for i in range(n):
        c, r, g, b = i, 0, 0, 0
        for shift in range(7, -1, -1):
            r |= (c & 1) << shift
            g |= ((c >> 1) & 1) << shift
            b |= ((c >> 2) & 1) << shift
            c >>= 3
        palette[i] = (r, g, b)
    return palette


PALETTE = voc_palette()
MAX_PNG_CLASSES = len(PALETTE)


def label_image(labels: np.ndarray) -> Image.Image:
    """H x W class indices (< 256) -> mode "P" image with PALETTE; pixel value = class index."""
    if labels.max(initial=0) >= MAX_PNG_CLASSES:
        raise UserValueError(f"a palette PNG holds at most {MAX_PNG_CLASSES} classes; use --format coco-rle")
    img = Image.fromarray(labels.astype(np.uint8), "P")
    img.putpalette(PALETTE.tobytes())
    return img


def write_label_png(path: Path, values: np.ndarray) -> None:
    """Save H x W values 0..255 as a palette PNG (VOC colours), atomically: viewers see colours, readers values."""
    from ..runtime.atomic import atomic_path

    if values.min(initial=0) < 0:
        raise ValueError("label values must be in 0..255 to fit an 8-bit PNG")
    with atomic_path(path) as tmp:
        label_image(values).save(tmp, format="PNG")


def patch_labels(
    labels: torch.Tensor, patch: int, ignore: int = IGNORE_INDEX, void_majority_skips: bool = True
) -> torch.Tensor:
    """Majority ground-truth class of each patch: H x W labels -> (ceil(H/p) * ceil(W/p)) int64, row-major.

    The label map is padded with `ignore` to whole patches (as the pixels are zero-padded). Ties go to the
    smallest class index. With `void_majority_skips` (attention analysis) the ignore value is counted like a
    class and loses every tie, and a patch whose most frequent value is `ignore` gets -1 (skipped); without
    it (DnA training targets) ignored pixels are not counted and only a patch with no labelled pixel gets -1.
    """
    H, W = labels.shape
    h, w = -(-H // patch), -(-W // patch)
    padded = torch.full((h * patch, w * patch), ignore, dtype=torch.int64)
    padded[:H, :W] = torch.as_tensor(labels, dtype=torch.int64)
    blocks = padded.view(h, patch, w, patch).permute(0, 2, 1, 3).reshape(h * w, patch * patch)
    valid = blocks != ignore
    if not valid.any():
        return torch.full((h * w,), -1, dtype=torch.int64)
    n_values = int(blocks[valid].max()) + 2
    values = torch.where(valid, blocks, n_values - 1)  # ignore -> the last bin, so it loses ties
    counts = torch.zeros(h * w, n_values, dtype=torch.int64).scatter_add_(1, values, torch.ones_like(values))
    if void_majority_skips:
        top = counts.argmax(1)  # first maximum: the smallest value wins a tie
        return torch.where(top == n_values - 1, -1, top)
    labelled = counts[:, :-1]
    return torch.where(labelled.sum(1) > 0, labelled.argmax(1), -1)
