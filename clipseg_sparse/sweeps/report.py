"""Pivot tables of a metric over result records, rendered as Markdown, CSV or a rich table.

A pivot puts one key on the rows, one on the columns and a metric in the cells; every other key that
varies across the records and is not implied by the rows and columns splits them into separate tables
(`records.split_groups`). Each cell carries its delta against the softmax run of the same source with
everything else equal (`records.softmax_deltas`), and, where a paper reports that run (the same protocol, CLIP,
settings and preset up to its normalizer: `evaluation.published`), the paper's number and the difference, marked
when it is beyond the tolerance.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..evaluation.published import EIGHT, PUBLISHED, TOLERANCE, Comparison, Published, comparison
from .records import Record, check_inputs, default_metric, format_value, hashable, softmax_deltas, sort_key, split_groups, title_of


@dataclass
class TableCell:
    value: float
    delta: float | None  # against the softmax run of the same source; None for softmax or when missing
    record: Record | None  # None: a paper's number or an average (leaderboard)
    paper: Comparison | None = None  # the published number of this run, where a paper reports it


@dataclass
class Pivot:
    """One table: rows x columns of one metric, for one group of the other varying keys."""

    group: dict[str, Any]
    rows_key: str
    cols_key: str
    metric: str
    row_values: list = field(default_factory=list)
    col_values: list = field(default_factory=list)
    cells: dict[tuple, TableCell] = field(default_factory=dict)  # (hashable row value, hashable col value) -> TableCell
    tolerance: float = TOLERANCE  # the papers' numbers: differences beyond it are marked

    @property
    def title(self) -> str:
        return title_of(self.group) or "all results"

    def cell(self, row: Any, col: Any) -> TableCell | None:
        return self.cells.get((hashable(row), hashable(col)))


def pivot(
    records: Sequence[Record], rows: str = "source", cols: str = "normalizer", metric: str | None = None, tolerance: float = TOLERANCE
) -> list[Pivot]:
    """Pivot tables of `metric` (default: `default_metric`), one per group of the other varying keys; mIoU cells
    get their paper's number, marked beyond `tolerance` points."""
    metric = metric or default_metric(records)
    check_inputs(records, metric, (rows, cols))
    records = [r for r in records if metric in r.metrics]
    deltas = softmax_deltas(records, metric)
    tables = []
    for group, members in split_groups(records, (rows, cols)):
        table = Pivot(group, rows, cols, metric, tolerance=tolerance)
        for r in sorted(members, key=lambda r: r.created):  # the newest wins a shared cell
            rv, cv = r.keys.get(rows), r.keys.get(cols)
            value = r.metrics[metric]
            paper = comparison(r.config, value, tolerance) if metric == "mIoU" and r.kind == "eval" else None
            table.cells[(hashable(rv), hashable(cv))] = TableCell(value, deltas.get(id(r)), r, paper)
            if rv not in table.row_values:
                table.row_values.append(rv)
            if cv not in table.col_values:
                table.col_values.append(cv)
        table.row_values.sort(key=lambda v: sort_key(rows, v))
        table.col_values.sort(key=lambda v: sort_key(cols, v))
        tables.append(table)
    return tables


