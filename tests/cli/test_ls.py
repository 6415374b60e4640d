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


def test_ls_presets_says_what_each_preset_needs_from_its_plan(monkeypatch):
    """The needs column is read off the run's plan: backbones of taps and stages, region maps, a bank, a deeper CLIP."""
    from clipseg_sparse.cli.ls import preset_needs

    assert preset_needs("sclip") == preset_needs("sclip-entmax") == "CLIP only"
    assert preset_needs("trident") == "dino_vitb16, sam_vitb"  # the DINO tap and the SAM stage
    assert preset_needs("corrclip") == "dino_vitb8, --regions"
    assert preset_needs("corrclipv2") == "c_radio_v3_l, --regions, --bank"
    assert preset_needs("lposs+") == "dino_vitb16"  # the lp:patch windows stage's backbone
    # its multi-level sum reads blocks 9..19 and it edits one block after them: 20; ViT-B/16 has 12 (open_clip's config)
    assert preset_needs("scclip-l14") == "a CLIP of 20+ blocks (ViT-B-16 has 12)"
    monkeypatch.setenv("COLUMNS", "400")
    row = next(line for line in CliRunner().invoke(app, ["ls", "presets"]).stdout.splitlines() if line.startswith("│ corrclip "))
    assert "dino_vitb8, --regions" in row


def test_ls_markdown_prints_the_registry_as_a_markdown_table():
    from clipseg_sparse.cli.ls import markdown_table, registry_rows

    out = CliRunner().invoke(app, ["ls", "stages", "--markdown"]).stdout
    header, rows = registry_rows(Listable.stages)
    lines = out.splitlines()
    assert lines[0] == "| stage | defined in | kind and meaning |" == "| " + " | ".join(header) + " |"
    assert lines[1] == "|---|---|---|" and len(lines) == 2 + len(rows)
    assert lines[2].startswith(f"| `{rows[0][0]}` | `{rows[0][1]}` | ")
    assert markdown_table(["preset", "spec", "follows"], [["a", "x[cos]", "b | c [d] *e*\nf"]]) == (
        "| preset | spec | follows |\n|---|---|---|\n| `a` | `x[cos]` | b \\| c \\[d\\] \\*e\\*<br>f |\n"
    )


def test_ls_presets_shows_the_measured_time_over_sclips(tmp_path, monkeypatch):
    import json

    import clipseg_sparse.bench.pipeline as pipeline

    file = tmp_path / "cost.json"
    file.write_text(json.dumps({"presets": {"sclip": {"whole": 2.0, "networks": 1.6}, "trident": {"whole": 59.0, "networks": 50.0}}}))
    monkeypatch.setattr(pipeline, "COST_FILE", file)
    out = CliRunner().invoke(app, ["ls", "presets", "--markdown"]).stdout.splitlines()
    header, sclip, trident, naclip = (next(r for r in out if r.startswith(f"| {n} ")) for n in ("preset", "`sclip`", "`trident`", "`naclip`"))
    column = [c.strip() for c in header.split("|")].index("CPU time (x sclip)")
    assert [[c.strip() for c in r.split("|")][column] for r in (sclip, trident, naclip)] == ["1.0x", "29.5x", ""]
