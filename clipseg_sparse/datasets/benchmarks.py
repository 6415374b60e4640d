"""The semantic-segmentation benchmarks, read from their usual mmseg layouts without mmseg.

Each benchmark is data: where its images and labels live under `--root`, the file suffixes, the split
file, and how label values decode (mmseg's `reduce_zero_label`: 0 -> 255 ignored, k -> k - 1; 255 stays
ignored). After decoding, labels are 0..C-1 with 255 = ignore, and class 0 is a scored background on
VOC21, Context60 and COCO-Object. docs/datasets.md describes each layout and how to obtain it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..registry import Registry
from .classnames import display_labels
from .errors import DOCS, DatasetError
from .labels import IGNORE_INDEX, read_label_png


@dataclass(frozen=True)
class Sample:
    """One validation image: its id (path relative to the image folder, no suffix) and its files."""

    id: str
    image: Path
    label: Path


@dataclass(frozen=True)
class SplitPart:
    """Where one part of a split lives: image and label folders and the id list (None = every image)."""

    img_dir: str
    ann_dir: str
    split: str | None


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's layout and label encoding (mmseg's dataset config, as data)."""

    name: str
    title: str
    layout: str  # folder under --root holding the dataset ("" = --root itself); --root may also be it
    img_dir: str
    ann_dir: str
    img_suffix: str
    seg_suffix: str
    split: str | None  # file listing image ids, relative to the layout folder; None = every image
    reduce_zero_label: bool
    background: bool  # class 0 is a scored background, so background thresholds apply
    num_images: int  # validation images of the full dataset
    # other splits (training): name -> parts read one after the other (mmseg's ConcatDataset for VOC aug)
    extra_splits: tuple[tuple[str, tuple[SplitPart, ...]], ...] = ()

    @property
    def classes(self) -> tuple[str, ...]:
        return display_labels(self.name)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def describe(self, help: str) -> dict[str, str]:
        """`ls datasets`: classes, label encoding, the layout under --root and what it is."""
        return {
            "classes": str(self.num_classes),
            "background": "class 0" if self.background else "-",
            "reduce_zero_label": "yes" if self.reduce_zero_label else "no",
            "val images": str(self.num_images),
            "layout under --root": "/".join(p for p in (self.layout, self.img_dir) if p) + f"/*{self.img_suffix}",
            "what": help,
        }

    def _error(self, message: str) -> DatasetError:
        return DatasetError(f"{self.name}: {message}; see {DOCS} ({self.title})")

    @property
    def split_names(self) -> tuple[str, ...]:
        """`val` (the benchmark split) and the training splits this reader knows."""
        return ("val", *(name for name, _ in self.extra_splits))

    def _parts(self, split: str) -> tuple[SplitPart, ...]:
        if split == "val":
            return (SplitPart(self.img_dir, self.ann_dir, self.split),)
        for name, parts in self.extra_splits:
            if name == split:
                return parts
        raise self._error(f"unknown split {split!r}; choose from {', '.join(self.split_names)}")

    def locate(self, root: str | Path, img_dir: str | None = None) -> Path:
        """The folder holding img_dir: `root/layout`, or `root` itself if it already is that folder."""
        root = Path(root)
        img_dir = img_dir or self.img_dir
        for base in (root / self.layout, root):
            if (base / img_dir).is_dir():
                return base
        raise self._error(f"image folder {root / self.layout / img_dir} not found")

    def samples(self, root: str | Path, split: str = "val") -> list[Sample]:
        """Every sample of `split` in mmseg's order (split-file order, else sorted image paths; parts in turn)."""
        samples = [s for part in self._parts(split) for s in self._part_samples(root, part)]
        for s in samples:
            for path, what in ((s.image, "image"), (s.label, "label")):
                if not path.is_file():
                    raise self._error(f"{what} {path} not found (one of {len(samples)} listed)")
        return samples

    @staticmethod
    def fingerprint(samples: Sequence[Sample]) -> str:
        """A cheap identity of the data behind `samples`: every id with its image's and label's size and
        modification time, hashed. A result records it, so one computed on other data is never reused."""
        digest = hashlib.sha256()
        for s in samples:
            for path in (s.image, s.label):
                try:
                    st = path.stat()
                    stamp = f"{st.st_size}:{st.st_mtime_ns}"
                except OSError:
                    stamp = "missing"
                digest.update(f"{s.id}\t{path.name}\t{stamp}\n".encode())
        return f"{len(samples)} samples@{digest.hexdigest()[:16]}"

    def _part_samples(self, root: str | Path, part: SplitPart) -> list[Sample]:
        base = self.locate(root, part.img_dir)
        img_dir, ann_dir = base / part.img_dir, base / part.ann_dir
        if not ann_dir.is_dir():
            raise self._error(f"label folder {ann_dir} not found")
        if part.split:
            split = base / part.split
            if not split.is_file():
                raise self._error(f"split file {split} not found")
            ids = [line.strip() for line in split.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            n = len(self.img_suffix)
            ids = sorted(p.relative_to(img_dir).as_posix()[:-n] for p in img_dir.rglob(f"*{self.img_suffix}"))
        if not ids:
            where = f"split file {base / self.split} lists no image ids" if self.split else f"no images ending in {self.img_suffix} in {img_dir}"
            raise self._error(where)
        return [Sample(i, img_dir / f"{i}{self.img_suffix}", ann_dir / f"{i}{self.seg_suffix}") for i in ids]

    def decode(self, raw: np.ndarray) -> np.ndarray:
        """Raw label values -> 0..C-1 and 255 (ignore), applying reduce_zero_label."""
        labels = raw.astype(np.int64)
        if self.reduce_zero_label:
            labels = np.where((labels == 0) | (labels == IGNORE_INDEX), IGNORE_INDEX, labels - 1)
        return labels

    def encode(self, labels: np.ndarray) -> np.ndarray:
        """Predicted labels 0..C-1 -> the values this dataset's label files use (inverse of decode)."""
        return labels + 1 if self.reduce_zero_label else labels

    def load_label(self, path: str | Path) -> np.ndarray:
        """H x W int64 decoded labels; values outside 0..C-1 and 255 mean a wrong encoding."""
        labels = self.decode(read_label_png(Path(path)))
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.num_classes))
        if bad.any():
            raise self._error(
                f"{path} holds label value(s) {sorted(set(np.unique(labels[bad]).tolist()))[:5]} outside "
                f"0..{self.num_classes - 1} and {IGNORE_INDEX} after decoding; wrong label files for this dataset?"
            )
        return labels


