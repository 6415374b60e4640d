"""Timing suites (`clipseg-sparse bench`): forward, segment, text, published-code comparisons.

May import `evaluation`, `segment` and below."""

from __future__ import annotations

import importlib
import warnings


def __getattr__(name: str) -> object:
    """`run_all` (and, for one release with a DeprecationWarning, the other names of the old
    `clipseg_sparse.bench` module, now `bench.run` and `bench.timing`)."""
    for module in ("run", "timing"):
        mod = importlib.import_module(f".{module}", __name__)
        if hasattr(mod, name) and not name.startswith("__"):
            if name != "run_all":
                warnings.warn(f"clipseg_sparse.bench.{name} moved to clipseg_sparse.bench.{module}", DeprecationWarning, stacklevel=2)
            return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
