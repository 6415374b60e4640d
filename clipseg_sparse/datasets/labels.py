"""Reading and writing single-channel label PNGs (palette or grayscale), as mmseg stores segmentations."""

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


def write_label_png(path: Path, values: np.ndarray) -> None:
    """Save H x W values 0..255 as a palette PNG (VOC colours), atomically: viewers see colours, readers values."""
    from ..outputs import label_image  # lazy: outputs imports torch
    from ..results import atomic_path

    if values.min(initial=0) < 0:
        raise ValueError("label values must be in 0..255 to fit an 8-bit PNG")
    with atomic_path(path) as tmp:
        label_image(values).save(tmp, format="PNG")
