"""Protocols that name their CLIP weights: the one precedence (command line > protocol > library default),
the eval / analyze commands and grids that follow it, result files that record what was loaded, `ls protocols`."""

import json
import dataclasses

import open_clip
import pytest
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.models.clip import DEFAULT_MODEL, DEFAULT_PRETRAINED, check_model_name
from clipseg_sparse.sweeps.grid import GRIDS, Grid, read_grid_file
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark

# protocol -> the CLIP its paper's table reports (research/peers-2026.md 1.2 and 3.1)
PUBLISHED_WEIGHTS = {
    "proxyclip-metaclip": ("ViT-B-16-quickgelu", "metaclip_fullcc"),
    "proxyclip-laion-h14": ("ViT-H-14", "laion2b_s32b_b79k"),
    "trident-metaclip": ("ViT-B-16-quickgelu", "metaclip_fullcc"),
    "trident-laion-h14": ("ViT-H-14", "laion2b_s32b_b79k"),
    "corrclip-metaclip": ("ViT-B-16-quickgelu", "metaclip_fullcc"),
    "corrclip-l14-metaclip": ("ViT-L-14-quickgelu", "metaclip_fullcc"),
}


@pytest.fixture
def protocol(monkeypatch):
    """Register a throw-away protocol (sclip's settings) naming (model, pretrained); removed afterwards."""

    def register(model, pretrained, name="weights-test"):
        p = dataclasses.replace(PROTOCOLS.get("sclip"), name=name, model=model, pretrained=pretrained)
        for table, value in ((PROTOCOLS._items, p), (PROTOCOLS._help, "test"), (PROTOCOLS._where, __name__)):
            monkeypatch.setitem(table, name, value)
        return p

    return register


@pytest.mark.parametrize("name", list(PUBLISHED_WEIGHTS))
def test_weight_protocols_name_published_weights_that_open_clip_has(name):
    p = PROTOCOLS.get(name)
    assert (p.model, p.pretrained) == PUBLISHED_WEIGHTS[name]
    assert check_model_name(p.model) == p.model and p.pretrained in open_clip.list_pretrained_tags_by_model(p.model)
    base = PROTOCOLS.get(name.removesuffix("-metaclip").removesuffix("-laion-h14").removesuffix("-l14"))
    # the same published settings as the protocol it varies; only the weights (and corrclip-l14's indices) differ
    assert (p.defaults, p.per_dataset, p.class_names) == (base.defaults, base.per_dataset, base.class_names)
    assert p.attention == ("corrclip-l14" if "l14" in name else base.attention)


def test_precedence_command_line_then_protocol_then_library_default():
    meta, plain = PROTOCOLS.get("corrclip-metaclip"), PROTOCOLS.get("corrclip")
    assert plain.clip_weights() == (DEFAULT_MODEL, DEFAULT_PRETRAINED) == ("ViT-B-16", "openai")
    assert meta.clip_weights() == ("ViT-B-16-quickgelu", "metaclip_fullcc")
    assert meta.clip_weights("ViT-L-14-quickgelu") == ("ViT-L-14-quickgelu", "metaclip_fullcc")  # field by field
    assert meta.clip_weights(pretrained="openai") == ("ViT-B-16-quickgelu", "openai")
    assert meta.clip_weights("ViT-B-16", "none") == ("ViT-B-16", "none")
    assert plain.clip_weights("ViT-L-14") == ("ViT-L-14", "openai")


def test_ls_protocols_shows_each_protocols_weights():
    out = CliRunner().invoke(app, ["ls", "protocols"], env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("│ corrclip-metaclip "))
    cells = [line.split("│")[2].strip() for line in lines[at : at + 3]]
    assert cells == ["corrclip / sclip", "ViT-B-16-quickgelu", "metaclip_fullcc"]
    at = next(i for i, line in enumerate(lines) if line.startswith("│ sclip "))
    assert [line.split("│")[2].strip() for line in lines[at : at + 2]] == ["sclip / sclip", ""]  # the library default


