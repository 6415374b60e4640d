"""Reading user images into RGB uint8 arrays, whatever their mode, bit depth or EXIF orientation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from ..errors import UserError, UserFileNotFoundError, UserValueError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")


class ImageReadError(UserError, ValueError):
    """An image file that cannot be decoded; the message names the file and the reason."""


def is_image_path(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def to_rgb(img: Image.Image, exif_transpose: bool = True) -> Image.Image:
    """EXIF-rotate (unless told not to), then convert L, LA, P, RGBA, CMYK, I;16 and I modes to 8-bit RGB."""
    if exif_transpose:
        img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        img = Image.fromarray(_stretch_to_uint8(np.asarray(img, dtype=np.float64)), "L")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    return img.convert("RGB")


def _stretch_to_uint8(arr: np.ndarray) -> np.ndarray:
    """Map [min, max] linearly onto 0..255: high-bit-depth data has no fixed white point."""
    lo, hi = float(arr.min()), float(arr.max())
    scale = 255.0 / (hi - lo) if hi > lo else 0.0
    return ((arr - lo) * scale).round().astype(np.uint8)


def _array_to_uint8(arr: np.ndarray) -> np.ndarray:
    """uint8 as is; floats in 0..1 scaled by 255; anything outside 0..255 (16-bit data) stretched like files."""
    if arr.dtype == np.uint8:
        return arr
    values = arr.astype(np.float64)
    if np.issubdtype(arr.dtype, np.floating) and values.min() >= 0.0 and values.max() <= 1.0:
        return (values * 255.0).round().astype(np.uint8)
    if values.min() < 0.0 or values.max() > 255.0:
        return _stretch_to_uint8(values)
    return values.round().astype(np.uint8)


def load_image(image: str | Path | Image.Image | np.ndarray, exif_transpose: bool = True) -> np.ndarray:
    """H x W x 3 uint8 RGB from a path, a PIL image or an array (H x W, H x W x 3/4; uint8, float 0..1,
    or 16-bit data, which is stretched from its min..max as 16-bit files are).

    exif_transpose=False keeps the stored pixel orientation, the frame that COCO-style boxes refer to.
    """
    if isinstance(image, (str, Path)):
        path = Path(image)
        try:
            with Image.open(path) as img:
                img.load()
                return np.asarray(to_rgb(img, exif_transpose))
        except FileNotFoundError as e:  # a missing file is the user's to fix; the message stays the OS's
            raise UserFileNotFoundError(e.errno, e.strerror, e.filename) from None
        except Exception as e:  # truncated, not an image, unsupported mode
            raise ImageReadError(f"{path}: cannot read image ({type(e).__name__}: {e})") from e
    if isinstance(image, Image.Image):
        return np.asarray(to_rgb(image, exif_transpose))
    arr = _array_to_uint8(np.asarray(image))
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=-1)
    if arr.ndim != 3 or arr.shape[-1] not in (3, 4):
        raise UserValueError(f"expected an H x W (x 3|4) image array, got shape {arr.shape}")
    return np.ascontiguousarray(arr[..., :3])