def leaderboard(records: Sequence[Record], tolerance: float = TOLERANCE) -> Pivot:
    """The field's Table 1: for every paper's entry (best published avg-8 first) its row as printed, then this
    run's row per normalizer (each cell with the paper's number and the difference), over the 8 benchmarks
    and their average (only where all 8 ran). Records no paper reports are left out (`pivot` shows them)."""
    runs: dict[tuple[str, str], dict[str, TableCell]] = {}
    for r in sorted(records, key=lambda r: r.created):  # the newest wins a shared cell
        paper = comparison(r.config, r.metrics["mIoU"], tolerance) if r.kind == "eval" and "mIoU" in r.metrics else None
        if paper is not None:
            runs.setdefault((paper.entry.protocol, r.keys["normalizer"]), {})[r.config["dataset"]] = TableCell(r.metrics["mIoU"], None, r, paper)
    table = Pivot({"leaderboard": "papers and this run"}, "method", "dataset", "mIoU", col_values=[*EIGHT, "avg-8"], tolerance=tolerance)
    entries = sorted((PUBLISHED.get(n) for n in PUBLISHED.names()), key=lambda e: -(e.average or 0.0))
    for entry in entries:
        rows = {f"{entry.protocol} (paper, {entry.clip})": {d: TableCell(v, None, None) for d, v in entry.miou.items()}}
        for (protocol, normalizer), cells in sorted(runs.items(), key=lambda kv: sort_key("normalizer", kv[0][1])):
            if protocol == entry.protocol:
                rows[f"{protocol} ({normalizer})"] = cells
        for label, cells in rows.items():
            table.row_values.append(label)
            for dataset, cell in {**cells, **_average(cells, entry, tolerance)}.items():
                table.cells[(label, dataset)] = cell
    return table


def _average(cells: dict[str, TableCell], entry: Published, tolerance: float) -> dict[str, TableCell]:
    """The avg-8 cell of a leaderboard row, with the paper's average beside a run's; none unless all 8 are in."""
    if not all(d in cells for d in EIGHT):
        return {}
    mean = sum(cells[d].value for d in EIGHT) / len(EIGHT)
    if all(cells[d].paper is None for d in EIGHT):  # the paper's own row
        return {"avg-8": TableCell(mean, None, None)}
    papers = [cells[d].paper for d in EIGHT]
    paper = Comparison.of(entry.average, mean, all(p.as_published for p in papers), any(p.limited for p in papers), entry, tolerance)
    return {"avg-8": TableCell(mean, None, None, paper)}


def format_cell(cell: TableCell | None, digits: int = 2) -> str:
    """`63.20 (+0.50)`: the value and its delta vs softmax; with a published number, `; paper 63.9 (-0.70)`,
    and `!` after it when the difference is beyond the tolerance."""
    if cell is None:
        return ""
    text = f"{cell.value:.{digits}f}"
    text = text if cell.delta is None else f"{text} ({cell.delta:+.{digits}f})"
    return text if cell.paper is None else f"{text}; {format_paper(cell.paper, digits)}"


def format_paper(paper: Comparison, digits: int = 2) -> str:
    return f"paper {round(paper.published, digits):g} ({paper.delta:+.{digits}f}){'!' if paper.beyond else ''}"


def papers_of(tables: Sequence[Pivot]) -> list[Comparison]:
    """One comparison per published entry the tables cite (for the sources and notes under them)."""
    seen: dict[str, Comparison] = {}
    for t in tables:
        for cell in t.cells.values():
            if cell.paper is not None:
                seen.setdefault(cell.paper.entry.protocol, cell.paper)
    return list(seen.values())


def sources_text(tables: Sequence[Pivot]) -> list[str]:
    """The lines under the tables that say where each paper's number comes from and its known gaps."""
    papers = papers_of(tables)
    if not papers:
        return []
    lines = [f"`paper P (D)`: the number the paper printed and this run minus it; `!`: |D| > {tables[0].tolerance:g} on a whole split."]
    for p in papers:
        e = p.entry
        lines.append(f"- {e.protocol} ({e.clip}): {e.source}" + (f". Note: {e.note}" if e.note else ""))
    return lines


