"""Built-in class names of the benchmarks: display labels and the published prompt-name files.

Display labels (per-class rows of result tables) are the datasets' own class names. The *prompt names*
fed to the text encoder come from the class files the published repositories ship; they differ
between repositories, so the choice is a setting with a version:

- `sclip`: wangf3014/SCLIP `configs/cls_*.txt` (NACLIP ships byte-identical copies): synonyms, and for
  VOC21 / COCO-Object a first line of stuff words that stand for the background.
- `plain`: mc-lan/ClearCLIP's files: plain names, and a literal `background` on VOC21 / COCO-Object.
  ClearCLIP ships SCLIP's files unchanged for the other datasets, so those are shared.
- `segearth`: earth-insights/SegEarth-OV-3's files (the `sam3` protocol): `plain`'s on VOC21 / COCO-Object,
  synonyms on VOC20 (`boat, ship`, `television monitor, ...`) and Cityscapes (`tree, hedge`, ...), SCLIP's
  for the other datasets (shared).
- `sfp`: Kimsure/SFP's files (the `sfp` protocol): SCLIP's with `people` for `person` on VOC21, VOC20 and
  Cityscapes, SCLIP's for the other datasets (shared).
- `itaclip`: m-arda-aydn/ITACLIP's files (the `itaclip` protocol) for VOC21, Context60, COCO-Object, COCO-Stuff and
  Cityscapes: other background words on VOC21 and more synonyms; SCLIP's for the other datasets (shared).
- `freecp`: chenqi1126/FreeCP's files (the `freecp*` protocols) for VOC21, VOC20 and COCO-Object: one name per
  class (its purification keeps one map per name); SCLIP's for the other datasets (shared).
- a file path: one class per line, synonyms separated by commas, one line per dataset class.

The version of a name set is its source and a hash of its bytes, so a result says exactly which
vocabulary produced it. Provenance of every shipped file: `clipseg_sparse/data/SOURCES.md`.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from ..errors import UserValueError
from ..segment.vocabulary import Vocabulary

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
# every folder of data/class_names is a name set; a file it lacks falls back to SCLIP's (`class_names_file`)
NAME_SETS = ("sclip", *sorted(d.name for d in (DATA_DIR / "class_names").iterdir() if d.is_dir() and d.name != "sclip"))

# Datasets whose labels are another dataset's, minus a background class or restricted to things.
_LABEL_FILES = {
    "voc21": DATA_DIR / "labels" / "voc21.txt",
    "context60": DATA_DIR / "labels" / "context60.txt",
    "cityscapes": DATA_DIR / "labels" / "cityscapes.txt",
    "ade20k": DATA_DIR / "class_names" / "sclip" / "ade20k.txt",  # SCLIP's file is mmseg's 150 names
}
# COCO-Stuff ids (1-based, cocostuff labels.txt) that no pixel uses; trainIds 0..170 skip them.
COCO_UNUSED_IDS = frozenset({12, 26, 29, 30, 45, 66, 68, 69, 71, 83, 91})


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@lru_cache(maxsize=None)
def display_labels(dataset: str) -> tuple[str, ...]:
    """The dataset's class names in label order (index i = label value i after decoding)."""
    if dataset in _LABEL_FILES:
        return tuple(_lines(_LABEL_FILES[dataset]))
    if dataset in ("voc20", "context59"):
        return display_labels({"voc20": "voc21", "context59": "context60"}[dataset])[1:]
    if dataset == "coco-stuff":
        rows = [line.split(":", 1) for line in _lines(DATA_DIR / "cocostuff_labels.txt")]
        return tuple(name.strip() for idx, name in rows if int(idx) > 0 and int(idx) not in COCO_UNUSED_IDS)
    if dataset == "coco-object":
        return ("background", *display_labels("coco-stuff")[:80])
    raise KeyError(dataset)


def class_names_file(dataset: str, which: str) -> Path:
    """The shipped prompt-name file of a name set, or `which` itself as a path."""
    if which in NAME_SETS:
        path = DATA_DIR / "class_names" / which / f"{dataset}.txt"
        return path if path.is_file() else DATA_DIR / "class_names" / "sclip" / f"{dataset}.txt"
    path = Path(which)
    if not path.is_file():
        raise UserValueError(f"class names {which!r}: not one of {', '.join(NAME_SETS)} and not an existing file")
    return path


def class_vocabulary(dataset: str, which: str = "sclip") -> tuple[Vocabulary, str]:
    """(vocabulary with the dataset's display labels, version string) for a name set or a file."""
    path = class_names_file(dataset, which)
    vocab = Vocabulary.from_file(path)
    labels = display_labels(dataset)
    if len(vocab) != len(labels):
        raise UserValueError(f"{path}: {len(vocab)} classes (lines) but {dataset} has {len(labels)}; one line per class is needed")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    source = which if which in NAME_SETS else f"file:{path.name}"
    return Vocabulary(vocab.names, labels), f"{source}/{path.name}@{digest}"
