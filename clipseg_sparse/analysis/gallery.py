"""A static HTML gallery: images x specs, overlays with class legends, per-image mIoU, sortable.

Each column is a folder of one spec's predictions, either
- `segment` output: per image a JSON record, its overlay (with legend) and its label map; or
- `eval --save-pred` output: palette PNGs in the dataset's label encoding (images, labels and class
  names then come from `dataset` / `root`).
Rows are matched across columns by the image's path inside its folder (without suffix). Where ground
truth exists (save-pred folders with `dataset` / `root`, or segment outputs over that dataset's images
with its classes) each cell shows the image's mIoU (the mean IoU over the classes present in the
prediction or the label), and the page can sort the rows by the difference between two columns
(largest first; `page.html#sort=A-B` opens it sorted by column A minus column B, 0-based).

The page is one file: thumbnails are embedded as JPEG data URIs and the sorting script is inline, so
it opens from disk without a server or network.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from ..errors import UserValueError

THUMB_WIDTH = 360
LEGEND_ROWS = 10  # legends of save-pred overlays list the largest classes only (thumbnails stay short)


@dataclass
class GalleryCell:
    image: str  # data URI of the overlay thumbnail (legend included)
    miou: float | None = None  # percent


@dataclass
class Gallery:
    columns: list[str]
    rows: dict[str, list[GalleryCell | None]] = field(default_factory=dict)  # image key -> one cell per column

    @property
    def has_miou(self) -> bool:
        return any(c is not None and c.miou is not None for cells in self.rows.values() for c in cells)


def _data_uri(image: Image.Image, width: int = THUMB_WIDTH) -> str:
    if image.width > width:
        image = image.resize((width, round(image.height * width / image.width)), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _image_miou(pred: np.ndarray, label: np.ndarray, num_classes: int) -> float | None:
    from ..evaluation.metrics import intersect_and_union, segmentation_metrics

    miou = segmentation_metrics(intersect_and_union(pred, label, num_classes))["mIoU"]
    return None if np.isnan(miou) else 100.0 * miou


def _column_name(folder: Path) -> str:
    """The attention spec the folder's segment records share, else the folder's name."""
    specs = set()
    for record in list(folder.rglob("*.json"))[:50]:
        try:
            specs.add(json.loads(record.read_text(encoding="utf-8"))["settings"]["attention"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return specs.pop() if len(specs) == 1 else folder.name


def parse_columns(items: Sequence[str]) -> list[tuple[str, Path]]:
    """`NAME=DIR` or `DIR` (named by its spec or folder name) -> (name, folder); UserValueError if not a folder."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        folder = Path(path if sep else item)
        if not folder.is_dir():
            raise UserValueError(f"{folder}: not a folder of segment outputs or eval --save-pred predictions")
        out.append((name if sep else _column_name(folder), folder))
    return out


