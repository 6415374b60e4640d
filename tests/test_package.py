"""The package's public names: every one resolves (the lazy table names real objects)."""

import clipseg_sparse


def test_every_exported_name_resolves():
    for name in clipseg_sparse.__all__:
        assert getattr(clipseg_sparse, name) is not None, name


def test_what_the_cli_runs_is_one_import_away():
    for name in ("load_clip", "Segmenter", "evaluate_fgovd", "run_sweep", "Grid", "collect", "pivot"):
        assert name in clipseg_sparse.__all__, name


def test_no_exported_name_is_shadowed_by_a_submodule():
    """Importing submodule `x` sets the package attribute `x`, so an export named like a submodule would
    be the function or the module depending on what was imported before."""
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(clipseg_sparse.__path__)}
    assert not submodules & set(clipseg_sparse.__all__)



def test_a_split_module_keeps_every_public_name_at_its_old_path(monkeypatch):
    """`clipseg_sparse.proxy` went to attention/grid.py, segment/windows.py and the CorrCLIP and Trident rooms,
    `protocols` to evaluation/ and the ResCLIP and Trident rooms: the old paths warn and still hold every name."""
    import importlib
    import sys

    import pytest

    old_names = {
        "proxy": ["CORRCLIP_EPS", "CORRCLIP_TAU", "corrclip_attention", "feature_cosine", "merge_regions", "region_support",
                  "region_vote", "resize_regions", "restrict", "sam_filtered_attention", "splice_windows", "values_to_grid"],
        "protocols": ["PROTOCOLS", "Protocol", "RESCLIP_CONSTANTS", "TRIDENT_COARSE"],
    }  # fmt: skip
    for old, names in old_names.items():
        monkeypatch.delitem(sys.modules, f"clipseg_sparse.{old}", raising=False)
        with pytest.warns(DeprecationWarning, match=f"clipseg_sparse.{old} moved to"):
            module = importlib.import_module(f"clipseg_sparse.{old}")
        assert [n for n in names if not hasattr(module, n)] == [], old
