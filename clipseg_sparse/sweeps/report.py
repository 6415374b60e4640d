"""Pivot tables of a metric over result records, rendered as Markdown, CSV or a rich table.

A pivot puts one key on the rows, one on the columns and a metric in the cells; every other key that
varies across the records and is not implied by the rows and columns splits them into separate tables
(`records.split_groups`). Each cell carries its delta against the softmax run of the same source with
everything else equal (`records.softmax_deltas`).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from typing import Any, Sequence

from .records import Record, check_inputs, default_metric, format_value, hashable, softmax_deltas, sort_key, split_groups, title_of


@dataclass
class TableCell:
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
    cells: dict[tuple, TableCell] = field(default_factory=dict)  # (hashable row value, hashable col value) -> TableCell

    @property
    def title(self) -> str:
        return title_of(self.group) or "all results"

    def cell(self, row: Any, col: Any) -> TableCell | None:
        return self.cells.get((hashable(row), hashable(col)))


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
            table.cells[(hashable(rv), hashable(cv))] = TableCell(r.metrics[metric], deltas.get(id(r)), r)
            if rv not in table.row_values:
                table.row_values.append(rv)
            if cv not in table.col_values:
                table.col_values.append(cv)
        table.row_values.sort(key=lambda v: sort_key(rows, v))
        table.col_values.sort(key=lambda v: sort_key(cols, v))
        tables.append(table)
    return tables


def format_cell(cell: TableCell | None, digits: int = 2) -> str:
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
