"""Files written for one segmented image: label map, overlay, JSON record, optional probabilities / RLE.

For an output base `OUT/a/b/c` (see discovery.py) one image gives
- `c.png`         palette PNG label map: pixel value = class index into `class_names` of the JSON,
                  colours from the PASCAL VOC colour map (PALETTE); with `--format coco-rle` instead
- `c.rle.json`    COCO RLE masks (pycocotools), one annotation per class present, for this image only;
- `c.overlay.png` the image blended with the label colours, and a legend of the classes present;
- `c.json`        the record: input path, image size, all class names, classes present with pixel
                  fractions, every setting of the segmenter, and the names of the files above;
- `c.probs.npz`   with `--save-probs`: `probs` (C x H x W float16) and `class_names`.

Every file is written to a temporary name and renamed, so an interrupted run leaves no torn file. The
JSON record is written *first*: it claims the other files for this tool and these settings, so a re-run
knows that a missing file is an interrupted write to finish, while a file with no record is not ours
and is never replaced without `--overwrite`.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from enum import Enum
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..errors import UserError, UserValueError
from ..datasets.labels import MAX_PNG_CLASSES, PALETTE, voc_palette, write_label_png
from ..segment.labels import SegmentationResult
from ..registry import Registry
from ..runtime.atomic import atomic_path, create_json_exclusive, write_json_atomic
from .results import config_hash, differences


def class_colours(num_classes: int) -> np.ndarray:
    """num_classes x 3 uint8 colours: the VOC colour map, whose bit spreading stays distinct far past 256
    (it is the PNG palette for the first 256 classes; `--format coco-rle` vocabularies can be larger)."""
    return PALETTE if num_classes <= len(PALETTE) else voc_palette(num_classes)


def blend(rgb: np.ndarray, labels: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """H x W x 3 uint8: (1 - alpha) * image + alpha * colour of each pixel's class, rounded."""
    colours = class_colours(int(labels.max(initial=0)) + 1)[labels].astype(np.float32)
    return np.round((1 - alpha) * rgb.astype(np.float32) + alpha * colours).astype(np.uint8)


def _percent(fraction: float) -> str:
    """A present class never reads 0.0%."""
    return f"{100 * fraction:.1f}%" if fraction >= 0.0005 else "<0.1%"


@lru_cache(maxsize=8)
def legend_font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans at `size` px, found in matplotlib's data without importing it (matplotlib is a dependency):
    it covers accented Latin, Greek and Cyrillic, which PIL's default font draws as empty boxes."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
        if path.is_file():
            return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size=size)


