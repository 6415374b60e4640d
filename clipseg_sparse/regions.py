"""Region masks for CorrCLIP: per-image integer maps read from files or made by SAM2 and cached.

A region map is an H x W integer array: one id >= 0 per region, -1 where no mask covers the pixel
("unsegmented"; CorrCLIP uses the map's minimum value for that). Sources:
- a folder of per-image files named like the image (`photos/a.jpg` -> `MASKS/a.png|.npy|.npz`): PNG
  (8- or 16-bit label image, 0 = unsegmented, region r stored as r + 1), .npy (the map itself, negative =
  unsegmented) or .npz (key `regions`, else its only array);
- SAM2's automatic mask generator (`sam2` package, extra `.[proxy]`) with CorrCLIP's settings
  (points_per_side 8, pred_iou_thresh 0.4, stability_score_thresh 0.4), cached as .npy per image.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np

from .backbones import BACKBONES, require_extra
from .model import WeightsUnavailableError

REGION_SUFFIXES = (".png", ".npy", ".npz")
CORRCLIP_SAM2 = dict(points_per_side=8, pred_iou_thresh=0.4, stability_score_thresh=0.4)


def read_region_map(path: str | Path) -> np.ndarray:
    """H x W int32 region ids (-1 = unsegmented) from a .png, .npy or .npz file; ValueError naming the
    file when it is not a 2-D integer map."""
    path = Path(path)
    try:
        if path.suffix == ".png":
            from PIL import Image

            regions = np.asarray(Image.open(path)).astype(np.int64) - 1
        elif path.suffix == ".npy":
            regions = np.load(path, allow_pickle=False)
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                keys = list(z.keys())
                if "regions" not in keys and len(keys) != 1:
                    raise ValueError(f"has arrays {', '.join(keys)}; expected 'regions' or a single array")
                regions = z["regions" if "regions" in keys else keys[0]]
        else:
            raise ValueError(f"unsupported suffix; use {', '.join(REGION_SUFFIXES)}")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read region masks: {e}") from None
    if regions.ndim != 2 or not np.issubdtype(regions.dtype, np.integer):
        raise ValueError(f"{path}: region masks must be a 2-D integer map (got {regions.dtype} {regions.shape})")
    return np.where(regions < 0, -1, regions).astype(np.int32)


def masks_to_regions(masks: Sequence[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """Binary masks (each H x W) -> region map: larger masks painted first, so a smaller mask inside a
    larger one keeps its own id; pixels no mask covers are -1."""
    regions = np.full(shape, -1, dtype=np.int32)
    for i in sorted(range(len(masks)), key=lambda j: -int(np.count_nonzero(masks[j]))):
        regions[np.asarray(masks[i], dtype=bool)] = i
    return regions


class RegionFolder:
    """Region maps from a folder: image `sub/a.jpg` -> `root/sub/a.(png|npy|npz)`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"{root}: region-mask folder not found")

    def source(self) -> str:
        return f"folder:{self.root}"

    def __call__(self, image: np.ndarray, name: str) -> np.ndarray:
        stem = Path(name).with_suffix("")
        for suffix in REGION_SUFFIXES:
            path = self.root / stem.with_suffix(suffix)
            if path.is_file():
                regions = read_region_map(path)
                if regions.shape != image.shape[:2]:
                    raise ValueError(f"{path}: region masks are {regions.shape[1]}x{regions.shape[0]}, the image is {image.shape[1]}x{image.shape[0]}")
                return regions
        raise ValueError(f"no region masks for {name} in {self.root} (expected {stem}{'|'.join(REGION_SUFFIXES)})")


class Sam2Regions:
    """SAM2 automatic masks with CorrCLIP's settings, cached per image content in `cache_dir`."""

    def __init__(self, cache_dir: str | Path, checkpoint: str = "hub", device: str = "cpu") -> None:
        self.cache_dir = Path(cache_dir)
        self.checkpoint = checkpoint
        self.device = device
        self._generator = None

    def source(self) -> str:
        return f"sam2:{BACKBONES.get('sam2_hiera_l').timm_name if self.checkpoint == 'hub' else self.checkpoint}"

    def _load(self):
        require_extra("sam2", "SAM2 region masks")
        from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator

        model_id = BACKBONES.get("sam2_hiera_l").timm_name
        try:
            if self.checkpoint == "hub":
                return SAM2AutomaticMaskGenerator.from_pretrained(model_id, device=self.device, **CORRCLIP_SAM2)
            from sam2.build_sam import build_sam2

            model = build_sam2("configs/sam2.1/sam2.1_hiera_l.yaml", self.checkpoint, device=self.device)
            return SAM2AutomaticMaskGenerator(model, **CORRCLIP_SAM2)
        except Exception as e:
            raise WeightsUnavailableError(
                f"could not obtain SAM2 weights {self.checkpoint!r} ({model_id} from the Hugging Face Hub, then its cache "
                f"$HF_HOME; offline: a local checkpoint file, or HF_HUB_OFFLINE=1 to fail fast): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from e

    def __call__(self, image: np.ndarray, name: str) -> np.ndarray:
        key = hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()[:16]
        path = self.cache_dir / f"{key}.npy"
        if path.is_file():
            return read_region_map(path)
        if self._generator is None:
            self._generator = self._load()
        masks = [m["segmentation"] for m in self._generator.generate(image)]
        regions = masks_to_regions(masks, image.shape[:2])
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, regions)
        tmp.replace(path)
        return regions
