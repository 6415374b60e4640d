"""Result files and resumable progress, shared by `eval`, `fgovd` and `sweep`.

A run writes one JSON result file holding its metrics next to its full resolved configuration, the
package versions and timings (lm-evaluation-harness style). Long runs also keep an append-only JSONL
*item log* beside it (one line per finished image or annotation); an interrupted run reads the log back
and continues where it stopped, and the final metrics are recomputed from the log, so a resumed run
gives the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import UserValueError
from ..runtime.atomic import jsonable, naming

RESULT_SCHEMA = 1


def config_hash(config: dict) -> str:
    """A short stable hash of a configuration (keys sorted), used to key result files and logs."""
    blob = json.dumps(config, sort_keys=True, default=jsonable)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("clipseg-sparse", "torch", "open_clip_torch", "entmax", "numpy", "pillow"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class ConfigMismatchError(UserValueError):
    """An existing log or result was made with a different configuration."""


class ItemLog:
    """Append-only JSONL of finished items, headed by the configuration that produced them.

    The first line is {"config": ..., "hash": ...}; each further line is {"id": ..., **record}. A line
    torn by a kill is ignored on reading. Opening a log whose header hash differs raises
    ConfigMismatchError rather than mixing results of two configurations.
    """

    def __init__(self, path: str | Path, config: dict) -> None:
        self.path = Path(path)
        self.config = config
        self.hash = config_hash(config)
        self._done: dict[str, dict] = {}
        if self.path.exists():
            self._drop_torn_tail()
        if self.path.exists() and self.path.stat().st_size > 0:
            self._read()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", encoding="utf-8") as f:
                f.write(json.dumps({"config": config, "hash": self.hash}, default=jsonable) + "\n")

    def _lines(self) -> Iterator[dict]:
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn final line of an interrupted run

    def _drop_torn_tail(self) -> None:
        """Cut a final line torn by a kill, so the next append starts cleanly (a torn header empties the log)."""
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def _read(self) -> None:
        lines = self._lines()
        header = next(lines, None)
        if not header or header.get("hash") != self.hash:
            raise ConfigMismatchError(
                f"{self.path}: progress log of a different configuration{differences((header or {}).get('config'), self.config)}; "
                f"use another output or --overwrite"
            )
        for rec in lines:
            if "id" in rec:
                self._done[str(rec["id"])] = rec

    @property
    def done(self) -> dict[str, dict]:
        return self._done

    def append(self, item_id: str, record: dict) -> None:
        rec = {"id": str(item_id), **record}
        with naming(self.path), self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._done[str(item_id)] = rec


def logged_or_computed(
    log: ItemLog | None, item_id: str, compute: Callable[[], dict], reusable: bool = True
) -> tuple[dict, bool]:
    """The record `log` holds for `item_id`, else `compute()` timed (its "seconds") and appended.

    Returns (record, reused). `reusable=False` recomputes a logged item (e.g. its side output is missing).
    This is the one resume rule of `eval` and `fgovd`.
    """
    done = log.done.get(str(item_id)) if log is not None else None
    if done is not None and reusable:
        return done, True
    start = time.perf_counter()
    record = compute()
    record["seconds"] = time.perf_counter() - start
    if log is not None:
        log.append(item_id, record)
    return record, False


def progress_path(out: Path, rank: int = 0, world: int = 1) -> Path:
    """The item log that checkpoints the run whose result goes to `out` (one per rank under torchrun)."""
    return out.with_suffix(".progress.jsonl" if world == 1 else f".progress.rank{rank}of{world}.jsonl")


def load_finished(out: Path, config: dict) -> dict:
    """The finished result in `out` if it was made with `config`; ConfigMismatchError otherwise."""
    try:
        record = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigMismatchError(f"{out}: exists but is not a readable result ({e}); use --overwrite or another --out") from e
    if config_hash(record.get("config", {})) != config_hash(config):
        raise ConfigMismatchError(
            f"{out}: holds a result of a different configuration{differences(record.get('config'), config)}; "
            f"use --overwrite (recompute) or another --out"
        )
    return record


#: configuration keys that identify the data a result was computed on (docs/evaluation.md)
DATA_KEYS = ("root", "data", "images_root", "benchmark_files")


#: the configuration key holding a checkpoint file's content digest (`DenseCLIP.pretrained_sha256`)
WEIGHTS_KEY = "pretrained_sha256"


def differences(old: Any, new: dict) -> str:
    """` (differs in: a, b)` listing the keys whose values differ, with a word when the data changed."""
    if not isinstance(old, dict):
        return ""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not keys:
        return ""
    changed = " - the data changed since it was made" if any(k in DATA_KEYS for k in keys) else ""
    if WEIGHTS_KEY in keys and new.get(WEIGHTS_KEY):
        changed += (" - the checkpoint's content is not the one it was made with" if old.get(WEIGHTS_KEY) else
                    " - it was made before checkpoint contents were recorded, so its weights cannot be checked")
    return f" (differs in: {', '.join(keys[:8])}{changed})"


def open_run(
    out: Path | None, config: dict, *, overwrite: bool = False, resume: bool = True, rank: int = 0, world: int = 1
) -> tuple[dict | None, ItemLog | None]:
    """Get the result file `out` of a run with `config` ready: (finished, log).

    finished: the record `out` already holds when not `overwrite` (ConfigMismatchError if it is of another
    configuration); the run is then over. Otherwise `out` is removed if `overwrite`, and log is the
    item log beside it, restarted when `overwrite` or not `resume`. The log's configuration leaves out
    `limit`, so a run over more items resumes one over fewer. (None, None) without `out`.
    """
    if out is None:
        return None, None
    out = Path(out)
    if out.exists():
        if not overwrite:
            return load_finished(out, config), None
        out.unlink(missing_ok=True)  # missing_ok: every torchrun rank gets here
    log_path = progress_path(out, rank, world)
    if overwrite or not resume:
        log_path.unlink(missing_ok=True)
    return None, ItemLog(log_path, {k: v for k, v in config.items() if k != "limit"})


def result_record(kind: str, config: dict, metrics: dict, timing: dict, **fields: Any) -> dict:
    """A schema-1 result file's content: kind, config, metrics, the kind's own `fields`, package
    versions, timing and the creation time (UTC)."""
    return {
        "schema": RESULT_SCHEMA,
        "kind": kind,
        "config": config,
        "metrics": metrics,
        **fields,
        "versions": package_versions(),
        "timing": timing,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
