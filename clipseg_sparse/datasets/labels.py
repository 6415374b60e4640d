"""Reading and writing single-channel label PNGs (palette or grayscale), as mmseg stores segmentations;
the PASCAL VOC colour map they are written with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from .errors import DatasetError


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
        raise ValueError(f"a palette PNG holds at most {MAX_PNG_CLASSES} classes; use --format coco-rle")
    img = Image.fromarray(labels.astype(np.uint8), "P")
    img.putpalette(PALETTE.tobytes())
    return img


def write_label_png(path: Path, values: np.ndarray) -> None:
    """Save H x W values 0..255 as a palette PNG (VOC colours), atomically: viewers see colours, readers values."""
    from ..results import atomic_path

    if values.min(initial=0) < 0:
        raise ValueError("label values must be in 0..255 to fit an 8-bit PNG")
    with atomic_path(path) as tmp:
        label_image(values).save(tmp, format="PNG")