DATASETS: Registry[Benchmark] = Registry("dataset")


def _register(bench: Benchmark, help: str) -> None:
    DATASETS.register(bench.name, bench, help)


# Training splits as mmseg's configs read them: VOC `aug` is train.txt on SegmentationClass followed by
# aug.txt on SegmentationClassAug (tools/dataset_converters/voc_aug.py; 1464 + 9118 = 10582 images).
_VOC_TRAIN = SplitPart("JPEGImages", "SegmentationClass", "ImageSets/Segmentation/train.txt")
_VOC = dict(layout="VOCdevkit/VOC2012", img_dir="JPEGImages", ann_dir="SegmentationClass", img_suffix=".jpg",
            seg_suffix=".png", split="ImageSets/Segmentation/val.txt", num_images=1449,
            extra_splits=(("train", (_VOC_TRAIN,)),
                          ("aug", (_VOC_TRAIN, SplitPart("JPEGImages", "SegmentationClassAug", "ImageSets/Segmentation/aug.txt")))))
_CONTEXT = dict(layout="VOCdevkit/VOC2010", img_dir="JPEGImages", ann_dir="SegmentationClassContext", img_suffix=".jpg",
                seg_suffix=".png", split="ImageSets/SegmentationContext/val.txt", num_images=5105,
                extra_splits=(("train", (SplitPart("JPEGImages", "SegmentationClassContext", "ImageSets/SegmentationContext/train.txt"),)),))
_COCO = dict(layout="", img_dir="images/val2017", ann_dir="annotations/val2017", img_suffix=".jpg", split=None, num_images=5000,
             extra_splits=(("train", (SplitPart("images/train2017", "annotations/train2017", None),)),))

_register(Benchmark("voc21", "PASCAL VOC 2012", **_VOC, reduce_zero_label=False, background=True),
          "PASCAL VOC 2012 val, 20 classes + background")
_register(Benchmark("voc20", "PASCAL VOC 2012", **_VOC, reduce_zero_label=True, background=False),
          "PASCAL VOC 2012 val, 20 classes, background ignored")
_register(Benchmark("context60", "PASCAL Context", **_CONTEXT, reduce_zero_label=False, background=True),
          "PASCAL Context val, 59 classes + background")
_register(Benchmark("context59", "PASCAL Context", **_CONTEXT, reduce_zero_label=True, background=False),
          "PASCAL Context val, 59 classes, background ignored")
_register(Benchmark("ade20k", "ADE20K", layout="ADEChallengeData2016", img_dir="images/validation",
                    ann_dir="annotations/validation", img_suffix=".jpg", seg_suffix=".png", split=None,
                    reduce_zero_label=True, background=False, num_images=2000,
                    extra_splits=(("train", (SplitPart("images/training", "annotations/training", None),)),)),
          "ADE20K (SceneParsing) val, 150 classes")
_register(Benchmark("coco-stuff", "COCO-Stuff", **_COCO, seg_suffix="_labelTrainIds.png", reduce_zero_label=False,
                    background=False),
          "COCO-Stuff164k val2017, 171 classes")
_register(Benchmark("coco-object", "COCO-Object", **_COCO, seg_suffix="_instanceTrainIds.png", reduce_zero_label=False,
                    background=True),
          "COCO val2017, 80 thing classes + background (converted from COCO-Stuff)")
_register(Benchmark("cityscapes", "Cityscapes", layout="", img_dir="leftImg8bit/val", ann_dir="gtFine/val",
                    img_suffix="_leftImg8bit.png", seg_suffix="_gtFine_labelTrainIds.png", split=None,
                    reduce_zero_label=False, background=False, num_images=500,
                    extra_splits=(("train", (SplitPart("leftImg8bit/train", "gtFine/train", None),)),)),
          "Cityscapes val, 19 classes")
