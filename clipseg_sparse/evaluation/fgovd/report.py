"""The FG-OVD result table: one row per split (and the Hard/Medium/Easy mean)."""

from __future__ import annotations

from typing import Sequence

from rich.table import Table


def table_n(metrics: dict[str, float], split: str, negatives: int) -> int | None:
    """The N a split is shown at: the N it supports (`{split}.n`, see metrics.supported_negatives); in
    results written before that, `negatives` or the largest smaller N that has regions (None: none)."""
    if f"{split}.n" in metrics:
        return int(metrics[f"{split}.n"])
    for n in range(negatives, 0, -1):
        if metrics.get(f"{split}.count@{n}", 1) > 0 and f"{split}.top1@{n}" in metrics:
            return n
    return None


def metrics_table(metrics: dict[str, float], splits: Sequence[str], negatives: int) -> Table:
    """Per split: N, regions, top-1 (%), mean and median rank of the positive among N hard negatives.

    Attribute benchmarks have few negatives per region (transparency mostly 2, at most 8), so each split
    is shown at the N most of its regions reach; the N column says which.
    """
    table = Table(title=f"FG-OVD (up to {negatives} hard negatives; rank 1 = best)")
    table.add_column("split")
    for name in ("N", "regions", "top-1 %", "mean rank", "median rank"):
        table.add_column(name, justify="right")
    for split in [*splits, "mean"]:
        n = table_n(metrics, split, negatives)
        if n is None:
            if split != "mean":
                table.add_row(split, "-", "0", "-", "-", "-")
            continue
        count = metrics.get(f"{split}.count@{n}")
        table.add_row(
            split,
            str(n),
            "" if count is None else str(int(count)),
            f"{metrics[f'{split}.top1@{n}']:.1f}",
            f"{metrics[f'{split}.mean_rank@{n}']:.2f}",
            f"{metrics[f'{split}.median_rank@{n}']:g}",
        )
    return table
