"""Atomic file writes: a kill or an exception never leaves a half-written file under its final name.

Low in the package because dataset converters, DnA checkpoints and result files all write through it.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a hidden temporary path beside `path`; rename it onto `path` only if the block succeeds.

    A kill or an exception never leaves a half-written file under the final name (the rename is atomic
    on one filesystem), so a re-run that skips existing files cannot skip a torn one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with naming(path):
            yield tmp
            tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError raised inside without a file name gets `path`'s: a write that fails (a full disk) names no
    file, and the one error line the CLI prints for it must say which one."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


@contextmanager
def claim(path: str | Path, tag: str = "", wait: bool = False) -> Iterator[bool]:
    """Whether this process holds the claim on `path` for the block: an exclusive, non-blocking flock on a
    lock file beside it (`.NAME.lock`), so of several runs on one output folder only one works on an item
    at a time and the others go on to the next (`wait`: block until the holder is done, then hold it). The
    holder writes `tag` into the lock file (what it will write: `claim_tag` reads it). The kernel drops the
    lock of a process that dies, so no claim outlives its run; the holder removes the file after the block.
    A filesystem without locks, or a system without flock (Windows), claims nothing (every run works on every
    item, as before)."""
    try:
        import fcntl
    except ImportError:
        yield True
        return
    path = Path(path)
    lock = path.with_name(f".{path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(lock, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            f.close()
            yield False
            return
        except OSError:  # no locks on this filesystem
            pass
        try:  # the holder before may have removed the file while this run waited: lock the one at the path
            if os.stat(lock).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    with f:
        f.truncate(0)
        f.write(tag)
        f.flush()
        try:
            yield True
        finally:
            lock.unlink(missing_ok=True)


def claim_tag(path: str | Path, patience: float = 1.0) -> str:
    """The tag of the run holding the claim on `path` ("" when none is, or it wrote none within `patience`
    seconds: a holder writes its tag just after it locks)."""
    lock = Path(path).with_name(f".{Path(path).name}.lock")
    deadline = time.monotonic() + patience
    while True:
        try:
            tag = lock.read_text()
        except OSError:  # released since (the holder removes the file)
            return ""
        if tag or time.monotonic() > deadline:
            return tag
        time.sleep(0.02)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON via a temporary file and rename, so a kill never leaves a half-written result."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=jsonable) + "\n", encoding="utf-8")


def create_json_exclusive(path: str | Path, data: Any) -> bool:
    """Write JSON to `path` only if no file is there, atomically across processes; False if one was.

    The file is written under a temporary name and hard-linked onto `path` (link fails on an existing
    name, and the content is complete the moment the name appears); filesystems without hard links fall
    back to an exclusive create. This is how concurrent runs claim an output without overwriting each other.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, default=jsonable) + "\n"
    tmp = path.with_name(f".{path.name}.claim{os.getpid()}")
    try:
        with naming(path):
            tmp.write_text(text, encoding="utf-8")
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError:  # no hard links here (some network / FUSE filesystems)
                try:
                    with open(path, "x", encoding="utf-8") as f:
                        f.write(text)
                except FileExistsError:
                    return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # numpy / torch scalars and arrays
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
