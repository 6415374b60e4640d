"""Content fingerprints of single files (weights, adapters, benchmark files) for result configurations.

A result records what it was computed from; for a file named by path (a checkpoint, a DnA adapter, an
FG-OVD benchmark JSON) the path alone says nothing once the file is rewritten in place. The first 12 hex
digits of the content's SHA-256 do, and stay the same for a copy or a file merely touched. Hashed once
per path, size and modification time in a process (a ViT-L checkpoint is read once, in chunks).
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
