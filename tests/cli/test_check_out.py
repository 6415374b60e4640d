"""Every command that writes checks each output path first (cli.common.check_out), issue 25 reliability
item 1: an output under a regular file or under /proc is one stderr line and exit 2, before any work.

"No work" is enforced by sentinels: the first piece of real work each command would do (loading the
model, the adapter, reading result files, writing the page, converting labels, training) raises, so a
command that checked its output late fails these tests with exit 1 instead of 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from conftest import TINY_CONFIG

runner = CliRunner()
TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu"]


def _work(*_args, **_kwargs):
    raise AssertionError("work was done before the output was checked")


@pytest.fixture
def no_work(monkeypatch):
    """Every first step of work raises (the commands import these lazily or by module attribute)."""
    import clipseg_sparse.analysis.gallery as gallery
    import clipseg_sparse.cli.analysis as cli_analysis
    import clipseg_sparse.cli.dna as cli_dna
    import clipseg_sparse.datasets.convert as convert
    import clipseg_sparse.dna.adapter as adapter
    import clipseg_sparse.dna.train as dna_train
    import clipseg_sparse.sweeps.records as records

    for module, name in ((cli_analysis, "load_model"), (cli_dna, "load_model"), (dna_train, "train"), (adapter, "load_adapter"),
                         (records, "collect"), (gallery, "write_gallery"), (convert, "convert_stuffthingmaps")):  # fmt: skip
        monkeypatch.setattr(module, name, _work)


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    """Inputs good enough that each command would go on to its work."""
    image = tmp_path / "in" / "x.png"
    image.parent.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(image)
    folder = tmp_path / "preds"
    folder.mkdir()
    stuff = tmp_path / "stuff"
    (stuff / "annotations" / "val2017").mkdir(parents=True)
    return {"image": image, "folder": folder, "stuff": stuff, "adapter": tmp_path / "adapter.safetensors", "root": tmp_path / "data"}


# (command line with OUT where the output path goes, whether OUT is a folder)
COMMANDS = {
    "explain": (["explain", "{image}", "--point", "1,1", "--classes", "a,b", *TINY, "--out", "OUT"], False),
    "dna train": (["dna", "train", "--root", "{root}", "--dataset", "ade20k", *TINY, "--out", "OUT"], True),
    "dna stats": (["dna", "stats", "{adapter}", *TINY, "--out", "OUT"], False),
    "report --csv": (["report", "{folder}", "--csv", "OUT"], False),
    "report --markdown": (["report", "{folder}", "--markdown", "OUT"], False),
    "report --plots": (["report", "{folder}", "--plots", "OUT"], True),
    "report --diffusivity": (["report", "{folder}", "--diffusivity", "OUT"], True),
    "report --html": (["report", "{folder}", "--html", "OUT"], False),
    "convert": (["convert", "coco-stuff", "{stuff}", "--out", "OUT"], True),
}


def _args(command: str, inputs: dict[str, Path], out: Path) -> list[str]:
    line, _ = COMMANDS[command]
    return [str(out) if a == "OUT" else a.format(**inputs) for a in line]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("place", ["under a file", "under /proc"])
def test_unwritable_output_is_one_line_and_exit_2_before_any_work(command, place, inputs, no_work, tmp_path):
    if place == "under a file":
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        out, says = blocker / "sub" / "out", f"{blocker} is a file"
    else:
        out, says = Path("/proc/clipseg-sparse-no-such/out"), "cannot write in /proc"
    out = out if COMMANDS[command][1] else out.with_suffix(".png" if command == "explain" else ".txt")
    result = runner.invoke(app, _args(command, inputs, out))
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], result.stderr
    assert str(out) in lines[0] or str(out.parent) in lines[0], lines[0]
    assert not out.exists()


def test_every_writing_command_here_is_one_the_sentinels_stop(inputs, no_work, tmp_path):
    """The sentinels are real: with a good output path each command reaches its work (so the test above
    shows the check runs before it, not that the command never got that far)."""
    for command, (_, folder) in COMMANDS.items():
        out = tmp_path / "ok" / command.replace(" ", "_").replace("-", "")
        out = out if folder else out.with_suffix(".png" if command == "explain" else ".txt")
        result = runner.invoke(app, _args(command, inputs, out))
        assert isinstance(result.exception, AssertionError) and "work was done" in str(result.exception), (command, result.output)
