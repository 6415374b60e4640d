"""Tables and plots from result files: the aggregator of a sweep.

A result file (see results.py) is one run: {"kind": "eval"|"fgovd", "config": {...}, "metrics": {...}}.
`collect` reads many into `Record`s. Each record exposes *keys*: its flat config plus keys derived from
the attention string (`source`, `normalizer`, `alpha`, `block` = the remaining block edits). A pivot puts
one key on the rows, one on the columns and a metric in the cells; every other key that varies across
the records and is not implied by the rows and columns splits them into separate tables (one per
dataset and model, say). Each cell carries its delta against the softmax run of the same source with
everything else equal (the same config with only the normalizer set to softmax).

Plots follow the same grouping: one panel per group, one line (or bar series) per value of a key.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

# Knobs that do not change a number: ignored when grouping records and when matching the softmax run.
NEUTRAL_KEYS = frozenset({"device", "batch_size", "num_workers"})
# Keys that name a group first (the rest follow alphabetically, the full attention string last), so a
# table is titled "model=..., dataset=..." rather than by something those imply (a class list, say).
PREFERRED_KEYS = (
    "kind", "model", "pretrained", "precision", "dataset", "benchmarks", "protocol", "resolution",
    "source", "normalizer", "alpha", "block",
)  # fmt: skip
DERIVED_KEYS = ("source", "normalizer", "alpha", "block")
NORMALIZER_ORDER = ("softmax", "entmax", "sparsemax", "randmask")
ENTMAX_FAMILY = ("softmax", "entmax", "sparsemax")
PLOT_FILES = ("alpha.png", "resolution.png", "datasets.png")


class ReportError(ValueError):
    """Bad input to the reporter: no results, an unknown metric or key."""


def attention_keys(attention: str) -> dict[str, Any]:
    """`qq+kk/entmax:1.5/noffn` -> source qq+kk, normalizer entmax:1.5, alpha 1.5, block noffn.

    alpha is 1 for softmax and 2 for sparsemax; `block` is "-" when no other edit is made.
    """
    from ..attention import AttentionSpec
    from ..attention.normalizers import Normalizer

    spec = AttentionSpec.parse(attention)
    options = str(spec).split("/")[2:]
    return {
        "source": "+".join(spec.source),
        "normalizer": spec.normalizer,
        "alpha": Normalizer.parse(spec.normalizer).alpha,
        "block": "/".join(options) or "-",
    }


def softmax_attention(attention: str) -> str:
    """The same spec with its normalizer set to softmax: the reference a delta is taken against."""
    from ..attention import AttentionSpec

    return str(AttentionSpec.parse(attention).replace(normalizer="softmax"))


@dataclass(frozen=True)
class Record:
    """One result file: config (flat knobs) and metrics (name -> float)."""

    path: Path
    kind: str
    config: dict
    metrics: dict
    created: str = ""

    @cached_property
    def keys(self) -> dict[str, Any]:
        """The config plus derived keys (see module doc); `dataset` for an FG-OVD record is its split."""
        keys = {"kind": self.kind, **self.config}
        if "attention" in self.config:
            keys.update(attention_keys(self.config["attention"]))
        if "split" in keys:  # FG-OVD: the split plays the part of the dataset
            keys["dataset"] = keys["split"]
        return keys

    def identity(self, softmax: bool = False) -> str:
        """What makes two runs the same run (neutral knobs aside); softmax=True: of its softmax reference."""
        config = {k: v for k, v in self.config.items() if k not in NEUTRAL_KEYS}
        if softmax and "attention" in config:
            config["attention"] = softmax_attention(config["attention"])
        return json.dumps([self.kind, config], sort_keys=True, default=str)


def _result_files(source: str | Path) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        return sorted(p for p in path.rglob("*.json") if not p.name.startswith("."))
    if path.is_file():
        return [path]
    matches = sorted(glob.glob(str(source), recursive=True))
    if not matches:
        raise ReportError(f"{source}: no such file, folder or glob match")
    return [p for m in matches for p in _result_files(m)]


def read_result(path: Path) -> dict | None:
    """The parsed result file; None for any other JSON (sweep error files, foreign files) or a torn file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("kind") not in ("eval", "fgovd"):
        return None
    if not isinstance(data.get("config"), dict) or not isinstance(data.get("metrics"), dict):
        return None
    return data


