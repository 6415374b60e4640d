"""Where sparse attention helps: attention statistics, gain vs diffusivity, explain, gallery, demo.

May import `sweeps`, `methods`, `evaluation` and below."""

from __future__ import annotations

import importlib
import warnings


def __getattr__(name: str) -> object:
    """`analyze` (and, for one release with a DeprecationWarning, every other name of the old
    `clipseg_sparse.analysis` module, now `analysis.statistics`)."""
    statistics = importlib.import_module(".statistics", __name__)
    if name != "analyze" and not name.startswith("__") and hasattr(statistics, name):
        warnings.warn(f"clipseg_sparse.analysis.{name} moved to clipseg_sparse.analysis.statistics", DeprecationWarning, stacklevel=2)
    try:
        return getattr(statistics, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