def test_eval_loads_the_protocols_weights_unless_the_command_line_names_others(protocol, tmp_path):
    runner = CliRunner()
    make_benchmark("voc20", tmp_path / "voc", n=1)
    fast = ["--templates", "single", "--resolution", "32", "--window", "0", "--dataset", "voc20", "--root", str(tmp_path / "voc")]
    protocol(TINY_CONFIG, "none")
    out = tmp_path / "a.json"
    result = runner.invoke(app, ["eval", "--protocol", "weights-test", *fast, "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = json.loads(out.read_text())["config"]
    assert (config["model"], config["pretrained"], config["protocol"]) == ("tiny-vit", "none", "weights-test")
    # weights the protocol names that cannot load: the command line's win, field by field
    protocol("ViT-nope-16", "no-such-tag")
    failed = runner.invoke(app, ["eval", "--protocol", "weights-test", *fast])
    assert failed.exit_code == 2 and "unknown model 'ViT-nope-16'" in failed.output
    failed = runner.invoke(app, ["eval", "--protocol", "weights-test", "--model", TINY_CONFIG, *fast])
    assert failed.exit_code == 2 and "unknown pretrained tag 'no-such-tag'" in failed.output
    out = tmp_path / "b.json"
    result = runner.invoke(app, ["eval", "--protocol", "weights-test", "--model", TINY_CONFIG, "--pretrained", "none", *fast, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["model"] == "tiny-vit"


def test_analyze_follows_the_protocols_weights(protocol, tmp_path):
    make_benchmark("voc20", tmp_path / "voc", n=1)
    protocol(TINY_CONFIG, "none")
    out = tmp_path / "stats"
    result = CliRunner().invoke(app, ["analyze", "--dataset", "voc20", "--root", str(tmp_path / "voc"), "--protocol", "weights-test",
                                      "--resolution", "32", "--window", "0", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert (record["config"]["model"], record["config"]["pretrained"], record["config"]["protocol"]) == ("tiny-vit", "none", "weights-test")


def test_grid_cells_take_the_protocols_weights_unless_the_grid_names_them(protocol):
    meta = Grid(datasets=["voc21"], protocol="corrclip-metaclip").cells()[0]
    assert (meta.model, meta.pretrained) == ("ViT-B-16-quickgelu", "metaclip_fullcc")
    assert meta.label.startswith("ViT-B-16-quickgelu:metaclip_fullcc voc21")
    named = Grid(datasets=["voc21"], protocol="corrclip-metaclip", models=["ViT-L-14-quickgelu", "ViT-B-16:openai"]).cells()
    assert [(c.model, c.pretrained) for c in named] == [("ViT-L-14-quickgelu", "metaclip_fullcc"), ("ViT-B-16", "openai")]
    assert Grid(datasets=["voc21"], protocol="corrclip-metaclip", pretrained="none").cells()[0].pretrained == "none"
    # a grid that names nothing runs the library default, with the hash it had when models defaulted to ViT-B-16:openai
    plain = Grid(datasets=["voc21"]).cells()[0]
    assert (plain.model, plain.pretrained) == ("ViT-B-16", "openai")
    assert plain.hash == Grid(datasets=["voc21"], models=["ViT-B-16"], pretrained="openai").cells()[0].hash
    protocol("ViT-L-14", "no-such-tag")  # a protocol tag the model lacks fails the grid, not every cell
    with pytest.raises(ValueError, match="has no pretrained tag 'no-such-tag'"):
        Grid(datasets=["voc21"], protocol="weights-test")


def test_proxyclip_grid_crosses_openai_and_metaclip():
    grid = read_grid_file(GRIDS.get("proxyclip")).grid
    cells = grid.cells()
    assert {(c.model, c.pretrained) for c in cells} == {("ViT-B-16", "openai"), ("ViT-B-16-quickgelu", "metaclip_fullcc")}
    assert len(cells) == 2 * 8 * 2 and {c.attention for c in cells} == {"ext:dino_vitb8[cos,shift:1.2,scale:3,pos]/softmax/cls:0/noffn",
                                                                         "ext:dino_vitb8[cos,shift:1.2,scale:3,pos]/entmax:1.5/cls:0/noffn"}
