"""`clipseg-sparse ls KIND`: one loop over the registries prints every entry, and where plug-ins are defined."""

from __future__ import annotations

import importlib

import pytest
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.cli.ls import REGISTRIES, Listable


@pytest.mark.parametrize("what", sorted(REGISTRIES, key=str))
def test_ls_lists_every_entry_of_its_registry(what, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    module, attr, title, show_where = REGISTRIES[what]
    registry = getattr(importlib.import_module(module), attr)
    result = CliRunner().invoke(app, ["ls", what.value])
    assert result.exit_code == 0, result.output
    assert title in result.stdout
    for name in registry:
        assert f" {name} " in result.stdout, name
        if show_where:
            assert registry.where(name).removeprefix("clipseg_sparse.") in result.stdout


def test_ls_presets_names_each_method_module_and_normalizers_come_from_one_list(monkeypatch):
    from clipseg_sparse.attention.normalizers import NORMALIZERS, Normalizer, normalizer_forms

    monkeypatch.setenv("COLUMNS", "400")
    lines = CliRunner().invoke(app, ["ls", "presets"]).stdout.splitlines()
    row = next(line for line in lines if line.startswith("│ sclip-entmax "))
    assert "methods.sclip" in row and "qq+kk/entmax:1.5" in row
    assert normalizer_forms() == "softmax, entmax:ALPHA, sparsemax, randmask:ALPHA" and len(NORMALIZERS) == 4
    with pytest.raises(ValueError, match="choose softmax, entmax:ALPHA, sparsemax, randmask:ALPHA"):
        Normalizer.parse("softermax")
    assert set(Listable) == set(REGISTRIES) | {Listable.models}
