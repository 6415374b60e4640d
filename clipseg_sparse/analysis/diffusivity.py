"""Gain vs diffusivity: does entmax help most where softmax attention is most diffuse?

Each *cell* pairs an eval result of a sparse normalizer (entmax:ALPHA, sparsemax, randmask:ALPHA) with
its softmax reference (the same run with only the normalizer set to softmax, as records.softmax_deltas
finds it) and with the `analyze` result of that softmax spec on the same dataset, model, weights and
resolution: x = the softmax attention's diffusivity (1 - own-class mass), y = the metric's gain over
softmax. Per class, x is the class's diffusivity and y its IoU gain. For each normalizer (and for all
entmax-family cells together) the least-squares line, Pearson's r and Spearman's rho are computed.

    cells = gain_cells(collect(["runs/sweep"]), read_analyses(["runs/analysis"]))
    correlations(cells)        # [Correlation(group="entmax:1.5", n=..., pearson=..., ...), ...]
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..sweeps.records import Record, ReportError, result_files, softmax_attention, softmax_deltas, sort_key

MATCH_KEYS = ("model", "pretrained", "dataset", "attention", "resolution")
FILES = ("gain-vs-diffusivity.png", "gain-vs-diffusivity.csv", "gain-vs-diffusivity.md",
         "gain-vs-diffusivity-per-class.png", "gain-vs-diffusivity-per-class.csv")  # fmt: skip


def read_analyses(sources: Iterable[str | Path]) -> list[dict]:
    """`analyze` result files (kind "analysis") among files, folders (recursive) and globs."""
    out = []
    for source in sources:
        for path in result_files(source):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and data.get("kind") == "analysis" and isinstance(data.get("config"), dict):
                out.append(data)
    return out


def _key(config: dict, attention: str) -> tuple:
    return tuple(json.dumps(attention if k == "attention" else config.get(k)) for k in MATCH_KEYS)


@dataclass(frozen=True)
class GainCell:
    """One point: a sparse run against its softmax reference (per class when `class_name` is set)."""

    dataset: str
    model: str
    pretrained: str
    resolution: int | None
    attention: str  # the softmax reference's spec
    normalizer: str
    diffusivity: float  # of the softmax reference's attention
    baseline: float
    value: float
    class_name: str = ""

    @property
    def gain(self) -> float:
        return self.value - self.baseline


def gain_cells(records: Sequence[Record], analyses: Sequence[dict], metric: str = "mIoU", per_class: bool = False) -> list[GainCell]:
    """Cells of every eval record that has a softmax reference and an analysis of that reference.

    per_class: one cell per class with an IoU in both runs and query patches in the analysis
    (metric is then the per-class IoU)."""
    by_key: dict[tuple, dict] = {}
    for a in sorted(analyses, key=lambda a: str(a.get("created", ""))):  # the newest wins
        by_key[_key(a["config"], a["config"].get("attention"))] = a
    records = [r for r in records if r.kind == "eval" and metric in r.metrics]
    deltas = softmax_deltas(records, metric)
    cells = []
    for r in records:
        if id(r) not in deltas:
            continue
        reference = softmax_attention(r.config["attention"])
        analysis = by_key.get(_key(r.config, reference))
        if analysis is None:
            continue
        common = dict(dataset=r.config.get("dataset"), model=r.config.get("model"), pretrained=r.config.get("pretrained"),
                      resolution=r.config.get("resolution"), attention=reference, normalizer=r.keys["normalizer"])  # fmt: skip
        if not per_class:
            if analysis["metrics"].get("diffusivity") is not None:
                value = r.metrics[metric]
                cells.append(GainCell(**common, diffusivity=analysis["metrics"]["diffusivity"], baseline=value - deltas[id(r)], value=value))
            continue
        own, ref = _per_class_iou(r.path), _per_class_iou(_reference_path(records, r))
        for name, stats in analysis.get("per_class", {}).items():
            if stats.get("diffusivity") is not None and own.get(name) is not None and ref.get(name) is not None:
                cells.append(GainCell(**common, diffusivity=stats["diffusivity"], baseline=ref[name], value=own[name], class_name=name))
    return cells


def _reference_path(records: Sequence[Record], record: Record) -> Path:
    key = record.identity(softmax=True)
    return next(r.path for r in records if r.identity() == key)


def _per_class_iou(path: Path) -> dict[str, float | None]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {name: m.get("IoU") for name, m in data.get("per_class", {}).items()}


# -- statistics --------------------------------------------------------------------------------------
def ranks(values: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank (as Spearman's rho needs)."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    out = np.empty(len(values))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[order[j + 1]] == values[order[i]]:
            j += 1
        out[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r; NaN with fewer than 2 points or a constant variable."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((dx * dx).sum() * (dy * dy).sum()))
    return float((dx * dy).sum() / denom) if denom > 0 else math.nan


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson's r of the ranks."""
    return pearson(ranks(x), ranks(y)) if len(x) >= 2 else math.nan


