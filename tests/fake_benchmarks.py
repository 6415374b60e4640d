"""Tiny benchmarks written in each dataset's exact on-disk layout (file names, folders, PNG modes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# name -> (image path, label path, label PNG mode, largest raw class value) for image id `i`
LAYOUTS = {
    "voc": ("VOCdevkit/VOC2012/JPEGImages/2007_{i:06d}.jpg", "VOCdevkit/VOC2012/SegmentationClass/2007_{i:06d}.png", "P", 20),
    "context": ("VOCdevkit/VOC2010/JPEGImages/2008_{i:06d}.jpg", "VOCdevkit/VOC2010/SegmentationClassContext/2008_{i:06d}.png", "P", 59),
    "ade20k": ("ADEChallengeData2016/images/validation/ADE_val_{i:08d}.jpg", "ADEChallengeData2016/annotations/validation/ADE_val_{i:08d}.png", "L", 150),
    "ade20k-train": ("ADEChallengeData2016/images/training/ADE_train_{i:08d}.jpg", "ADEChallengeData2016/annotations/training/ADE_train_{i:08d}.png", "L", 150),
    "coco-stuff": ("images/val2017/{i:012d}.jpg", "annotations/val2017/{i:012d}_labelTrainIds.png", "L", 170),
    "coco-object": ("images/val2017/{i:012d}.jpg", "annotations/val2017/{i:012d}_instanceTrainIds.png", "L", 80),
    "cityscapes": ("leftImg8bit/val/lindau/lindau_{i:06d}_000019_leftImg8bit.png", "gtFine/val/lindau/lindau_{i:06d}_000019_gtFine_labelTrainIds.png", "L", 18),
}
SPLITS = {"voc": "VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt", "context": "VOCdevkit/VOC2010/ImageSets/SegmentationContext/val.txt"}
LAYOUT_OF = {"voc21": "voc", "voc20": "voc", "context60": "context", "context59": "context"}


def write_png(path: Path, values: np.ndarray, mode: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(values.astype(np.uint8), mode=mode)
    if mode == "P":
        img.putpalette([v for i in range(256) for v in (i, 255 - i, (7 * i) % 256)])
    img.save(path)


def make_benchmark(dataset: str, root: Path, n: int = 3, size: tuple[int, int] = (36, 52), seed: int = 0) -> list[np.ndarray]:
    """Write `n` images with random blocky labels; columns 0-1 are 255, pixel (0, 2) is 0 and the last pixel the top value."""
    layout = LAYOUT_OF.get(dataset, dataset)
    img_t, lab_t, mode, top = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    raws = []
    for i in range(n):
        raw = np.kron(rng.integers(0, top + 1, size=(size[0] // 4, size[1] // 4)), np.ones((4, 4), dtype=np.int64))
        raw[:, :2] = 255
        raw[0, 2], raw[-1, -1] = 0, top
        rgb = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
        img_path = root / img_t.format(i=i)
        img_path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb).save(img_path, quality=95)
        write_png(root / lab_t.format(i=i), raw, mode)
        raws.append(raw)
    if layout in SPLITS:
        split = root / SPLITS[layout]
        split.parent.mkdir(parents=True, exist_ok=True)
        split.write_text("".join(f"{Path(img_t.format(i=i)).stem}\n" for i in range(n)))
    return raws


def make_benchmark_with_masks(dataset: str, root: Path, n: int, size: tuple[int, int], seed: int = 6) -> tuple[Path, Path]:
    """`make_benchmark` under root / "voc" plus one blocky region map per sample id (8 x 8 px blocks of ids
    -1..3, -1 unsegmented) saved as root / "masks" / ID.npy, the layout `--regions FOLDER` reads.
    Returns (benchmark root, masks folder)."""
    from clipseg_sparse.datasets import DATASETS

    make_benchmark(dataset, root / "voc", n=n, size=size)
    masks = root / "masks"
    masks.mkdir()
    rng = np.random.default_rng(seed)
    for s in DATASETS.get(dataset).samples(root / "voc"):
        cells = rng.integers(-1, 4, (size[0] // 8, size[1] // 8))
        np.save(masks / f"{s.id}.npy", np.kron(cells, np.ones((8, 8), dtype=np.int64)).astype(np.int32))
    return root / "voc", masks