def to_markdown(tables: Sequence[Pivot]) -> str:
    """One Markdown table per pivot, each under a bold title line; deltas in parentheses; the papers' sources
    and known gaps under them."""
    out = []
    for t in tables:
        header = [f"{t.rows_key} \\ {t.cols_key}", *(format_value(c) for c in t.col_values)]
        lines = [f"**{t.metric}: {t.title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for rv in t.row_values:
            cells = [format_cell(t.cell(rv, cv)) for cv in t.col_values]
            lines.append("| " + " | ".join([format_value(rv), *cells]) + " |")
        out.append("\n".join(lines))
    notes = sources_text(tables)
    if notes:
        out.append("\n".join(notes))
    return "\n\n".join(out) + "\n"


def to_csv(tables: Sequence[Pivot]) -> str:
    """Wide CSV: group keys, the row key, one column per column value, one `delta <col>` per column
    that has any delta, and `paper <col>` / `vs paper <col>` per column that has a published number. Numbers unrounded. Consecutive tables with the same rows, columns and column
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
        paper_cols = [
            cv for cv in first.col_values
            if any((c := t.cell(rv, cv)) and c.paper is not None for t in block for rv in t.row_values)
        ]  # fmt: skip
        if i:
            writer.writerow([])
        writer.writerow([
            *group_names, "metric", first.rows_key, *map(format_value, first.col_values), *(f"delta {format_value(c)}" for c in delta_cols),
            *(f"{kind} {format_value(c)}" for kind in ("paper", "vs paper") for c in paper_cols),
        ])  # fmt: skip
        for t in block:
            for rv in t.row_values:
                values = [(c.value if (c := t.cell(rv, cv)) else "") for cv in t.col_values]
                deltas = [(c.delta if (c := t.cell(rv, cv)) and c.delta is not None else "") for cv in delta_cols]
                papers = [(c.paper.published if (c := t.cell(rv, cv)) and c.paper else "") for cv in paper_cols]
                versus = [(c.paper.delta if (c := t.cell(rv, cv)) and c.paper else "") for cv in paper_cols]
                writer.writerow([*(format_value(t.group.get(k)) for k in group_names), t.metric, format_value(rv), *values, *deltas, *papers, *versus])
    return buf.getvalue()


def to_rich(table: Pivot):
    """A rich Table of one pivot: gains green, losses red, the paper's number below a value (bold red beyond
    the tolerance)."""
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
            text = "" if cell is None else f"{cell.value:.2f}"
            if cell is not None and cell.delta is not None:
                colour = "green" if cell.delta > 0 else "red" if cell.delta < 0 else "default"
                text += f" [{colour}]({cell.delta:+.2f})[/]"
            if cell is not None and cell.paper is not None:  # on a line of its own, bold red beyond the tolerance
                text += f"\n[{'bold red' if cell.paper.beyond else 'dim'}]{escape(format_paper(cell.paper))}[/]"
            cells.append(text)
        out.add_row(escape(format_value(rv)), *cells)
    return out


def to_html(tables: Sequence[Pivot]) -> str:
    """A standalone HTML page of the tables: each value with its delta vs softmax, the paper's number and the
    difference below it (red beyond the tolerance), the papers' sources and known gaps at the end."""
    from html import escape

    style = (
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}th:first-child,td:first-child{text-align:left}"
        ".paper{color:#555;font-size:85%}.beyond{color:#b00;font-weight:bold}.gain{color:#070}.loss{color:#b00}"
    )
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>report</title><style>{style}</style></head><body>"]
    for t in tables:
        parts.append(f"<h3>{escape(f'{t.metric}: {t.title}')}</h3><table><tr><th>{escape(f'{t.rows_key} / {t.cols_key}')}</th>")
        parts += [f"<th>{escape(format_value(cv))}</th>" for cv in t.col_values]
        parts.append("</tr>")
        for rv in t.row_values:
            parts.append(f"<tr><td>{escape(format_value(rv))}</td>")
            for cv in t.col_values:
                cell = t.cell(rv, cv)
                text = "" if cell is None else f"{cell.value:.2f}"
                if cell is not None and cell.delta is not None:
                    text += f" <span class='{'gain' if cell.delta > 0 else 'loss' if cell.delta < 0 else ''}'>({cell.delta:+.2f})</span>"
                if cell is not None and cell.paper is not None:
                    text += f"<br><span class='paper{' beyond' if cell.paper.beyond else ''}'>{escape(format_paper(cell.paper))}</span>"
                parts.append(f"<td>{text}</td>")
            parts.append("</tr>")
        parts.append("</table>")
    notes = sources_text(tables)
    if notes:
        parts.append(f"<p>{escape(notes[0])}</p><ul>" + "".join(f"<li>{escape(n[2:])}</li>" for n in notes[1:]) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
