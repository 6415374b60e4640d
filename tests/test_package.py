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

