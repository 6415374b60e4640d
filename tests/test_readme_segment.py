"""The README's first command and its main job, and the docs' "Segment your images" page (docs/segment.md), must
match the CLI (typer's tests/test_tutorial idea)."""

import re
import shlex
from pathlib import Path

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from conftest import TINY_CONFIG

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
SEGMENT_MD = ROOT / "docs" / "segment.md"
runner = CliRunner()


def segment_section() -> str:
    """docs/segment.md up to its next section (the library quick start)."""
    return SEGMENT_MD.read_text(encoding="utf-8").split("\n## ", 1)[0]


def documented_command() -> list[str]:
    block = re.search(r"```bash\n(clipseg-sparse segment .*?)\n```", segment_section(), re.S).group(1)
    return shlex.split(block)[1:]


def help_flags() -> set[str]:
    result = runner.invoke(app, ["segment", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    return set(re.findall(r"--[a-z][a-z-]*", result.output))


def test_every_flag_in_the_segment_section_exists():
    flags = set(re.findall(r"`(--[a-z][a-z-]*)", segment_section())) | {a for a in documented_command() if a.startswith("--")}
    assert {"--out", "--classes", "--save-probs", "--format", "--overwrite"} <= flags
    assert flags <= help_flags(), flags - help_flags()


def test_documented_defaults_are_the_library_defaults():
    from clipseg_sparse import InferenceSettings

    section, d = segment_section(), InferenceSettings()
    for text in (f"--resolution {d.resolution}", f"--window {d.window} --stride {d.stride}", f"--logit-scale {d.logit_scale:g}", f"--batch-size {d.batch_size}"):
        assert text in section
    result = runner.invoke(app, ["segment", "--help"], env={"COLUMNS": "300"})
    for text in (f"default {d.resolution}", f"default {d.window}", f"default {d.stride}", f"default {d.logit_scale:g}", f"default {d.batch_size}"):
        assert text in result.output


def test_documented_command_runs_on_the_tiny_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "photos" / "trips").mkdir(parents=True)
    (tmp_path / "extra").mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save("photos/trips/a.jpg")
    Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save("extra/house.jpg")
    tiny = ["--model", TINY_CONFIG, "--pretrained", "none", "--resolution", "64", "--window", "0", "--templates", "single"]
    result = runner.invoke(app, [*documented_command(), *tiny])
    assert result.exit_code == 0, result.output
    listed = re.findall(r"`(a\.[a-z.]+)`", segment_section())
    assert sorted(p.name for p in Path("masks/trips").iterdir()) == sorted(set(listed) - {"a.rle.json"})
    assert (tmp_path / "masks" / "house.png").exists()


def setup_segment_command() -> list[str]:
    """The `clipseg-sparse segment ...` part of the README's first command (after the install steps)."""
    text = README.read_text(encoding="utf-8").split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?clipseg-sparse segment .*?)\n```", text, re.S).group(1)
    return shlex.split(block.split("clipseg-sparse segment", 1)[1])


def test_first_command_segments_the_shipped_examples(tmp_path, monkeypatch):
    """Issue 15 finding 11: on a fresh clone the first command must find its images (it named photos/)."""
    import shutil

    args = setup_segment_command()
    assert args[0].rstrip("/") == "examples"
    shipped = sorted(p.name for p in (README.parent / "examples").glob("*.jpg"))
    assert len(shipped) >= 3 and sum((README.parent / "examples" / n).stat().st_size for n in shipped) < 500_000
    shutil.copytree(README.parent / "examples", tmp_path / "examples")  # the repository layout, outputs kept out of it
    monkeypatch.chdir(tmp_path)
    tiny = ["--model", TINY_CONFIG, "--pretrained", "none", "--resolution", "64", "--window", "0", "--templates", "single"]
    result = runner.invoke(app, ["segment", *args, *tiny])
    assert result.exit_code == 0, result.output
    out = Path(args[args.index("--out") + 1])
    assert sorted(p.name for p in out.glob("*.overlay.png")) == sorted(n.replace(".jpg", ".overlay.png") for n in shipped)


def test_docs_never_read_region_masks_from_a_folder_they_write_label_maps_to():
    pages = [README, *(ROOT / "docs").glob("**/*.md")]
    commands = " ".join(re.findall(r"```bash\n(.*?)```", "".join(p.read_text(encoding="utf-8") for p in pages), flags=re.S))
    written = set(re.findall(r"--out (\S+)", commands))
    regions = set(re.findall(r"--regions (\S+)", commands)) - {"sam2", "sam3"}
    assert regions and not regions & written, regions & written