def _segment_cells(folder: Path, bench, samples: dict) -> dict[str, GalleryCell]:
    """key -> cell for a folder of segment outputs (records with an overlay)."""
    from ..datasets.labels import read_label_png

    cells = {}
    for record_path in sorted(folder.rglob("*.json")):
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            files = record["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a segment record (e.g. an RLE file)
        overlay = record_path.parent / files.get("overlay", "")
        if "overlay" not in files or not overlay.is_file():
            continue
        key = record_path.relative_to(folder).as_posix()[: -len(".json")]
        miou = None
        sample = samples.get(Path(key).name)
        labels_file = record_path.parent / files.get("labels", "")
        if sample is not None and labels_file.suffix == ".png" and len(record.get("class_names", [])) == bench.num_classes:
            miou = _image_miou(read_label_png(labels_file), bench.load_label(sample.label), bench.num_classes)
        with Image.open(overlay) as img:
            cells[key] = GalleryCell(_data_uri(img), miou)
    return cells


def _prediction_cells(folder: Path, bench, samples: dict) -> dict[str, GalleryCell]:
    """key -> cell for an eval --save-pred folder (overlays drawn here from the dataset's images)."""
    from ..segment.images import load_image
    from ..segment.labels import SegmentationResult
    from ..files.outputs import overlay_image

    cells = {}
    for path in sorted(folder.rglob("*.png")):
        key = path.relative_to(folder).as_posix()[: -len(".png")]
        sample = samples.get(key)
        if sample is None:
            continue
        pred, label = bench.load_label(path), bench.load_label(sample.label)
        present = dict(list(SegmentationResult(pred, np.empty(0), bench.classes).present().items())[:LEGEND_ROWS])
        overlay = overlay_image(load_image(sample.image), pred, present, bench.classes)
        cells[key] = GalleryCell(_data_uri(overlay), _image_miou(pred, label, bench.num_classes))
    return cells


def collect_gallery(columns: Sequence[tuple[str, Path]], dataset: str | None = None, root: str | Path | None = None) -> Gallery:
    """Read every column's folder into a Gallery (rows sorted by image key)."""
    bench, samples = None, {}
    if dataset is not None:
        from ..datasets import DATASETS

        bench = DATASETS.get(dataset)
        found = bench.samples(root)
        samples = {s.id: s for s in found} | {Path(s.id).name: s for s in found}
    per_column = []
    for name, folder in columns:
        has_records = any(folder.rglob("*.overlay.png"))
        if not has_records and bench is None:
            raise UserValueError(f"{folder}: no segment outputs (*.overlay.png); for eval --save-pred folders give --dataset and --root")
        per_column.append(_segment_cells(folder, bench, samples) if has_records else _prediction_cells(folder, bench, samples))
    keys = sorted({k for cells in per_column for k in cells})
    if not keys:
        raise UserValueError("no images found in the gallery folders")
    return Gallery([name for name, _ in columns], {k: [cells.get(k) for cells in per_column] for k in keys})


_STYLE = """
body { font-family: sans-serif; margin: 16px; background: #fafafa; color: #222; }
h1 { font-size: 18px; } .note { color: #555; font-size: 13px; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: 4px; vertical-align: top; background: #fff; }
th { position: sticky; top: 0; background: #eee; font-size: 13px; }
td.key { font-size: 12px; max-width: 160px; word-break: break-all; }
img { display: block; max-width: 360px; } .miou { font-size: 12px; margin-top: 2px; } .diff { font-size: 13px; text-align: right; }
.controls { margin: 8px 0 12px; font-size: 13px; } .missing { color: #999; font-size: 12px; }
"""

_SCRIPT = r"""
(function () {
  var body = document.getElementById('rows');
  var a = document.getElementById('spec-a'), b = document.getElementById('spec-b');
  function value(row, col) { var v = row.getAttribute('data-miou-' + col); return v === null || v === '' ? NaN : parseFloat(v); }
  function diff(row) { return value(row, a.value) - value(row, b.value); }
  function refresh() {
    Array.prototype.forEach.call(body.rows, function (row) {
      var d = diff(row); row.querySelector('.diff').textContent = isNaN(d) ? '-' : (d > 0 ? '+' : '') + d.toFixed(2);
    });
  }
  function sortRows(key, descending) {
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (x, y) {
      var p = key(x), q = key(y);
      if (typeof p === 'number') { if (isNaN(p)) return 1; if (isNaN(q)) return -1; return descending ? q - p : p - q; }
      return p < q ? -1 : p > q ? 1 : 0;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }
  document.getElementById('sort-diff').addEventListener('click', function () { refresh(); sortRows(diff, true); });
  document.getElementById('sort-name').addEventListener('click', function () { sortRows(function (r) { return r.getAttribute('data-key'); }, false); });
  a.addEventListener('change', refresh); b.addEventListener('change', refresh);
  var link = /^#sort=(\d+)-(\d+)$/.exec(window.location.hash);  // a link to a sorted view: page.html#sort=A-B
  if (link && link[1] < a.options.length && link[2] < b.options.length) { a.value = link[1]; b.value = link[2]; sortRows(diff, true); }
  refresh();
})();
"""


def render_html(gallery: Gallery, title: str = "clipseg-sparse gallery", note: str = "") -> str:
    """The page: a table of images x columns; with mIoU, controls to sort by column A - column B."""
    esc = html.escape
    options = "".join(f'<option value="{i}">{esc(n)}</option>' for i, n in enumerate(gallery.columns))
    second = "".join(f'<option value="{i}"{" selected" if i == 1 else ""}>{esc(n)}</option>' for i, n in enumerate(gallery.columns))
    controls = ""
    if gallery.has_miou:
        controls = (
            f'<div class="controls">sort by mIoU of <select id="spec-a">{options}</select> minus '
            f'<select id="spec-b">{second}</select> <button id="sort-diff">sort by difference</button> '
            f'<button id="sort-name">sort by image</button></div>'
        )
    head = "".join(f"<th>{esc(n)}</th>" for n in gallery.columns)
    rows = []
    for key, cells in gallery.rows.items():
        attrs = "".join(f' data-miou-{i}="{"" if c is None or c.miou is None else f"{c.miou:.4f}"}"' for i, c in enumerate(cells))
        tds = []
        for c in cells:
            if c is None:
                tds.append('<td><div class="missing">no prediction</div></td>')
                continue
            miou = f'<div class="miou">mIoU {c.miou:.2f}</div>' if c.miou is not None else ""
            tds.append(f'<td><img src="{c.image}" alt="{esc(key)}">{miou}</td>')
        diff = '<td class="diff">-</td>' if gallery.has_miou else ""
        rows.append(f'<tr data-key="{esc(key)}"{attrs}><td class="key">{esc(key)}</td>{"".join(tds)}{diff}</tr>')
    diff_head = "<th>A - B</th>" if gallery.has_miou else ""
    script = f"<script>{_SCRIPT}</script>" if gallery.has_miou else ""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{esc(title)}</h1>"
        f'<p class="note">{esc(note)}</p>{controls}'
        f'<table><thead><tr><th>image</th>{head}{diff_head}</tr></thead><tbody id="rows">{"".join(rows)}</tbody></table>'
        f"{script}</body></html>\n"
    )


def write_gallery(
    columns: Sequence[str], out: str | Path, dataset: str | None = None, root: str | Path | None = None, overwrite: bool = False, title: str = "clipseg-sparse gallery"
) -> tuple[Path, Gallery]:
    """Build the page from `NAME=DIR` / `DIR` columns and write it (atomically; never over an existing
    file unless `overwrite`). UserValueError for bad folders, an existing page, or nothing to show."""
    from ..runtime.atomic import atomic_path

    out = Path(out)
    if out.exists() and not overwrite:
        raise UserValueError(f"{out} exists; pass --overwrite to replace it")
    gallery = collect_gallery(parse_columns(columns), dataset, root)
    note = f"{len(gallery.rows)} images x {len(gallery.columns)} predictions" + (f"; mIoU against {dataset} labels" if gallery.has_miou else "")
    with atomic_path(out) as tmp:
        tmp.write_text(render_html(gallery, title, note), encoding="utf-8")
    return out, gallery
