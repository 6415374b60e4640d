"""Grids over specs, alpha, resolution, models and datasets; the report tables and plots.

`grid` says what to run, `run` runs it, `report` reads the result files back into tables and plots. May import `methods`, `evaluation` and below.
"""

from __future__ import annotations

import importlib

_MODULES = ("grid", "run")


def __getattr__(name: str) -> object:
    """Every public name of `grid` and `run`, so the old `clipseg_sparse.sweep` path (served by the
    package's `_MOVED`, with a DeprecationWarning) still finds each name it had."""
    if not name.startswith("_"):
        for module in _MODULES:
            mod = importlib.import_module(f".{module}", __name__)
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
