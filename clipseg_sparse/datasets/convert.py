"""Building COCO-Stuff and COCO-Object label files from the raw COCO-Stuff164k `stuffthingmaps` PNGs.

The raw maps store COCO category id - 1 (things 0..89, stuff 91..181) and 255 = unlabeled; 11 ids are
never used. Both conversions are a lookup table over those values:

- COCO-Stuff (`*_labelTrainIds.png`), as mmseg's `tools/dataset_converters/coco_stuff164k.py`: the 171
  used ids -> their rank 0..170; 255 stays 255 (ignored).
- COCO-Object (`*_instanceTrainIds.png`), as SCLIP / NACLIP / GroupViT's `datasets/cvt_coco_object.py`:
  the 80 thing ids -> their rank + 1 (1..80); every stuff id *and unlabeled 255* -> 0 (background), so
  COCO-Object labels have no ignored pixels.

`coco_object_from_instances` is for users without COCO-Stuff: it rasterises the COCO instances JSON with
pycocotools, largest instance first so smaller objects stay on top, crowd regions included. Its thing
pixels approximate the stuffthingmaps ones (which COCO-Stuff derived from the same polygons) but are not
byte-identical, so published numbers need the stuffthingmaps route.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .classnames import COCO_UNUSED_IDS
from .errors import DOCS, DatasetError
from .labels import read_label_png, write_label_png

STUFF_SUFFIX = "_labelTrainIds.png"
OBJECT_SUFFIX = "_instanceTrainIds.png"
_USED_IDS = [i for i in range(1, 183) if i not in COCO_UNUSED_IDS]  # the 171 COCO-Stuff category ids
_THING_IDS = [i for i in _USED_IDS if i <= 90]  # the 80 COCO thing ids


def stuff_lut() -> np.ndarray:
    """256-entry table: stuffthingmaps value -> COCO-Stuff trainId (0..170, 255 unlabeled or unused)."""
    lut = np.full(256, 255, dtype=np.uint8)
    for train_id, cat_id in enumerate(_USED_IDS):
        lut[cat_id - 1] = train_id
    return lut


def object_lut() -> np.ndarray:
    """256-entry table: stuffthingmaps value -> COCO-Object label (1..80 things, 0 everything else)."""
    lut = np.zeros(256, dtype=np.uint8)
    for rank, cat_id in enumerate(_THING_IDS, start=1):
        lut[cat_id - 1] = rank
    return lut


def convert_stuffthingmaps(
    src_dir: Path, out_dir: Path, lut: np.ndarray, suffix: str, overwrite: bool = False, on_item: Callable[[], None] | None = None
) -> int:
    """Map every raw PNG in `src_dir` (names without `TrainIds`) through `lut` into `out_dir/<stem><suffix>`."""
    sources = sorted(p for p in Path(src_dir).glob("*.png") if "TrainIds" not in p.name)
    if not sources:
        raise DatasetError(f"no raw COCO-Stuff stuffthingmaps PNGs in {src_dir}; see {DOCS} (COCO-Stuff)")
    written = 0
    for src in sources:
        dst = Path(out_dir) / f"{src.stem}{suffix}"
        if dst.exists() and not overwrite:
            continue
        raw = read_label_png(src)
        if raw.min(initial=0) < 0 or raw.max(initial=0) > 255:
            raise DatasetError(f"{src}: values outside 0..255; expected an 8-bit stuffthingmaps PNG")
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
        dst = Path(out_dir) / f"{Path(img['file_name']).stem}{OBJECT_SUFFIX}"
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
