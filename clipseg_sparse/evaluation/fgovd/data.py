"""Reading the FG-OVD benchmark files (Bianchi et al., "The devil is in the fine-grained details", CVPR 2024).

Each file is a COCO/LVIS-style JSON over COCO 2017 images. Every annotation is one object region with a
positive caption (`category_id`, the category's `name` is the caption) and its own ordered hard
negatives (`annotation["neg_category_ids"]`; the image-level list of the same name is a different,
unordered union and is not used). `file_name` already holds the COCO folder (`val2017/...` or
`train2017/...`), so images are found at `COCO_ROOT / file_name`.

The split comes from the file name (`1_attributes.json` is Hard, ...): the registry `SPLITS` maps the
official file stems to split names.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NoReturn

from ...errors import UserFileNotFoundError, UserValueError
from ...registry import Registry

SPLITS: Registry[str] = Registry("FG-OVD benchmark file")
for _stem, _name, _help in (
    ("1_attributes", "hard", "Hard: each negative changes one attribute of the positive caption"),
    ("2_attributes", "medium", "Medium: each negative changes two attributes"),
    ("3_attributes", "easy", "Easy: each negative changes three attributes"),
    ("shuffle_negatives", "trivial", "Trivial: negatives are captions of other objects"),
    ("color", "color", "attribute benchmark: negatives change the colour"),
    ("material", "material", "attribute benchmark: negatives change the material"),
    ("pattern", "pattern", "attribute benchmark: negatives change the pattern"),
    ("transparency", "transparency", "attribute benchmark: negatives change the transparency"),
):
    SPLITS.register(_stem, _name, help=_help)

#: the splits averaged into the `mean.*` metrics, as in the FG-OVD paper's difficulty summary
DIFFICULTY_SPLITS = ("hard", "medium", "easy")


class BenchmarkFormatError(UserValueError):
    """A benchmark file that is not valid FG-OVD JSON; the message names the first bad entry and field."""


class MissingImageError(UserFileNotFoundError):
    """A COCO image named by a benchmark file is not under the given images root."""


@dataclass(frozen=True)
class RegionAnnotation:
    """One benchmark region with its captions.

    box: x, y, w, h in pixels of the stored image (COCO convention, float).
    category_ids / captions: the positive first, then the hard negatives in the file's order.
    height, width: the image size the file declares; segmentation: the COCO polygon list or RLE, or None.
    """

    id: int
    split: str
    image_id: int
    file_name: str
    height: int
    width: int
    box: tuple[float, float, float, float]
    category_ids: tuple[int, ...]
    captions: tuple[str, ...]
    segmentation: Any = None

    @property
    def num_negatives(self) -> int:
        return len(self.captions) - 1


@dataclass
class BenchmarkFile:
    """One FG-OVD file: its split name and its annotations grouped by image, in the file's image order."""

    split: str
    path: Path
    annotations: list[RegionAnnotation]

    def images(self) -> list[str]:
        """file_name of every image that has annotations, in the order of the file's `images` list."""
        return list(dict.fromkeys(a.file_name for a in self.annotations))


Benchmark = BenchmarkFile  # old name, one release


def split_name(path: str | Path) -> str:
    """The split of a benchmark file from its name (`1_attributes.json` -> `hard`)."""
    return SPLITS.get(Path(path).stem)


def _fail(path: Path, what: str, entry: Any, index: int, field: str, problem: str) -> NoReturn:
    ident = entry.get("id") if isinstance(entry, dict) else None
    raise BenchmarkFormatError(f"{path}: {what} #{index} (id {ident}): field {field!r} {problem}")