def least_squares(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line y = slope * x + intercept; NaNs if x is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or np.all(x == x[0]):
        return math.nan, math.nan
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


@dataclass(frozen=True)
class Correlation:
    group: str  # a normalizer, or "entmax family" (entmax and sparsemax cells together)
    n: int
    pearson: float
    spearman: float
    slope: float
    intercept: float


def correlations(cells: Sequence[GainCell]) -> list[Correlation]:
    """Per normalizer, then over all entmax-family cells (randmask controls kept apart)."""
    groups: dict[str, list[GainCell]] = {}
    for c in cells:
        groups.setdefault(c.normalizer, []).append(c)
    ordered = sorted(groups, key=lambda g: sort_key("normalizer", g))
    family = [c for c in cells if c.normalizer.partition(":")[0] in ("entmax", "sparsemax")]
    if len([g for g in ordered if g.partition(":")[0] in ("entmax", "sparsemax")]) > 1:
        groups["entmax family"] = family
        ordered.append("entmax family")
    out = []
    for g in ordered:
        xs, ys = [c.diffusivity for c in groups[g]], [c.gain for c in groups[g]]
        out.append(Correlation(g, len(xs), pearson(xs, ys), spearman(xs, ys), *least_squares(xs, ys)))
    return out


# -- outputs -----------------------------------------------------------------------------------------
def cells_csv(cells: Sequence[GainCell]) -> str:
    """The table behind a plot, one row per cell, numbers unrounded."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    names = [*(k for k in asdict(cells[0]) if k != "class_name"), *(["class_name"] if cells[0].class_name else []), "gain"] if cells else []
    writer.writerow(names)
    for c in cells:
        row = asdict(c) | {"gain": c.gain}
        writer.writerow([row[k] for k in names])
    return buf.getvalue()


def _fmt(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{round(v, 3) + 0.0:.3f}"  # + 0.0: no "-0.000"


def correlations_markdown(rows: Sequence[Correlation], metric: str) -> str:
    lines = [f"**{metric} gain vs softmax diffusivity**", "", "| normalizer | cells | Pearson r | Spearman rho | slope | intercept |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.group} | {r.n} | {_fmt(r.pearson)} | {_fmt(r.spearman)} | {_fmt(r.slope)} | {_fmt(r.intercept)} |" for r in rows]
    return "\n".join(lines) + "\n"


def correlations_rich(rows: Sequence[Correlation], title: str):
    from rich.table import Table

    table = Table("normalizer", "cells", "Pearson r", "Spearman rho", "slope", "intercept", title=title, title_justify="left")
    for r in rows:
        table.add_row(r.group, str(r.n), _fmt(r.pearson), _fmt(r.spearman), _fmt(r.slope), _fmt(r.intercept))
    return table


def plot_gain(cells: Sequence[GainCell], path: Path, metric: str, title: str = "") -> Path:
    """Scatter of gain vs diffusivity, one colour per normalizer with its least-squares line; the
    legend gives n, Pearson's r and Spearman's rho."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    by_group = {r.group: r for r in correlations(cells)}
    for i, group in enumerate(g for g in by_group if g != "entmax family"):
        members = [c for c in cells if c.normalizer == group]
        stats = by_group[group]
        xs, ys = np.array([c.diffusivity for c in members]), np.array([c.gain for c in members])
        marker = "x" if group.startswith("randmask") else "o"
        label = f"{group}: n={stats.n}, r={_fmt(stats.pearson)}, rho={_fmt(stats.spearman)}"
        ax.scatter(xs, ys, marker=marker, label=label, color=f"C{i}", s=24)
        if not math.isnan(stats.slope):
            line_x = np.array([xs.min(), xs.max()])
            ax.plot(line_x, stats.slope * line_x + stats.intercept, color=f"C{i}", linewidth=1)
    ax.axhline(0, color="grey", linewidth=0.6)
    ax.set_xlabel("diffusivity of the softmax attention (1 - own-class mass)")
    ax.set_ylabel(f"{metric} gain over softmax")
    family = by_group.get("entmax family")
    ax.set_title(title + (f"\nentmax family: n={family.n}, r={_fmt(family.pearson)}, rho={_fmt(family.spearman)}" if family else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path)
    return path


def write_gain_report(records: Sequence[Record], analyses: Sequence[dict], out_dir: str | Path, metric: str = "mIoU", overwrite: bool = False) -> tuple[list[Path], list[Correlation], list[Correlation]]:
    """Scatter PNGs, CSV tables and a Markdown summary into out_dir (dataset level, then per class).

    Returns (files written, dataset-level correlations, per-class correlations). ReportError when no
    cell pairs a sparse run, its softmax reference and an analysis of that reference."""
    out_dir = Path(out_dir)
    existing = [out_dir / n for n in FILES if (out_dir / n).exists()]
    if existing and not overwrite:
        raise ReportError(f"{existing[0]} exists; pass --overwrite to replace it")
    cells = gain_cells(records, analyses, metric)
    if not cells:
        raise ReportError(
            f"no cell for gain vs diffusivity: need eval results of a sparse normalizer and of its softmax run, and an "
            f"`analyze` result of that softmax spec with the same {', '.join(k for k in MATCH_KEYS if k != 'attention')} "
            f"({len(analyses)} analysis file(s) found)"
        )
    class_cells = gain_cells(records, analyses, metric, per_class=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, class_rows = correlations(cells), correlations(class_cells)
    written = [plot_gain(cells, out_dir / FILES[0], metric, f"{metric} gain vs softmax diffusivity ({len(cells)} cells)")]
    (out_dir / FILES[1]).write_text(cells_csv(cells), encoding="utf-8")
    markdown = correlations_markdown(rows, metric)
    if class_cells:
        markdown += "\n" + correlations_markdown(class_rows, "per-class IoU")
        written.append(plot_gain(class_cells, out_dir / FILES[3], "IoU", f"per-class IoU gain vs class diffusivity ({len(class_cells)} class cells)"))
        (out_dir / FILES[4]).write_text(cells_csv(class_cells), encoding="utf-8")
        written.append(out_dir / FILES[4])
    (out_dir / FILES[2]).write_text(markdown, encoding="utf-8")
    written[1:1] = [out_dir / FILES[1], out_dir / FILES[2]]
    return written, rows, class_rows
