"""Grids over specs, alpha, resolution, models and datasets; the report tables and plots.

`grid` says what to run, `run` runs it, `records` reads the result files back, `report` renders them
as pivot tables and `plots` as figures. May import `methods`, `evaluation` and below.
"""

from __future__ import annotations

import importlib

_MODULES = ("grid", "run", "records", "report", "plots")


def __getattr__(name: str) -> object:
    """Every public name of the five modules, so the old `clipseg_sparse.sweep` and `clipseg_sparse.report`
    paths (served by the package's `_MOVED`, with a DeprecationWarning) still find each name they had.
    A name in two modules is the first module's: `Cell` is the grid's (the table cell is `report.TableCell`)."""
    if not name.startswith("_"):
        for module in _MODULES:
            mod = importlib.import_module(f".{module}", __name__)
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
