"""FG-OVD rank metrics from per-annotation caption scores.

An annotation's score vector is [positive, negative_1, negative_2, ...] (negatives in the file's order).
With N negatives, annotations that have fewer than N are dropped (as the official `ranks.py` does) and
the others are cut to their first N. The rank of the positive is the number of captions scoring >= it
(ties and NaN scores count against the positive; rank 1 = strictly highest). Top-1 accuracy is the
percentage of rank-1 annotations. The median rank is the ordinary median (numpy); the official script
instead takes `sorted(ranks)[len // 2 + 1]`, one or two places above it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .data import DIFFICULTY_SPLITS

MEASURES = ("top1", "mean_rank", "median_rank")


def supported_negatives(negative_counts: Sequence[int], negatives: int) -> int | None:
    """The N a split is reported at: the largest N <= `negatives` that at least half of its regions
    reach (regions with fewer are dropped at N, as the official ranks.py does). The four difficulty
    files give every region 10 negatives; the attribute files mostly 2 (transparency.json: 377 of 409
    regions have 2, 7 have 8), where a top-1 at N = 8 would rest on 7 regions. None for no region."""
    counts = [min(c, negatives) for c in negative_counts]
    best = None
    for n in range(1, negatives + 1):
        if 2 * sum(c >= n for c in counts) >= len(counts) and any(c >= n for c in counts):
            best = n
    return best


def positive_rank(scores: Sequence[float]) -> int:
    """Number of captions (the positive included) scoring >= the positive, scores[0].

    A NaN on either side counts against the positive (`not s < positive`), so the rank is always in
    1..len(scores) and a NaN score is never a win.
    """
    positive = scores[0]
    return 1 + sum(1 for s in scores[1:] if not s < positive)


def rank_metrics(score_lists: Iterable[Sequence[float]], negatives: int) -> dict[str, float]:
    """count, and (when count > 0) top1 (%), mean_rank, median_rank over annotations with >= N negatives."""
    ranks = [positive_rank(s[: negatives + 1]) for s in score_lists if len(s) - 1 >= negatives]
    out: dict[str, float] = {"count": float(len(ranks))}
    if ranks:
        r = np.asarray(ranks, dtype=np.float64)
        out.update(top1=float((r == 1).mean() * 100), mean_rank=float(r.mean()), median_rank=float(np.median(r)))
    return out


def fgovd_metrics(per_annotation: Sequence[dict], negatives: int, splits: Sequence[str] | None = None) -> dict[str, float]:
    """Flat metrics `{split}.{measure}@{N}` for N = 1..negatives, plus `mean.{measure}@{N}`; and each
    split at the N it supports (`supported_negatives`): `{split}.n`, `{split}.{measure}`, `{split}.count`
    (the `mean.*` of those only when Hard, Medium and Easy share their N).

    per_annotation: records with "split" and "scores". splits: the order of the keys (default: first seen).
    `mean.*` is the plain mean over Hard, Medium and Easy, written only when all three have annotations
    at that N. `{split}.count@{N}` is always written; the measures only when the count is > 0.
    """
    by_split: dict[str, list] = {s: [] for s in splits or ()}
    for rec in per_annotation:
        by_split.setdefault(rec["split"], []).append(rec["scores"])
    metrics: dict[str, float] = {}
    for split, scores in by_split.items():  # each split at its own N: `{split}.top1` = `{split}.top1@{split}.n`
        n = supported_negatives([len(s) - 1 for s in scores], negatives)
        if n is not None:
            metrics[f"{split}.n"] = float(n)
            metrics |= {f"{split}.{key}": value for key, value in rank_metrics(scores, n).items()}
    shared = {metrics.get(f"{s}.n") for s in DIFFICULTY_SPLITS}
    if len(shared) == 1 and None not in shared:  # the mean only of numbers at one N
        metrics["mean.n"] = shared.pop()
        for m in MEASURES:
            metrics[f"mean.{m}"] = float(np.mean([metrics[f"{s}.{m}"] for s in DIFFICULTY_SPLITS]))
    for n in range(1, negatives + 1):
        for split, scores in by_split.items():
            for key, value in rank_metrics(scores, n).items():
                metrics[f"{split}.{key}@{n}"] = value
        if all(metrics.get(f"{s}.count@{n}", 0) > 0 for s in DIFFICULTY_SPLITS):
            for m in MEASURES:
                metrics[f"mean.{m}@{n}"] = float(np.mean([metrics[f"{s}.{m}@{n}"] for s in DIFFICULTY_SPLITS]))
    return metrics