def _is_number(x: Any) -> bool:
    """A finite JSON number (json reads NaN and Infinity, which would enter the metrics silently)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _validate(data: Any, path: Path) -> None:
    """Raise BenchmarkFormatError on the first entry that the reader cannot use."""
    if not isinstance(data, dict):
        raise BenchmarkFormatError(f"{path}: top level is {type(data).__name__}, expected a JSON object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise BenchmarkFormatError(f"{path}: top-level field {key!r} is missing or not a list")
    sizes, category_ids = {}, set()
    for i, img in enumerate(data["images"]):
        if not isinstance(img, dict) or "id" not in img:
            _fail(path, "image", img, i, "id", "is missing")
        if not isinstance(img.get("file_name"), str) or not img["file_name"]:
            _fail(path, "image", img, i, "file_name", "is missing or not a non-empty string")
        for field in ("width", "height"):
            if not isinstance(img.get(field), int) or img[field] <= 0:
                _fail(path, "image", img, i, field, f"must be a positive integer (got {img.get(field)!r})")
        sizes[img["id"]] = (img["width"], img["height"])
    for i, cat in enumerate(data["categories"]):
        if not isinstance(cat, dict) or "id" not in cat:
            _fail(path, "category", cat, i, "id", "is missing")
        if not isinstance(cat.get("name"), str) or not cat["name"].strip():
            _fail(path, "category", cat, i, "name", "(the caption) is missing or empty")
        category_ids.add(cat["id"])
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or "id" not in ann:
            _fail(path, "annotation", ann, i, "id", "is missing")
        if ann.get("image_id") not in sizes:
            _fail(path, "annotation", ann, i, "image_id", f"{ann.get('image_id')!r} is not an image of the file")
        if ann.get("category_id") not in category_ids:
            _fail(path, "annotation", ann, i, "category_id", f"{ann.get('category_id')!r} is not a category of the file")
        negs = ann.get("neg_category_ids")
        if not isinstance(negs, list):
            _fail(path, "annotation", ann, i, "neg_category_ids", "is missing or not a list")
        bad = [c for c in negs if c not in category_ids]
        if bad:
            _fail(path, "annotation", ann, i, "neg_category_ids", f"names unknown categories {bad[:3]}")
        box = ann.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) for v in box)):
            _fail(path, "annotation", ann, i, "bbox", f"must be 4 finite numbers [x, y, w, h] (got {box!r})")
        if box[2] <= 0 or box[3] <= 0:
            _fail(path, "annotation", ann, i, "bbox", f"has a non-positive width or height ({box!r})")
        width, height = sizes[ann["image_id"]]
        if box[0] >= width or box[1] >= height or box[0] + box[2] <= 0 or box[1] + box[3] <= 0:
            _fail(path, "annotation", ann, i, "bbox", f"{box!r} lies outside the {width}x{height} image")


def _coco_index(data: dict):
    """A pycocotools COCO index over an already-loaded dict (its progress prints kept off stdout)."""
    from pycocotools.coco import COCO

    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def read_benchmark(path: str | Path, split: str | None = None) -> BenchmarkFile:
    """Read one FG-OVD file. split: the split name; None = from the file name (see `SPLITS`).

    Raises BenchmarkFormatError naming the first offending entry (its index, id and field).
    """
    path = Path(path)
    if not path.is_file():
        raise UserFileNotFoundError(f"{path}: benchmark file not found")
    split = split or split_name(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchmarkFormatError(f"{path}: not valid JSON ({e})") from e
    _validate(data, path)
    coco = _coco_index(data)
    annotations = []
    for image in data["images"]:
        for ann in coco.imgToAnns.get(image["id"], []):
            ids = (ann["category_id"], *ann["neg_category_ids"])
            annotations.append(
                RegionAnnotation(
                    id=ann["id"],
                    split=split,
                    image_id=image["id"],
                    file_name=image["file_name"],
                    height=image["height"],
                    width=image["width"],
                    box=tuple(float(v) for v in ann["bbox"]),
                    category_ids=ids,
                    captions=tuple(coco.cats[c]["name"] for c in ids),
                    segmentation=ann.get("segmentation") or None,
                )
            )
    return BenchmarkFile(split=split, path=path, annotations=annotations)


def negative_counts(path: str | Path) -> list[int]:
    """How many hard negatives each annotation of a benchmark file has (raw JSON, no validation: a
    malformed file gives [] here and fails with its own message when read)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return [len(a["neg_category_ids"]) for a in data["annotations"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def check_images(annotations: Iterable[RegionAnnotation], images_root: str | Path) -> None:
    """Raise MissingImageError for the first annotation whose image is not at images_root / file_name."""
    root = Path(images_root)
    if not root.is_dir():
        raise MissingImageError(f"{root}: images root is not a directory (expected the COCO 2017 root holding val2017/ and train2017/)")
    seen: set[str] = set()
    for ann in annotations:
        if ann.file_name in seen:
            continue
        seen.add(ann.file_name)
        if not (root / ann.file_name).is_file():
            hint = ""
            if (root / Path(ann.file_name).name).is_file():
                hint = f"; {root} looks like an image folder itself: pass its parent, the COCO 2017 root"
            raise MissingImageError(
                f"{root / ann.file_name}: image not found ({ann.split} annotation id {ann.id}, image id {ann.image_id}, "
                f"field 'file_name' = {ann.file_name!r}){hint}"
            )


def check_segmentations(annotations: Iterable[RegionAnnotation]) -> None:
    """Region `mask` needs a polygon or RLE on every annotation; say which one has none."""
    for ann in annotations:
        where = f"{ann.split} annotation id {ann.id} (image id {ann.image_id}): field 'segmentation'"
        if ann.segmentation is None:
            raise BenchmarkFormatError(
                f"{where} is missing or empty, so --region mask cannot be used; use --region pool (the box) instead"
            )
        if not _is_segmentation(ann.segmentation):
            raise BenchmarkFormatError(
                f"{where} must be a list of polygons [[x1, y1, x2, y2, ...], ...] or an RLE object with 'counts' and "
                f"'size' (got {type(ann.segmentation).__name__} {str(ann.segmentation)[:40]!r})"
            )


def _is_segmentation(seg: Any) -> bool:
    """A COCO polygon list (each an even number >= 6 of finite numbers) or an RLE dict with counts and size."""
    if isinstance(seg, list):
        return all(isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0 and all(map(_is_number, p)) for p in seg)
    if isinstance(seg, dict):
        size = seg.get("size")
        counts_ok = isinstance(seg.get("counts"), str) or (isinstance(seg.get("counts"), list) and all(isinstance(c, int) for c in seg["counts"]))
        return counts_ok and isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) for v in size)
    return False
