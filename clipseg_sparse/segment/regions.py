"""Region masks for CorrCLIP: per-image integer maps read from files or made by SAM2 and cached.

A region map is an H x W integer array: one id >= 0 per region, -1 where no mask covers the pixel
("unsegmented"; CorrCLIP uses the map's minimum value for that). Sources:
- a folder of per-image files named like the image (`photos/sub/a.jpg` -> `MASKS/sub/a.png|.npy|.npz`,
  else `MASKS/a.*`, the flat layout of CorrCLIP's released masks): PNG (8- or 16-bit label image,
  0 = unsegmented, region r stored as r + 1), .npy (the map itself, negative = unsegmented) or .npz (key
  `regions`, else its only array; CorrCLIP's files, key `instance_mask`, mark unsegmented pixels with the
  map's minimum, read as -1);
- a registered mask generator (`REGION_SOURCES`, `--regions NAME`), cached as .npy per image: `sam2`,
  SAM2's automatic mask generator (`sam2` package, extra `.[proxy]`) with CorrCLIP's settings
  (points_per_side 8, pred_iou_thresh 0.4, stability_score_thresh 0.4); `sam3`, SAM 3's instance masks
  for the vocabulary's names (through transformers on any device, extra `.[sam3]`; `Sam3Regions`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import UserValueError
from ..models.backbones import BACKBONES
from ..registry import ENTRY_POINT_GROUP, Registry
from ..runtime.weights import WeightsUnavailableError, require_extra
from .images import IMAGE_SUFFIXES

REGION_SUFFIXES = (".png", ".npy", ".npz")
CORRCLIP_SAM2 = dict(points_per_side=8, pred_iou_thresh=0.4, stability_score_thresh=0.4)


class RegionError(UserValueError):
    """A region-mask file that cannot be used (unreadable, not a 2-D integer map, another size than its image)."""


def read_region_map(path: str | Path, header_only: bool = False) -> np.ndarray:
    """H x W int32 region ids (-1 = unsegmented) from a .png, .npy or .npz file; RegionError naming the
    file when it is not a 2-D integer map. header_only: check the kind and shape without reading the
    pixels (PNG header, memory-mapped .npy), for checking every file before any work; returns an
    untouched array of that shape."""
    path = Path(path)
    try:
        if path.suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                if header_only:
                    bands = len(image.getbands())
                    regions = np.empty((image.height, image.width, *((bands,) if bands > 1 else ())), np.int64)  # not touched
                else:
                    regions = np.asarray(image).astype(np.int64) - 1
        elif path.suffix == ".npy":
            regions = np.load(path, allow_pickle=False, mmap_mode="r" if header_only else None)
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                keys = list(z.keys())
                if "regions" not in keys and len(keys) != 1:
                    raise ValueError(f"has arrays {', '.join(keys)}; expected 'regions' or a single array")
                regions = z["regions" if "regions" in keys else keys[0]]
                if keys == ["instance_mask"]:  # CorrCLIP's released masks: the minimum is "unsegmented"
                    regions = np.where(regions == regions.min(), -1, regions)
        else:
            raise ValueError(f"unsupported suffix; use {', '.join(REGION_SUFFIXES)}")
    except (OSError, ValueError) as e:
        raise RegionError(f"{path}: cannot read region masks: {e}") from None
    if regions.ndim != 2 or not np.issubdtype(regions.dtype, np.integer):
        raise RegionError(f"{path}: region masks must be a 2-D integer map (got {regions.dtype} {regions.shape})")
    return regions if header_only else np.where(regions < 0, -1, regions).astype(np.int32)


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
            raise RegionError(f"{root}: region-mask folder not found")

    def source(self) -> str:
        return f"folder:{self.root}"

    def find(self, name: str) -> Path | None:
        """The region file of image `name` (a path relative to the images' folder, suffix optional)."""
        stem = Path(name).with_suffix("") if Path(name).suffix.lower() in IMAGE_SUFFIXES else Path(name)
        for base in dict.fromkeys((stem, Path(stem.name))):
            for suffix in REGION_SUFFIXES:
                path = self.root / f"{base}{suffix}"
                if path.is_file():
                    return path
        return None

    def check(self, names: Sequence[str]) -> None:
        """RegionError naming the first image without a region file, or the first file that is not a 2-D
        integer map (read by header: before any work starts; its size is checked against its image then)."""
        found = {n: self.find(n) for n in names}
        missing = [n for n, path in found.items() if path is None]
        if missing:
            raise RegionError(f"no region masks for {len(missing)} image(s) in {self.root}, e.g. {missing[0]} (expected {Path(missing[0]).stem}{'|'.join(REGION_SUFFIXES)})")
        for path in dict.fromkeys(found.values()):
            read_region_map(path, header_only=True)

    def __call__(self, image: np.ndarray, name: str) -> np.ndarray:
        path = self.find(name)
        if path is None:
            raise RegionError(f"no region masks for {name} in {self.root} (expected {Path(name).stem}{'|'.join(REGION_SUFFIXES)})")
        regions = read_region_map(path)
        if regions.shape != image.shape[:2]:
            raise RegionError(f"{path}: region masks are {regions.shape[1]}x{regions.shape[0]}, the image is {image.shape[1]}x{image.shape[0]}")
        return regions


class CachedRegions:
    """Region maps made by a mask generator, cached as one .npy per image in `cache_dir`, keyed by the
    image's pixels and `settings()` (what else changes the masks). Subclasses give `source()`, `masks()`."""

    def __init__(self, cache_dir: str | Path, checkpoint: str = "hub", device: str = "cpu") -> None:
        self.cache_dir = Path(cache_dir)
        self.checkpoint = checkpoint
        self.device = device

    def settings(self) -> str:
        """What besides the image changes the masks (part of the cache key; empty: the image alone)."""
        return ""

    def masks(self, image: np.ndarray) -> list[np.ndarray]:
        """The generator's binary H x W masks of an RGB uint8 image."""
        raise NotImplementedError

    def for_vocabulary(self, names: Sequence[str]) -> "CachedRegions":
        """The source a segmenter with these prompt names uses (prompted sources override it)."""
        return self

    def __call__(self, image: np.ndarray, name: str) -> np.ndarray:
        digest = hashlib.sha1(np.ascontiguousarray(image).tobytes())
        digest.update(self.settings().encode())
        path = self.cache_dir / f"{digest.hexdigest()[:16]}.npy"
        if path.is_file():
            return read_region_map(path)
        regions = masks_to_regions(self.masks(image), image.shape[:2])
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, regions)
        tmp.replace(path)
        return regions


