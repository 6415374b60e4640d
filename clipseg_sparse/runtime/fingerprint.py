"""Content fingerprints of single files (weights, adapters, benchmark files) for result configurations.

A result records what it was computed from; for a file named by path (a checkpoint, a DnA adapter, an
FG-OVD benchmark JSON) the path alone says nothing once the file is rewritten in place. The first 12 hex
digits of the content's SHA-256 do, and stay the same for a copy or a file merely touched. Hashed once
per path, size and modification time in a process (a ViT-L checkpoint is read once, in chunks).

A folder of stores (an image bank) records a stamp of each file (size, modification time, digest) and checks
it cheaply later: a file of the recorded size and time is not read again, any other is digested.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

DIGITS = 12


@lru_cache(maxsize=None)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()[:DIGITS]


def file_digest(path: str | Path) -> str:
    """The first 12 hex digits of the file's SHA-256 (OSError when it cannot be read)."""
    path = Path(path)
    st = path.stat()
    return _digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


def file_id(path: str | Path) -> str:
    """`name@digest` of a file (`name@missing` when it is not there): what identifies it in a configuration,
    so another file of the same name is never mistaken for it."""
    path = Path(path)
    return f"{path.name}@{file_digest(path) if path.is_file() else 'missing'}"


def file_stamp(path: str | Path) -> dict:
    """{"bytes", "mtime_ns", "sha256"} of a file (sha256: `file_digest`), recorded to check it later (`stamp_matches`)."""
    st = Path(path).stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_digest(path)}


def stamp_matches(path: str | Path, stamp: dict) -> bool:
    """Whether the file is the one `stamp` recorded: the same size and, unless it also has the recorded
    modification time (then it is not read), the same digest (a copy matches, a rewrite does not)."""
    try:
        st = Path(path).stat()
    except OSError:
        return False
    return st.st_size == stamp.get("bytes") and (st.st_mtime_ns == stamp.get("mtime_ns") or file_digest(path) == stamp.get("sha256"))
