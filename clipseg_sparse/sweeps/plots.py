"""Plots of a metric over result records: one panel per group (`records.split_groups`), one line (or
bar series) per value of a key."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .records import Record, ReportError, format_value, hashable, sort_key, split_groups, title_of

ENTMAX_FAMILY = ("softmax", "entmax", "sparsemax")
PLOT_FILES = ("alpha.png", "resolution.png", "datasets.png")


@dataclass
class Series:
    """Data of one plot: per group (a panel) and per line value, the (x, y) points sorted by x."""

    x: str
    line: str
    metric: str
    panels: list[tuple[str, dict[Any, list[tuple[Any, float]]]]]

    @property
    def x_values(self) -> list:
        values = {hashable(x): x for _, lines in self.panels for pts in lines.values() for x, _ in pts}
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
                lines.setdefault(r.keys.get(line), {})[hashable(r.keys[x])] = (r.keys[x], r.metrics[metric])
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
            where = {hashable(x): y for x, y in pts}
            xs = [j + (i - (len(lines) - 1) / 2) * width for j, c in enumerate(cats) if hashable(c) in where]
            ys = [where[hashable(c)] for c in cats if hashable(c) in where]
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
