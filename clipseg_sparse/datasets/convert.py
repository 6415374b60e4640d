"""Building COCO-Object labels (`*_instanceTrainIds.png`): 0 background, 1..80 the COCO thing classes.

`coco_object_from_stuff` reproduces the conversion the SCLIP / NACLIP / GroupViT line uses
(`datasets/cvt_coco_object.py`): it reads the raw COCO-Stuff164k `stuffthingmaps` PNGs (value = COCO
category id - 1, 255 = unlabeled) and maps each thing id to its rank among the 80 used thing ids plus 1,
and every stuff id (>= 91) *and unlabeled 255* to 0. The output therefore has no ignore pixels.

`coco_object_from_instances` is for users without COCO-Stuff: it rasterises the COCO instances JSON with
pycocotools, largest instance first so smaller objects stay on top, crowd regions included. Its thing
pixels approximate the stuffthingmaps ones (which COCO-Stuff derived from the same polygons) but are not
byte-identical, so published numbers need the first route.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .classnames import COCO_UNUSED_IDS
from .errors import DOCS, DatasetError
from .labels import read_label_png, write_label_png

SUFFIX = "_instanceTrainIds.png"
_THING_IDS = [i for i in range(1, 91) if i not in COCO_UNUSED_IDS]  # the 80 COCO category ids


def stuff_to_object_lut() -> np.ndarray:
    """256-entry table: stuffthingmaps value (COCO id - 1, or 255) -> COCO-Object label."""
    lut = np.zeros(256, dtype=np.uint8)  # stuff, unused ids and 255 unlabeled -> background 0
    for rank, cat_id in enumerate(_THING_IDS, start=1):
        lut[cat_id - 1] = rank
    return lut


def coco_object_from_stuff(
    stuff_dir: Path, out_dir: Path, overwrite: bool = False, on_item: Callable[[], None] | None = None
) -> int:
    """Convert every raw stuffthingmaps PNG in `stuff_dir` into `out_dir/<stem>_instanceTrainIds.png`."""
    sources = sorted(p for p in Path(stuff_dir).glob("*.png") if "TrainIds" not in p.name)
    if not sources:
        raise DatasetError(f"no COCO-Stuff stuffthingmaps PNGs in {stuff_dir}; see {DOCS} (COCO-Object)")
    lut = stuff_to_object_lut()
    written = 0
    for src in sources:
        dst = Path(out_dir) / f"{src.stem}{SUFFIX}"
        if dst.exists() and not overwrite:
            continue
        raw = read_label_png(src)
        if raw.max(initial=0) > 255:
            raise DatasetError(f"{src}: values above 255; expected an 8-bit stuffthingmaps PNG")
        write_label_png(dst, lut[raw])
        written += 1
        if on_item:
            on_item()
    return written


def coco_object_from_instances(
    instances_json: Path, out_dir: Path, overwrite: bool = False, on_item: Callable[[], None] | None = None
) -> int:
    """Rasterise a COCO instances JSON into `out_dir/<image stem>_instanceTrainIds.png`."""
    from pycocotools.coco import COCO

    if not Path(instances_json).is_file():
        raise DatasetError(f"{instances_json}: COCO instances JSON not found; see {DOCS} (COCO-Object)")
    coco = COCO(str(instances_json))
    rank = {cat_id: r for r, cat_id in enumerate(_THING_IDS, start=1)}
    written = 0
    for img in coco.loadImgs(sorted(coco.getImgIds())):
        dst = Path(out_dir) / f"{Path(img['file_name']).stem}{SUFFIX}"
        if dst.exists() and not overwrite:
            continue
        anns: Iterable[dict] = coco.loadAnns(coco.getAnnIds(imgIds=img["id"], iscrowd=None))
        label = np.zeros((img["height"], img["width"]), dtype=np.uint8)
        for ann in sorted(anns, key=lambda a: -a["area"]):
            if ann["category_id"] in rank:
                label[coco.annToMask(ann) > 0] = rank[ann["category_id"]]
        write_label_png(dst, label)
        written += 1
        if on_item:
            on_item()
    return written