class Sam2Regions(CachedRegions):
    """SAM2 automatic masks with CorrCLIP's settings, cached per image content in `cache_dir`."""

    _generator = None

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

    def masks(self, image: np.ndarray) -> list[np.ndarray]:
        if self._generator is None:
            self._generator = self._load()
        return [m["segmentation"] for m in self._generator.generate(image)]


class Sam3Regions(CachedRegions):
    """SAM 3's instance masks for the segmenter's own prompt names (`for_vocabulary`): each name is one
    text prompt; its instances scoring above `confidence` (sigmoid(logit) x presence, SegEarth-OV3's rule)
    give binary masks (probability > 0.5, the package's `masks`), painted larger first (`masks_to_regions`).
    No published method takes SAM 3's regions this way: the prompts are this project's choice. Cached per
    image, names, confidence and weights."""

    def __init__(self, cache_dir: str | Path, checkpoint: str = "hub", device: str = "cpu", prompts: Sequence[str] = (), confidence: float = 0.5, prompter=None) -> None:
        super().__init__(cache_dir, checkpoint, device)
        self.prompts = tuple(prompts)
        self.confidence = confidence
        self._prompter = prompter  # a loaded models.sam3 prompter (tests: a small random one)

    def source(self) -> str:
        return f"sam3:{BACKBONES.get('sam3').timm_name if self.checkpoint == 'hub' else self.checkpoint}:confidence={self.confidence:g}"

    def settings(self) -> str:
        return json.dumps([self.source(), self.prompts])

    def for_vocabulary(self, names: Sequence[str]) -> "Sam3Regions":
        return Sam3Regions(self.cache_dir, self.checkpoint, self.device, names, self.confidence, self._prompter)

    def masks(self, image: np.ndarray) -> list[np.ndarray]:
        if not self.prompts:
            raise UserValueError("sam3 regions are prompted with the vocabulary's names: none were given (a Segmenter passes its own)")
        if self._prompter is None:
            from ..models.sam3 import load_sam3

            self._prompter = load_sam3(self.checkpoint, self.device)
        state = self._prompter.set_image(image)
        answers = self._prompter.prompts(state, self.prompts, self.confidence)
        return [m.cpu().numpy() > 0.5 for a in answers for m in a.masks]


# name -> factory(cache_dir, device) -> region source, for `--regions NAME`; each checks its extra at once.
# Methods may register more (`locations`); a value that is not a name here is a folder.
REGION_SOURCES: Registry[Callable[[Path, str], CachedRegions]] = Registry("region source", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP)


def _sam2_source(cache_dir: Path, device: str) -> Sam2Regions:
    require_extra("sam2", "--regions sam2")
    return Sam2Regions(cache_dir / "regions", device=device)


def _sam3_source(cache_dir: Path, device: str) -> Sam3Regions:
    require_extra("transformers", "--regions sam3", extra="sam3")  # before any model loads
    return Sam3Regions(cache_dir / "regions-sam3", device=device)


REGION_SOURCES.register("sam2", _sam2_source, help="SAM2 automatic masks, CorrCLIP's settings (extra .[proxy])")
REGION_SOURCES.register("sam3", _sam3_source, help="SAM 3 instance masks prompted with the vocabulary's names (transformers, any device; extra .[sam3])")


def open_regions(value: str, device: str = "cpu", names: Sequence[str] = ()) -> "RegionFolder | CachedRegions":
    """The region source a `--regions` value names: a registered source (`REGION_SOURCES`: sam2, sam3; its
    extra checked now; masks cached under the package cache) or a folder, checked to hold a file for each
    image of `names`. UserValueError / MissingExtraError name the problem."""
    if value in REGION_SOURCES:
        from .vocabulary import default_cache_dir

        return REGION_SOURCES.get(value)(default_cache_dir(), device)
    source = RegionFolder(value)
    source.check(names)
    return source
