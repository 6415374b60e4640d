"""Grid expansion, cell identity and shipped grids (no model is run here)."""

import pytest

from clipseg_sparse.sweeps.grid import GRIDS, Grid, read_grid_file
from clipseg_sparse.sweeps.run import SweepPaths, parse_roots


def test_presets_with_source_and_normalizer_overrides():
    grid = Grid.from_dict({"datasets": ["voc21"], "presets": ["sclip", "naclip"], "sources": ["qq", "kk"],
                           "normalizers": ["softmax"], "alphas": [1.5]})  # fmt: skip
    assert grid.attention_specs() == [
        "qq/softmax", "qq/entmax:1.5", "kk/softmax", "kk/entmax:1.5",
        "qq/softmax/gauss:5/nores/noffn", "qq/entmax:1.5/gauss:5/nores/noffn",
        "kk/softmax/gauss:5/nores/noffn", "kk/entmax:1.5/gauss:5/nores/noffn",
    ]  # fmt: skip


def test_defaults_keep_preset_parts_and_plain_base():
    assert Grid(datasets=["voc21"], presets=["sclip", "clearclip"]).attention_specs() == ["qq+kk/softmax", "qq/softmax/nores/noffn"]
    assert Grid(datasets=["voc21"], sources=["qq+kk", "vv"], normalizers=["entmax:2"]).attention_specs() == [
        "qq+kk/sparsemax", "vv/sparsemax"
    ]
    # repeats (sparsemax == entmax:2; an explicit spec equal to a generated one) collapse
    grid = Grid(datasets=["voc21"], normalizers=["sparsemax", "entmax:2"], specs=["qk/sparsemax", "kk/entmax:1.5"])
    assert grid.attention_specs() == ["qk/sparsemax", "kk/entmax:1.5"]


def test_cells_cross_everything_ordered_by_model(tmp_path):
    bench = tmp_path / "color.json"
    bench.write_text("{}")
    grid = Grid(models=["ViT-B-16", "ViT-L-14"], datasets=["voc21", "ade20k"], fgovd=[str(bench)],
                normalizers=["softmax", "entmax:1.5"], resolutions=[224, 448])  # fmt: skip
    cells = grid.cells()
    assert len(cells) == 2 * 3 * 2 * 2
    assert [c.model for c in cells] == ["ViT-B-16"] * 12 + ["ViT-L-14"] * 12
    assert len({c.hash for c in cells}) == len(cells)
    assert {c.kind for c in cells if c.data == str(bench)} == {"fgovd"}
    assert cells[0].label == "ViT-B-16 voc21 qk/softmax @224"


def test_cell_hash_is_stable_and_covers_every_knob(tmp_path):
    a = Grid(datasets=["voc21"]).cells()[0]
    assert a.hash == Grid(datasets=["voc21"]).cells()[0].hash
    for change in ({"limit": 3}, {"pretrained": "laion2b_s34b_b88k"}, {"protocol": "clearclip"}, {"templates": "single"},
                   {"overrides": {"window": 336}}, {"class_names": "plain"}, {"precision": "fp16"}):  # fmt: skip
        assert Grid(datasets=["voc21"], **change).cells()[0].hash != a.hash, change
    # FG-OVD data are identified by their content, not where they lie
    one, two = tmp_path / "a" / "color.json", tmp_path / "b" / "color.json"
    for p, text in ((one, "{}"), (two, "{}")):
        p.parent.mkdir()
        p.write_text(text)
    assert Grid(fgovd=[str(one)]).cells()[0].hash == Grid(fgovd=[str(two)]).cells()[0].hash
    two.write_text('{"images": []}')
    assert Grid(fgovd=[str(one)]).cells()[0].hash != Grid(fgovd=[str(two)]).cells()[0].hash


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"datasets": ["voc21"], "presets": ["sclipp"]}, "Did you mean 'sclip'"),
        ({"datasets": ["voc21"], "sources": ["qv"]}, "unknown attention source"),
        ({"datasets": ["voc21"], "normalizers": ["entmax:3"]}, "alpha must be in"),
        ({"datasets": ["voc21"], "specs": ["qq/softmx"]}, "bad option"),
        ({"datasets": ["voc21"], "resolution": [224]}, "did you mean 'resolutions'"),
        ({"presets": ["sclip"]}, "names no data"),
        ({"datasets": ["voc21"], "resolutions": [0]}, "positive"),
        ({"datasets": ["voc12"]}, "unknown dataset 'voc12'. Did you mean 'voc21'"),
        ({"datasets": ["voc21"], "protocol": "sclp"}, "Did you mean 'sclip'"),
        ({"datasets": ["voc21"], "overrides": {"windw": 224}}, "unknown inference setting"),
        ({"datasets": ["voc21"], "overrides": {"window": 224, "stride": 300}}, "stride must be in"),
    ],
)
def test_bad_grids_fail_before_running(bad, message):
    with pytest.raises(ValueError, match=message):
        Grid.from_dict(bad)


