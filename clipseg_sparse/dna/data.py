"""Training batches for `dna train`: segmentation samples with patch-grid labels, or ImageFolder images.

Every random choice (epoch order, crop, flip) comes from numpy generators seeded by (seed, epoch) and
(seed, step, slot), so the batches of step s are the same whether a run was interrupted or not, with any
number of DataLoader workers, and rank r of W ranks takes slots r, r + W, ... of each global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from ..datasets.errors import DatasetError
from ..datasets import IGNORE_INDEX, Benchmark
from ..datasets.labels import patch_labels
from ..segment.images import IMAGE_SUFFIXES, load_image


def patch_majority(labels: np.ndarray, patch: int) -> np.ndarray:
    """H x W labels (H, W multiples of `patch`) -> h x w: each patch's most frequent non-ignored label
    (ties: the lowest class index), IGNORE_INDEX where the patch has no labelled pixel."""
    grid = patch_labels(torch.from_numpy(labels), patch, IGNORE_INDEX, void_majority_skips=False)
    grid = torch.where(grid < 0, IGNORE_INDEX, grid)
    return grid.view(labels.shape[0] // patch, labels.shape[1] // patch).numpy()


def image_folder(root: str | Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(image, class index)]) of an ImageFolder: one sub-folder per class, sorted; a folder
    name's underscores become spaces in the class name (`golden_retriever` -> `golden retriever`)."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: image folder not found (expected one sub-folder of images per class)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    items = [
        (path, c)
        for c, name in enumerate(classes)
        for path in sorted((root / name).rglob("*"))
        if path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")
    ]
    if len(classes) < 2 or not items:
        raise DatasetError(f"{root}: an ImageFolder needs at least 2 class sub-folders holding images (found {len(classes)} folders, {len(items)} images)")
    return [c.replace("_", " ") for c in classes], items


def _resize_crop(image: Image.Image, size: int, rng: np.random.Generator | None, resample: int) -> tuple[Image.Image, tuple]:
    """Keep-ratio resize so the short side is `size`, then a random size x size crop and a coin-flip mirror
    (rng None: the centre crop, no mirror)."""
    w, h = image.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if rng is None:
        x0, y0, flip = (nw - size) // 2, (nh - size) // 2, False
    else:
        x0, y0 = int(rng.integers(0, nw - size + 1)), int(rng.integers(0, nh - size + 1))
        flip = bool(rng.integers(0, 2))
    return _apply(image, (nw, nh, x0, y0, flip), size, resample), (nw, nh, x0, y0, flip)


def _apply(image: Image.Image, params: tuple, size: int, resample: int) -> Image.Image:
    nw, nh, x0, y0, flip = params
    out = image.resize((nw, nh), resample).crop((x0, y0, x0 + size, y0 + size))
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out


class TrainingSet(torch.utils.data.Dataset):
    """Map-style dataset keyed by (item index, step, slot): returns (pixels 3 x S x S, target).

    target: h x w int64 patch labels (segmentation) or a 0-dim class index (ImageFolder).
    augment=False: the centre crop of every item, no mirror (for measuring, not training).
    """

    def __init__(
        self, items: Sequence, size: int, mean: Sequence[float], std: Sequence[float], seed: int,
        bench: Benchmark | None = None, patch: int = 16, augment: bool = True,
    ) -> None:
        self.items, self.size, self.seed, self.bench, self.patch = list(items), size, seed, bench, patch
        self.augment = augment
        self.mean = torch.tensor(mean).view(3, 1, 1) * 255
        self.std = torch.tensor(std).view(3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index, step, slot = key
        rng = np.random.default_rng([self.seed, step, slot]) if self.augment else None
        item = self.items[index]
        path = item.image if self.bench is not None else item[0]
        image, params = _resize_crop(Image.fromarray(load_image(path)), self.size, rng, Image.Resampling.BILINEAR)
        pixels = (torch.from_numpy(np.array(image)).permute(2, 0, 1).float() - self.mean) / self.std
        if self.bench is None:
            return pixels, torch.tensor(item[1])
        raw = self.bench.load_label(item.label)
        labels = np.asarray(_apply(Image.fromarray(raw.astype(np.uint8)), params, self.size, Image.Resampling.NEAREST)).astype(np.int64)
        return pixels, torch.from_numpy(patch_majority(labels, self.patch))


@dataclass
class StepBatches(torch.utils.data.Sampler):
    """Batches of keys (index, step, slot) for steps start..steps-1; this rank's share of each global batch."""

    num_items: int
    batch_size: int
    steps: int
    seed: int
    start: int = 0
    rank: int = 0
    world: int = 1

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        orders: dict[int, np.ndarray] = {}
        for step in range(self.start, self.steps):
            keys = []
            for slot in range(self.rank, self.batch_size, self.world):
                epoch, pos = divmod(step * self.batch_size + slot, self.num_items)
                if epoch not in orders:
                    orders = {epoch: np.random.default_rng([self.seed, 1_000_003, epoch]).permutation(self.num_items)}
                keys.append((int(orders[epoch][pos]), step, slot))
            yield keys

    def __len__(self) -> int:
        return max(self.steps - self.start, 0)