def overlay_image(rgb: np.ndarray, labels: np.ndarray, present: dict[str, float], class_names: tuple[str, ...]) -> Image.Image:
    """The blended image with a white legend panel on its right: one swatch + name + percentage per class present.

    The left W x H of the result is exactly `blend(rgb, labels)`; the panel's font scales with the image height.
    """
    height, width = labels.shape
    size = max(12, height // 30)
    font = legend_font(size)
    rows = [(class_names.index(name), f"{name}  {_percent(frac)}") for name, frac in present.items()]
    colours = class_colours(len(class_names))
    pad, line = size // 2, int(size * 1.5)
    text_width = max((int(font.getlength(text)) for _, text in rows), default=0)
    panel_width = 3 * pad + size + text_width
    canvas = Image.new("RGB", (width + panel_width, max(height, pad + line * len(rows))), "white")
    canvas.paste(Image.fromarray(blend(rgb, labels)), (0, 0))
    draw = ImageDraw.Draw(canvas)
    for row, (index, text) in enumerate(rows):
        y = pad + row * line
        draw.rectangle((width + pad, y, width + pad + size, y + size), fill=tuple(int(v) for v in colours[index]), outline="black")
        draw.text((width + 2 * pad + size, y), text, fill="black", font=font)
    return canvas


def coco_rle(labels: np.ndarray, class_names: tuple[str, ...]) -> dict:
    """COCO-style dict for one image: categories (id = class index) and one RLE annotation per class present."""
    from pycocotools import mask as mask_utils

    height, width = labels.shape
    annotations = []
    for index in np.unique(labels):
        rle = mask_utils.encode(np.asfortranarray(labels == index, dtype=np.uint8))
        annotations.append(
            {
                "category_id": int(index),
                "segmentation": {"size": [height, width], "counts": rle["counts"].decode("ascii")},
                "area": int(mask_utils.area(rle)),
                "bbox": [float(v) for v in mask_utils.toBbox(rle)],
            }
        )
    categories = [{"id": i, "name": name} for i, name in enumerate(class_names)]
    return {"height": height, "width": width, "categories": categories, "annotations": annotations}


def _write_png(path: Path, result: SegmentationResult) -> None:
    write_label_png(path, result.labels)


def _write_rle(path: Path, result: SegmentationResult) -> None:
    write_json_atomic(path, coco_rle(result.labels, result.class_names))


@dataclass(frozen=True)
class MaskFormat:
    suffix: str
    write: Callable[[Path, SegmentationResult], None]


MASK_FORMATS: Registry[MaskFormat] = Registry("mask format", describe=lambda fmt: {"suffix": fmt.suffix})
MASK_FORMATS.register("png", MaskFormat(".png", _write_png), "palette PNG, pixel value = class index")
MASK_FORMATS.register("coco-rle", MaskFormat(".rle.json", _write_rle), "COCO RLE masks (pycocotools), one JSON per image")


def prediction_key(settings: dict) -> str:
    """Hash of the settings that change a prediction (the batch size only changes speed)."""
    return config_hash({k: v for k, v in settings.items() if k != "batch_size"})


class ClaimConflictError(UserError, RuntimeError):
    """Another run (another process) claimed an image's outputs with other settings after this run planned."""


def _other_settings(record_path: Path, settings: dict) -> str | None:
    """None when the record at `record_path` was made by this tool with these prediction settings, else
    what differs (the keys, and a word when the weights or the data changed)."""
    try:
        made = json.loads(record_path.read_text(encoding="utf-8"))["settings"]
        if prediction_key(made) == prediction_key(settings):
            return None
        return f"other settings{differences(made, settings)}"
    except (OSError, ValueError, KeyError, TypeError):
        return "other settings or by something else"


class Status(str, Enum):
    todo = "todo"  # nothing written yet
    resume = "resume"  # our record with these settings, but some requested file is missing
    done = "done"  # our record with these settings and every requested file
    conflict = "conflict"  # someone else's file, or our record with other settings


@dataclass(frozen=True)
class OutputOptions:
    """What to write per image. `overwrite` replaces existing files instead of refusing them."""

    mask_format: str = "png"
    save_probs: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        MASK_FORMATS.get(self.mask_format)  # raises UnknownNameError with the choices

    def check_classes(self, num_classes: int) -> None:
        """Refuse, before any work, a vocabulary that the mask format cannot hold."""
        if self.mask_format == "png" and num_classes > MAX_PNG_CLASSES:
            raise UserValueError(f"{num_classes} classes do not fit a palette PNG (at most {MAX_PNG_CLASSES}); use --format coco-rle")

    def files(self, base: Path) -> dict[str, Path]:
        """kind -> path of every file this run writes for the output base (the record "json" included)."""
        files = {
            "json": base.with_name(base.name + ".json"),
            "labels": base.with_name(base.name + MASK_FORMATS.get(self.mask_format).suffix),
            "overlay": base.with_name(base.name + ".overlay.png"),
        }
        if self.save_probs:
            files["probs"] = base.with_name(base.name + ".probs.npz")
        return files

    def status(self, base: Path, settings: dict) -> tuple[Status, str]:
        """Whether the image at `base` still needs work, and why not (for conflicts)."""
        files = self.files(base)
        record_path = files.pop("json")
        if not record_path.exists():
            existing = [p for p in files.values() if p.exists()]
            if existing and not self.overwrite:
                return Status.conflict, f"{existing[0]} exists and has no record from this tool"
            return Status.todo, ""
        if self.overwrite:
            return Status.todo, ""
        other = _other_settings(record_path, settings)
        if other:
            return Status.conflict, f"{record_path} was made with {other}"
        missing = [p for p in files.values() if not p.exists()]
        return (Status.resume, "") if missing else (Status.done, "")


def read_record(base: Path) -> dict:
    return json.loads(base.with_name(base.name + ".json").read_text(encoding="utf-8"))


def write_outputs(base: Path, source: Path, rgb: np.ndarray, result: SegmentationResult, options: OutputOptions) -> dict:
    """Write every output of one image (record first; existing files are kept unless overwrite). Returns the record.

    Without `overwrite` a new record is created exclusively: if another process claimed the image since
    the run was planned, its record is kept and ClaimConflictError is raised when its settings differ
    (with the same settings both runs write the same files, so this one goes on).
    """
    files = options.files(base)
    record_path = files.pop("json")
    present = result.present()
    listed: dict[str, str] = {}
    resuming = record_path.exists() and not options.overwrite
    if resuming:  # keep the files an earlier run listed
        listed = {k: v for k, v in read_record(base).get("files", {}).items() if (base.parent / v).exists()}
    height, width = result.labels.shape
    record = {
        "input": str(source),
        "image_size": {"width": width, "height": height},
        "class_names": list(result.class_names),
        "classes_present": [
            {"index": result.class_names.index(name), "name": name, "fraction": frac} for name, frac in present.items()
        ],
        "settings": result.settings,
        "palette": "PASCAL VOC colour map (clipseg_sparse.files.outputs.PALETTE)",
        "files": {**listed, **{kind: path.name for kind, path in files.items()}},
    }
    if options.overwrite:
        write_json_atomic(record_path, record)
    elif resuming or not create_json_exclusive(record_path, record):
        if _other_settings(record_path, result.settings):
            raise ClaimConflictError(f"{record_path} was written meanwhile by another run with other settings")
        write_json_atomic(record_path, record)
    for kind, path in files.items():
        if path.exists() and not options.overwrite:
            continue
        if kind == "labels":
            MASK_FORMATS.get(options.mask_format).write(path, result)
        elif kind == "overlay":
            with atomic_path(path) as tmp:
                overlay_image(rgb, result.labels, present, result.class_names).save(tmp, format="PNG")
        elif kind == "probs":
            write_probs_npz(path, result)
    return record


def write_probs_npz(path: Path, result: SegmentationResult, chunk: int = 1 << 24) -> None:
    """`probs` (C x H x W float16) and `class_names` in an npz file as `np.savez_compressed` writes them
    (`np.load` reads both back), without ever holding C x H x W values in memory.

    The probabilities come a band of rows at a time, but in C order each class's rows of a band lie
    apart; so the bands go to an uncompressed scratch file beside `path` (C x H x W x 2 bytes of disk
    while it runs), which is then deflated into the zip member `chunk` bytes at a time.
    """
    classes, (height, width) = len(result.class_names), result.labels.shape
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float16)), "fortran_order": False, "shape": (classes, height, width)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path.parent, prefix=f".{path.name}.scratch") as scratch:
        for y0, _, band in result.prob_bands():
            band = band.astype(np.float16)
            for c in range(classes):
                scratch.seek((c * height + y0) * width * 2)
                scratch.write(band[c].tobytes())
        scratch.seek(0)
        with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as npz:
            with npz.open("probs.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                shutil.copyfileobj(scratch, member, chunk)
            with npz.open("class_names.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.array(result.class_names), allow_pickle=False)
