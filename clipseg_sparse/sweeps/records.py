"""Result files read into records, and the grouping that tables and plots share.

A result file (see files/results.py) is one run: {"kind": "eval"|"fgovd", "config": {...}, "metrics": {...}}.
`collect` reads many into `Record`s. Each record exposes *keys*: its flat config plus keys derived from
the attention string (`source`, `normalizer`, `alpha`, `block` = the remaining block edits). Every key
that varies across the records and is not implied by the keys a table or plot is drawn over splits them
into separate groups (one per dataset and model, say). `softmax_deltas` pairs each sparse run with the
softmax run of the same source with everything else equal (the same config with only the normalizer set
to softmax).
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import UserValueError

# Knobs that do not change a number: ignored when grouping records and when matching the softmax run.
NEUTRAL_KEYS = frozenset({"device", "batch_size", "num_workers"})
# Keys that name a group first (the rest follow alphabetically, the full attention string last), so a
# table is titled "model=..., dataset=..." rather than by something those imply (a class list, say).
PREFERRED_KEYS = (
    "kind", "model", "pretrained", "precision", "dataset", "benchmarks", "protocol", "prompts", "resolution",
    "source", "normalizer", "alpha", "block",
)  # fmt: skip
DERIVED_KEYS = ("source", "normalizer", "alpha", "block")
NORMALIZER_ORDER = ("softmax", "entmax", "sparsemax", "randmask")


class ReportError(UserValueError):
    """Bad input to the reporter: no results, an unknown metric or key."""


def attention_keys(attention: str) -> dict[str, Any]:
    """`qq+kk/entmax:1.5/noffn` -> source qq+kk, normalizer entmax:1.5, alpha 1.5, block noffn; a pipeline
    (`sam3:0.5`) -> source sam3:0.5, normalizer none, alpha None.

    alpha is 1 for softmax and 2 for sparsemax; `block` is "-" when no other edit is made.
    """
    from ..attention import AttentionSpec
    from ..attention.normalizers import Normalizer
    from ..segment.pipelines import find_pipeline

    pipeline = find_pipeline(attention)
    if pipeline is not None:  # a pipeline (sam3): not a spec, no normalizer; its text is its source
        return {"source": pipeline.name, "normalizer": "none", "alpha": None, "block": "-"}
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
    from ..segment.pipelines import find_pipeline

    if find_pipeline(attention) is not None:  # a pipeline has no normalizer: it is its own reference
        return attention
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
        prompts = self.config.get("prompts")
        keys["prompts"] = f"{prompts['file']}@{prompts['sha256'][:8]}" if isinstance(prompts, dict) else "-"  # a row says which prompt file it used
        if "split" in keys:  # FG-OVD: the split plays the part of the dataset
            keys["dataset"] = keys["split"]
        return keys

    def identity(self, softmax: bool = False) -> str:
        """What makes two runs the same run (neutral knobs aside); softmax=True: of its softmax reference."""
        config = {k: v for k, v in self.config.items() if k not in NEUTRAL_KEYS}
        if softmax and "attention" in config:
            config["attention"] = softmax_attention(config["attention"])
        return json.dumps([self.kind, config], sort_keys=True, default=str)


def result_files(source: str | Path) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        return sorted(p for p in path.rglob("*.json") if not p.name.startswith("."))
    if path.is_file():
        return [path]
    matches = sorted(glob.glob(str(source), recursive=True))
    if not matches:
        raise ReportError(f"{source}: no such file, folder or glob match")
    return [p for m in matches for p in result_files(m)]


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

    Non-result JSON in a folder or glob is skipped; a file named on its own must be a result. When two files hold the same run, the newer (`created`) one is kept.
    """
    newest: dict[str, Record] = {}
    for source in sources:
        for path in result_files(source):
            data = read_result(path)
            if data is None and Path(source).is_file():  # named on its own: it was meant as a result
                raise ReportError(f"{path}: not a result file of this tool (unreadable, torn, or JSON of another kind)")
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
def hashable(value: Any) -> Any:
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
        k = tuple(hashable(r.keys.get(b)) for b in by)
        v = hashable(r.keys.get(key))
        if seen.setdefault(k, v) != v:
            return False
    return True


def group_keys(records: Sequence[Record], fixed: Sequence[str]) -> list[str]:
    """The fewest varying keys that, with the `fixed` ones, tell the records apart (preferred keys first)."""
    all_keys = {k for r in records for k in r.keys} - NEUTRAL_KEYS - set(fixed)
    varying = [k for k in all_keys if len({hashable(r.keys.get(k)) for r in records}) > 1]
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
        groups.setdefault(tuple(hashable(r.keys.get(k)) for k in keys), []).append(r)
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