def records_of(path: Path, data: dict) -> list[Record]:
    """Records of one result. An FG-OVD result gives one record per split (its `split`, and so its
    `dataset`, is the split name; metrics lose the `<split>.` prefix), plus a `mean` one when the result
    has the Hard/Medium/Easy means, so splits can be pivoted like datasets."""
    metrics = {k: float(v) for k, v in data["metrics"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    created = str(data.get("created", ""))
    if data["kind"] != "fgovd":
        return [Record(path, data["kind"], data["config"], metrics, created)]
    splits = [str(s) for s in data["config"].get("benchmarks", [])]
    if any(m.startswith("mean.") for m in metrics):
        splits.append("mean")
    out = []
    for split in splits:
        own = {m[len(split) + 1 :]: v for m, v in metrics.items() if m.startswith(f"{split}.")}
        out.append(Record(path, "fgovd", {**data["config"], "split": split}, own, created))
    return out


def collect(sources: Iterable[str | Path]) -> list[Record]:
    """Result records from files, folders (searched recursively) and globs.

    Non-result JSON is skipped. When two files hold the same run, the newer (`created`) one is kept.
    """
    newest: dict[str, Record] = {}
    for source in sources:
        for path in _result_files(source):
            data = read_result(path)
            for rec in records_of(path, data) if data is not None else ():
                key = rec.identity()
                if key not in newest or rec.created >= newest[key].created:
                    newest[key] = rec
    return list(newest.values())


def default_metric(records: Sequence[Record]) -> str:
    """mIoU for segmentation; for FG-OVD `top1` (each split at the N it supports), in older results top-1
    at the most negatives (`top1@N`); else the first metric."""
    names = sorted({m for r in records for m in r.metrics})
    if not names:
        raise ReportError("the results hold no metrics")
    if "mIoU" in names:
        return "mIoU"
    if "top1" in names:
        return "top1"
    top1 = [m for m in names if m.startswith("top1@") and m[5:].isdigit()]
    return max(top1, key=lambda m: int(m[5:])) if top1 else names[0]


def check_inputs(records: Sequence[Record], metric: str, keys: Sequence[str]) -> None:
    if not records:
        raise ReportError("no result files found")
    if not any(metric in r.metrics for r in records):
        names = sorted({m for r in records for m in r.metrics})
        raise ReportError(f"metric {metric!r} is in none of the results; metrics: {', '.join(names[:20])}")
    known = {k for r in records for k in r.keys}
    for key in keys:
        if key not in known:
            raise ReportError(f"unknown key {key!r}; keys: {', '.join(sorted(known))}")


# -- grouping ----------------------------------------------------------------------------------------
def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (list, dict)) else value


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return str(value)


def sort_key(key: str, value: Any) -> tuple:
    """Normalizers by kind then alpha; sources single terms first in qk, qq, kk, vv, id order; numbers numerically."""
    if key == "normalizer" and isinstance(value, str):
        kind, _, alpha = value.partition(":")
        rank = NORMALIZER_ORDER.index(kind) if kind in NORMALIZER_ORDER else len(NORMALIZER_ORDER)
        return (0, rank, float(alpha or 0), value)
    if key == "source" and isinstance(value, str):
        from ..attention import SOURCES

        terms = value.split("+")
        return (0, len(terms), [SOURCES.index(t) if t in SOURCES else len(SOURCES) for t in terms], value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, format_value(value))


def _determined(records: Sequence[Record], by: Sequence[str], key: str) -> bool:
    """True when `key` takes one value for each combination of the `by` keys' values."""
    seen: dict[tuple, Any] = {}
    for r in records:
        k = tuple(_hashable(r.keys.get(b)) for b in by)
        v = _hashable(r.keys.get(key))
        if seen.setdefault(k, v) != v:
            return False
    return True


def group_keys(records: Sequence[Record], fixed: Sequence[str]) -> list[str]:
    """The fewest varying keys that, with the `fixed` ones, tell the records apart (preferred keys first)."""
    all_keys = {k for r in records for k in r.keys} - NEUTRAL_KEYS - set(fixed)
    varying = [k for k in all_keys if len({_hashable(r.keys.get(k)) for r in records}) > 1]
    rank = {k: i for i, k in enumerate(PREFERRED_KEYS)}
    varying.sort(key=lambda k: (k == "attention", rank.get(k, len(rank)), k))
    chosen: list[str] = []
    for key in varying:
        if not _determined(records, [*fixed, *chosen], key):
            chosen.append(key)
    return chosen


def split_groups(records: Sequence[Record], fixed: Sequence[str]) -> list[tuple[dict[str, Any], list[Record]]]:
    """Records split by the group keys, as (title keys -> value, records), groups in sorted order."""
    keys = group_keys(records, fixed)
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault(tuple(_hashable(r.keys.get(k)) for k in keys), []).append(r)
    out = [({k: rs[0].keys.get(k) for k in keys}, rs) for rs in groups.values()]
    out.sort(key=lambda g: [sort_key(k, g[0][k]) for k in keys])
    return out


def title_of(group: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in group.items())


def softmax_deltas(records: Sequence[Record], metric: str) -> dict[int, float]:
    """id(record) -> metric minus the metric of its softmax reference, for non-softmax records that have one."""
    reference = {r.identity(): r for r in records if r.keys.get("normalizer") == "softmax"}
    deltas = {}
    for r in records:
        if r.keys.get("normalizer") in (None, "softmax") or metric not in r.metrics:
            continue
        ref = reference.get(r.identity(softmax=True))
        if ref is not None and metric in ref.metrics:
            deltas[id(r)] = r.metrics[metric] - ref.metrics[metric]
    return deltas


# -- tables ------------------------------------------------------------------------------------------
@dataclass
class Cell:
    value: float
    delta: float | None  # against the softmax run of the same source; None for softmax or when missing
    record: Record


@dataclass
class Pivot:
    """One table: rows x columns of one metric, for one group of the other varying keys."""

    group: dict[str, Any]
    rows_key: str
    cols_key: str
    metric: str
    row_values: list = field(default_factory=list)
    col_values: list = field(default_factory=list)
    cells: dict[tuple, Cell] = field(default_factory=dict)  # (hashable row value, hashable col value) -> Cell

    @property
    def title(self) -> str:
        return title_of(self.group) or "all results"

    def cell(self, row: Any, col: Any) -> Cell | None:
        return self.cells.get((_hashable(row), _hashable(col)))


def pivot(records: Sequence[Record], rows: str = "source", cols: str = "normalizer", metric: str | None = None) -> list[Pivot]:
    """Pivot tables of `metric` (default: `default_metric`), one per group of the other varying keys."""
    metric = metric or default_metric(records)
    check_inputs(records, metric, (rows, cols))
    records = [r for r in records if metric in r.metrics]
    deltas = softmax_deltas(records, metric)
    tables = []
    for group, members in split_groups(records, (rows, cols)):
        table = Pivot(group, rows, cols, metric)
        for r in sorted(members, key=lambda r: r.created):  # the newest wins a shared cell
            rv, cv = r.keys.get(rows), r.keys.get(cols)
            table.cells[(_hashable(rv), _hashable(cv))] = Cell(r.metrics[metric], deltas.get(id(r)), r)
            if rv not in table.row_values:
                table.row_values.append(rv)
            if cv not in table.col_values:
                table.col_values.append(cv)
        table.row_values.sort(key=lambda v: sort_key(rows, v))
        table.col_values.sort(key=lambda v: sort_key(cols, v))
        tables.append(table)
    return tables


def format_cell(cell: Cell | None, digits: int = 2) -> str:
    if cell is None:
        return ""
    text = f"{cell.value:.{digits}f}"
    return text if cell.delta is None else f"{text} ({cell.delta:+.{digits}f})"


def to_markdown(tables: Sequence[Pivot]) -> str:
    """One Markdown table per pivot, each under a bold title line; deltas in parentheses."""
    out = []
    for t in tables:
        header = [f"{t.rows_key} \\ {t.cols_key}", *(format_value(c) for c in t.col_values)]
        lines = [f"**{t.metric}: {t.title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for rv in t.row_values:
            cells = [format_cell(t.cell(rv, cv)) for cv in t.col_values]
            lines.append("| " + " | ".join([format_value(rv), *cells]) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def to_csv(tables: Sequence[Pivot]) -> str:
    """Wide CSV: group keys, the row key, one column per column value and one `delta <col>` per column
    that has any delta. Numbers unrounded. Consecutive tables with the same rows, columns and column
    values share one header (a blank line before each new header); its delta columns are those of any
    of them, so every row has as many fields as its header."""
    group_names = list(dict.fromkeys(k for t in tables for k in t.group))
    layout = lambda t: (t.rows_key, t.cols_key, tuple(t.col_values))  # noqa: E731
    blocks: list[list[Pivot]] = []
    for t in tables:
        if blocks and layout(blocks[-1][-1]) == layout(t):
            blocks[-1].append(t)
        else:
            blocks.append([t])
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for i, block in enumerate(blocks):
        first = block[0]
        delta_cols = [
            cv for cv in first.col_values
            if any((c := t.cell(rv, cv)) and c.delta is not None for t in block for rv in t.row_values)
        ]  # fmt: skip
        if i:
            writer.writerow([])
        writer.writerow([*group_names, "metric", first.rows_key, *map(format_value, first.col_values), *(f"delta {format_value(c)}" for c in delta_cols)])
        for t in block:
            for rv in t.row_values:
                values = [(c.value if (c := t.cell(rv, cv)) else "") for cv in t.col_values]
                deltas = [(c.delta if (c := t.cell(rv, cv)) and c.delta is not None else "") for cv in delta_cols]
                writer.writerow([*(format_value(t.group.get(k)) for k in group_names), t.metric, format_value(rv), *values, *deltas])
    return buf.getvalue()


def to_rich(table: Pivot):
    """A rich Table of one pivot: gains green, losses red."""
    from rich.markup import escape
    from rich.table import Table

    # spec strings hold [..] term modifiers, which rich would read as markup
    out = Table(title=escape(f"{table.metric}: {table.title}"), title_justify="left")
    out.add_column(f"{table.rows_key} \\ {table.cols_key}", no_wrap=True)
    for cv in table.col_values:
        out.add_column(escape(format_value(cv)), justify="right")  # a narrow terminal wraps the delta below
    for rv in table.row_values:
        cells = []
        for cv in table.col_values:
            cell = table.cell(rv, cv)
            text = format_cell(cell)
            if cell is not None and cell.delta is not None:
                colour = "green" if cell.delta > 0 else "red" if cell.delta < 0 else "default"
                text = f"{cell.value:.2f} [{colour}]({cell.delta:+.2f})[/]"
            cells.append(text)
        out.add_row(escape(format_value(rv)), *cells)
    return out


# -- plots -------------------------------------------------------------------------------------------
@dataclass
class Series:
    """Data of one plot: per group (a panel) and per line value, the (x, y) points sorted by x."""

    x: str
    line: str
    metric: str
    panels: list[tuple[str, dict[Any, list[tuple[Any, float]]]]]

    @property
    def x_values(self) -> list:
        values = {_hashable(x): x for _, lines in self.panels for pts in lines.values() for x, _ in pts}
        return sorted(values.values(), key=lambda v: sort_key(self.x, v))


def series(records: Sequence[Record], x: str, line: str, metric: str, kinds: Sequence[str] | None = None) -> Series:
    """metric against key `x`, one line per value of `line`, one panel per group of the other keys.

    kinds: keep only records whose normalizer kind is listed (e.g. the entmax family for alpha plots).
    """
    records = [r for r in records if metric in r.metrics and r.keys.get(x) is not None]
    if kinds is not None:
        records = [r for r in records if str(r.keys.get("normalizer", "")).partition(":")[0] in kinds]
    panels = []
    if records:
        for group, members in split_groups(records, (x, line)):
            lines: dict[Any, dict] = {}
            for r in sorted(members, key=lambda r: r.created):
                lines.setdefault(r.keys.get(line), {})[_hashable(r.keys[x])] = (r.keys[x], r.metrics[metric])
            ordered = sorted(lines, key=lambda v: sort_key(line, v))
            panels.append(
                (title_of(group), {lv: sorted(lines[lv].values(), key=lambda p: sort_key(x, p[0])) for lv in ordered})
            )
    return Series(x, line, metric, panels)


def alpha_series(records: Sequence[Record], metric: str) -> Series:
    """metric vs alpha per source (softmax at alpha 1, sparsemax at 2)."""
    return series(records, "alpha", "source", metric, kinds=ENTMAX_FAMILY)


def resolution_series(records: Sequence[Record], metric: str) -> Series:
    """metric vs input resolution per normalizer."""
    return series(records, "resolution", "normalizer", metric)


def dataset_series(records: Sequence[Record], metric: str) -> Series:
    """softmax vs entmax (and sparsemax) per dataset, drawn as grouped bars."""
    return series(records, "dataset", "normalizer", metric, kinds=ENTMAX_FAMILY)


def _figure(n_panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes


def plot_lines(data: Series, path: Path, x_label: str | None = None) -> Path:
    """One panel per group, one line with markers per line value; x ticks at the values present."""
    fig, axes = _figure(len(data.panels))
    for ax, (title, lines) in zip(axes, data.panels):
        for lv, pts in lines.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=format_value(lv))
        ax.set_xticks(data.x_values)
        ax.set_xticklabels([format_value(v) for v in data.x_values])
        ax.set_title(title, fontsize=8)
        ax.set_xlabel(x_label or data.x)
        ax.set_ylabel(data.metric)
        ax.grid(alpha=0.3)
        ax.legend(title=data.line, fontsize=7, title_fontsize=7)
    fig.savefig(path)
    return path


def plot_bars(data: Series, path: Path) -> Path:
    """One panel per group: x = categories (e.g. datasets), one bar per line value (e.g. normalizer)."""
    fig, axes = _figure(len(data.panels))
    cats = data.x_values
    for ax, (title, lines) in zip(axes, data.panels):
        width = 0.8 / max(len(lines), 1)
        for i, (lv, pts) in enumerate(lines.items()):
            where = {_hashable(x): y for x, y in pts}
            xs = [j + (i - (len(lines) - 1) / 2) * width for j, c in enumerate(cats) if _hashable(c) in where]
            ys = [where[_hashable(c)] for c in cats if _hashable(c) in where]
            ax.bar(xs, ys, width=width, label=format_value(lv))
        ax.set_xticks(range(len(cats)))
        ax.set_xlim(-0.5, len(cats) - 0.5)
        ax.set_xticklabels([format_value(c) for c in cats])
        ax.set_title(title, fontsize=8)
        ax.set_ylabel(data.metric)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(title=data.line, fontsize=7, title_fontsize=7)
    fig.savefig(path)
    return path


def write_plots(records: Sequence[Record], metric: str, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """The plots the data supports, as PNG files in out_dir: `alpha.png` (metric vs alpha per source,
    needs two alphas), `resolution.png` (needs two resolutions), `datasets.png` (needs softmax and a
    sparse normalizer). Returns the files written."""
    out_dir = Path(out_dir)
    existing = [out_dir / n for n in PLOT_FILES if (out_dir / n).exists()]
    if existing and not overwrite:
        raise ReportError(f"{existing[0]} exists; choose another folder or allow overwriting")
    plans = [
        ("alpha.png", alpha_series(records, metric), "lines", "alpha (1 = softmax, 2 = sparsemax)"),
        ("resolution.png", resolution_series(records, metric), "lines", "resolution (short side, px)"),
        ("datasets.png", dataset_series(records, metric), "bars", None),
    ]
    written = []
    for name, data, style, x_label in plans:
        enough = len(data.x_values) >= 2 if style == "lines" else any(len(lines) >= 2 for _, lines in data.panels)
        if not data.panels or not enough:
            continue
        path = out_dir / name
        out_dir.mkdir(parents=True, exist_ok=True)
        written.append(plot_lines(data, path, x_label) if style == "lines" else plot_bars(data, path))
    return written