def test_grid_file_relative_paths_and_overrides(tmp_path):
    (tmp_path / "g.toml").write_text(
        'datasets = ["voc21", "ade20k"]\nalphas = [1.5]\nfgovd = ["bench/color.json"]\nimages_root = "coco"\n'
        'description = "demo"\n[roots]\nvoc21 = "data/voc"\n[report]\nrows = "dataset"\n'
    )
    gf = read_grid_file(tmp_path / "g.toml", overrides={"datasets": ["voc21"]})
    assert gf.grid.datasets == ("voc21",) and gf.grid.normalizers == ("entmax:1.5",)
    assert gf.grid.fgovd == (str(tmp_path / "bench" / "color.json"),)
    assert gf.roots == {"voc21": tmp_path / "data" / "voc"} and gf.images_root == tmp_path / "coco"
    assert gf.description == "demo" and gf.report == {"rows": "dataset"}
    with pytest.raises(ValueError, match="not valid TOML"):
        (tmp_path / "bad.toml").write_text("datasets = [")
        read_grid_file(tmp_path / "bad.toml")


def test_roots():
    roots = parse_roots(["/data", "voc21=/voc"])
    paths = SweepPaths(out=None, roots=roots)
    assert str(paths.root("voc21")) == "/voc" and str(paths.root("ade20k")) == "/data"
    with pytest.raises(ValueError, match="no data root"):
        SweepPaths(out=None).root("ade20k")


def test_shipped_grids_parse_and_have_the_published_shape():
    assert set(GRIDS.names()) >= {"sources-normalizers", "resolution", "fgovd"}
    table = read_grid_file(GRIDS.get("sources-normalizers")).grid
    assert table.models == ("ViT-B-16", "ViT-L-14") and table.datasets == ("voc21", "context60", "ade20k")
    assert len(table.cells()) == 2 * 3 * 5 * 5
    res = read_grid_file(GRIDS.get("resolution")).grid
    assert res.resolutions == (224, 448) and len(res.cells()) == 2 * 3 * 3 * 2 * 2
    fg = read_grid_file(GRIDS.get("fgovd"), benchmarks_dir="/nowhere").grid
    assert len(fg.fgovd) == 8 and all(f.startswith("/nowhere/") for f in fg.fgovd)
    for name in GRIDS:
        assert GRIDS.help(name)


def test_fgovd_cells_need_known_split_names_and_regions(tmp_path):
    with pytest.raises(ValueError, match="unknown FG-OVD benchmark file 'colour'"):
        Grid(fgovd=[str(tmp_path / "colour.json")])
    with pytest.raises(ValueError, match="region"):
        Grid(fgovd=[str(tmp_path / "color.json")], region="box")


def test_cli_lists_grids_and_checks_fgovd_files_first(tmp_path):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    runner = CliRunner()
    for args in (["ls", "grids"], ["reproduce", "--list"]):
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0 and all(name in result.stdout for name in GRIDS)
    missing = runner.invoke(app, ["reproduce", "fgovd", "--benchmarks", str(tmp_path), "--out", str(tmp_path / "o")])
    assert missing.exit_code == 2 and "8 FG-OVD benchmark file(s) not found" in missing.output
    assert not (tmp_path / "o").exists()  # nothing ran
    unknown = runner.invoke(app, ["reproduce", "table1"])
    assert unknown.exit_code == 2 and "unknown grid 'table1'" in unknown.output
    bad = runner.invoke(app, ["sweep", "--datasets", "voc21", "--alphas", "3", "--out", str(tmp_path / "s")])
    assert bad.exit_code == 2 and "alpha must be in" in bad.output


def test_model_typos_fail_the_grid_before_any_cell(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'ViT-B-61'"):
        Grid(datasets=["voc21"], models=["ViT-B-61"])
    with pytest.raises(ValueError, match="model config file not found"):
        Grid(datasets=["voc21"], models=[str(tmp_path / "missing.json")])


@pytest.mark.parametrize("old", ["sweep", "report"])
def test_old_sweep_and_report_paths_find_every_name_they_had(old, monkeypatch):
    """`clipseg_sparse.sweep` and `.report` were split into sweeps/{grid,run,records,report,plots}.py; for one
    release the old paths still import (with a DeprecationWarning) and find each public name."""
    import importlib
    import sys

    import clipseg_sparse.sweeps.grid as grid
    import clipseg_sparse.sweeps.report as report

    monkeypatch.delitem(sys.modules, f"clipseg_sparse.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=f"clipseg_sparse.{old} moved"):
        module = importlib.import_module(f"clipseg_sparse.{old}")
    names = {"sweep": ["Grid", "Cell", "GRIDS", "GridFile", "read_grid_file", "check_fgovd_negatives", "SweepPaths",
                       "parse_roots", "run_sweep", "run_cell", "record_failure", "is_done", "data_changed"],
             "report": ["Record", "ReportError", "collect", "read_result", "default_metric", "softmax_deltas", "Pivot",
                        "pivot", "to_markdown", "to_csv", "to_rich", "Series", "alpha_series", "write_plots", "PLOT_FILES"]}  # fmt: skip
    assert all(hasattr(module, name) for name in names[old])
    assert module.Cell is grid.Cell and report.TableCell is not grid.Cell
