"""Reading and writing single-channel label PNGs (palette or grayscale), as mmseg stores segmentations."""

from __future__ import annotations

from functools import lru_cache
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


@lru_cache(maxsize=1)
def voc_palette() -> list[int]:
    """The PASCAL VOC colour map (256 x RGB, flattened): index 0 black, 255 near-white void colour."""
    palette = []
    for i in range(256):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        palette += [r, g, b]
    return palette


def write_label_png(path: Path, values: np.ndarray) -> None:
    """Save H x W values 0..255 as a palette PNG (VOC colours), so both viewers and readers see labels."""
    if values.min(initial=0) < 0 or values.max(initial=0) > 255:
        raise ValueError("label values must be in 0..255 to fit an 8-bit PNG")
    img = Image.fromarray(values.astype(np.uint8), mode="P")
    img.putpalette(voc_palette())
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
