"""User-facing CLI behaviour found by a new-user review: one-line errors, clean stdout, honest notes."""


import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark

runner = CliRunner()
TINY = ["--model", TINY_CONFIG, "--pretrained", "none"]
TINY_CPU = [*TINY, "--device", "cpu"]
FAST = ["--templates", "single", "--resolution", "64", "--window", "64", "--stride", "32"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("WARNING:root")]
    assert lines[-1].startswith("error:") and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def one_line(result, *fragments: str) -> str:
    """The only stderr line of an exit-2 result: an `error:` line holding every fragment."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    import clipseg_sparse.cli.analysis as analysis

    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(analysis, "load_model", refuse)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "in" / "x.png"
    path.parent.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_unavailable_device_is_a_one_line_error(image, tmp_path, monkeypatch, device):
    import clipseg_sparse.runtime.device as model

    monkeypatch.setattr(model, "_cuda_available", lambda: False)
    monkeypatch.setattr(model, "_mps_available", lambda: False)
    result = invoke("segment", image, "--classes", "a,b", "--out", tmp_path / "out", *TINY, "--device", device)
    assert_one_line_error(result, f"'{device}'", "not available")


def test_sweep_checks_the_device_before_running_cells(tmp_path, monkeypatch):
    import clipseg_sparse.runtime.device as model

    monkeypatch.setattr(model, "_cuda_available", lambda: False)
    make_benchmark("voc21", tmp_path / "data", n=1, size=(32, 32))
    result = invoke("sweep", "--models", TINY_CONFIG, "--pretrained", "none", "--datasets", "voc21",
                    "--root", tmp_path / "data", "--out", tmp_path / "sweep", "--device", "cuda")
    assert_one_line_error(result, "'cuda'", "not available")
    assert not (tmp_path / "sweep").exists()


def test_out_of_the_wrong_kind_is_a_one_line_error(image, tmp_path):
    a_file, a_folder = tmp_path / "result.json", tmp_path / "folder"
    a_file.write_text("{}")
    a_folder.mkdir()
    make_benchmark("voc21", tmp_path / "data", n=1, size=(32, 32))
    voc = ["--dataset", "voc21", "--root", tmp_path / "data", *TINY, *FAST]
    fg = ["--benchmark", "tests/data/fgovd/subset/transparency.json", "--images", tmp_path, *TINY]
    sweep = ["--models", TINY_CONFIG, "--pretrained", "none", "--datasets", "voc21", "--root", tmp_path / "data"]
    assert_one_line_error(invoke("segment", image, "--classes", "a", "--out", a_file, *TINY), str(a_file), "is a file")
    assert_one_line_error(invoke("sweep", *sweep, "--out", a_file), str(a_file), "is a file")
    for overwrite in ([], ["--overwrite"]):
        assert_one_line_error(invoke("eval", *voc, "--out", a_folder, *overwrite), str(a_folder), "is a folder")
        assert_one_line_error(invoke("fgovd", *fg, "--out", a_folder, *overwrite), str(a_folder), "is a folder")
    assert a_file.read_text() == "{}" and a_folder.is_dir() and not any(a_folder.iterdir())


def test_eval_says_it_shows_a_result_only_when_it_does(tmp_path):
    make_benchmark("voc21", tmp_path / "data", n=1, size=(32, 32))
    out = tmp_path / "voc.json"
    args = ["eval", "--dataset", "voc21", "--root", tmp_path / "data", *TINY, *FAST, "--out", out]
    assert invoke(*args).exit_code == 0
    again = invoke(*args)
    assert again.exit_code == 0 and "not recomputing" in again.stderr
    other = invoke(*args, "--preset", "clearclip")
    assert_one_line_error(other, "different configuration")
    assert "showing" not in other.stderr and "not recomputing" not in other.stderr


def test_tables_on_redirected_stdout_keep_whole_cells(monkeypatch):
    """`clipseg-sparse ls datasets > file`: rich would cut lines at 80 columns and truncate cells."""
    monkeypatch.delenv("COLUMNS", raising=False)
    datasets = invoke("ls", "datasets")
    assert datasets.exit_code == 0
    assert "ADEChallengeData2016/images/validation/*.jpg" in datasets.stdout and "…" not in datasets.stdout
    protocols = invoke("ls", "protocols")
    assert "voc21: logit_scale=65, bg_threshold=0.1, area_threshold=0.1" in protocols.stdout and "…" not in protocols.stdout


@pytest.mark.parametrize("name", ["RN50", "ViT-L-14-CLIPA"])
def test_models_we_cannot_run_are_refused_by_name_and_listed_with_the_reason(name, image, tmp_path):
    result = invoke("segment", image, "--classes", "a", "--out", tmp_path / "out", "--model", name, "--pretrained", "none")
    assert_one_line_error(result, repr(name), "not supported")
    listed = invoke("ls", "models")
    rows = {line.split("│")[1].strip(): line for line in listed.stdout.splitlines() if line.count("│") >= 4}
    assert listed.exit_code == 0 and "ViT-B-16" in rows and "ViT-L-14" in rows
    assert "│ no " in rows[name] and "│ yes " in rows["ViT-B-16"]
    assert "EVA-02" in rows["EVA02-B-16"] and "SigLIP 2" in rows["ViT-B-16-SigLIP2"] and "│ yes " in rows["PE-Core-B-16"]


def test_offline_weights_and_missing_checkpoint_are_one_line(image, tmp_path):
    """Offline with an empty cache: exit 2 and our one line, without open_clip's 'ERROR:root:' echo of it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path), COLUMNS="300")
    cmd = [sys.executable, "-m", "clipseg_sparse", "segment", str(image), "--classes", "a", "--out", str(tmp_path / "o"), "--device", "cpu"]
    run = subprocess.run(cmd + ["--pretrained", "openai"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [run.stderr.strip().splitlines()[0]], run.stderr
    assert run.stderr.startswith("error: could not obtain weights 'openai' for ViT-B-16")
    missing = invoke("segment", image, "--classes", "a", "--out", tmp_path / "o", "--model", TINY_CONFIG, "--pretrained", tmp_path / "w.pt")
    assert_one_line_error(missing, "w.pt: checkpoint file not found")
    assert "Hugging Face" not in missing.stderr  # the download advice is for tags, not for a mistyped path


@pytest.mark.parametrize("flag, value", [("--resolutions", "224,abc"), ("--alphas", "1.5,x")])
def test_sweep_names_the_flag_of_a_bad_number(tmp_path, flag, value):
    result = invoke("sweep", "--models", TINY_CONFIG, "--datasets", "voc21", "--root", tmp_path, "--out", tmp_path / "s", flag, value)
    assert_one_line_error(result, f"{flag} {value}")


def test_a_note_prints_a_spec_with_its_modifiers(capsys):
    from clipseg_sparse.cli.common import note

    note("--proxy-weights x is not used by qk[cos,scale:4]/softmax")
    assert capsys.readouterr().err.strip() == "note: --proxy-weights x is not used by qk[cos,scale:4]/softmax"


def test_a_preset_followed_by_more_parts_runs_and_a_misspelt_one_is_named(image, tmp_path):
    import json

    from clipseg_sparse.attention import AttentionSpec

    result = invoke("segment", image, "--classes", "a,b", "--preset", "sclip/entmax:1.5", *TINY_CPU, *FAST, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "out" / "x.json").read_text())["settings"]
    assert settings["attention"] == str(AttentionSpec.parse("sclip").replace(normalizer="entmax:1.5"))
    explained = invoke("explain", image, "--point", "1,1", "--classes", "a,b", "--preset", "sclip/entmax:1.5", *TINY_CPU, "--out", tmp_path / "e.png")
    assert explained.exit_code == 0, explained.output
    misspelt = invoke("segment", image, "--classes", "a,b", "--preset", "sclipp/entmax:1.5", *TINY_CPU, "--out", tmp_path / "out2")
    assert_one_line_error(misspelt, "'sclipp'", "sclip")
