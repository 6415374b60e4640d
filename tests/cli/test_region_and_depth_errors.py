"""Issue 25, reliability 2 and 3: a bad `--regions FOLDER` file and a spec needing more blocks than the model
has are one stderr line and exit 2 naming the file (or the blocks), before the model loads where the file
alone shows the problem, and before any image otherwise. These were tracebacks (a ValueError escaping)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from conftest import TINY_CONFIG
from test_common import invoke

TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", "32", "--window", "0"]
REGIONS_SPEC = "qk[region:0.5]/softmax"  # reads region maps, runs on the 3-block tiny model


def _write_bad(kind: str, path_stem) -> tuple[str, str]:
    """A bad region file of this kind for the 32 x 40 image `a`; (file name, what the error says)."""
    if kind == "float .npy":
        np.save(path_stem.with_suffix(".npy"), np.zeros((32, 40), np.float32))
        return "a.npy", "must be a 2-D integer map (got float32 (32, 40))"
    if kind == "3-D .npy":
        np.save(path_stem.with_suffix(".npy"), np.zeros((32, 40, 2), np.int32))
        return "a.npy", "must be a 2-D integer map (got int32 (32, 40, 2))"
    if kind == "pickled .npy":
        np.save(path_stem.with_suffix(".npy"), np.array([{"region": 1}], dtype=object), allow_pickle=True)
        return "a.npy", "cannot read region masks"
    if kind == "two-array .npz":
        np.savez(path_stem.with_suffix(".npz"), a=np.zeros((32, 40), np.int32), b=np.zeros((32, 40), np.int32))
        return "a.npz", "has arrays a, b; expected 'regions' or a single array"
    if kind == "RGB .png":
        Image.fromarray(np.zeros((32, 40, 3), np.uint8)).save(path_stem.with_suffix(".png"))
        return "a.png", "must be a 2-D integer map"
    if kind == "wrong size":
        np.save(path_stem.with_suffix(".npy"), np.zeros((20, 24), np.int32))
        return "a.npy", "region masks are 24x20, the image is 40x32"
    raise AssertionError(kind)


def one_line(result) -> str:
    """The one error line (after progress lines only, e.g. the text embedding's)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("WARNING:root")]
    assert lines[-1].startswith("error:") and "Traceback" not in result.stderr, result.stderr
    assert all(re.match(r"\d\d:\d\d:\d\d text: ", line) for line in lines[:-1]), result.stderr
    return lines[-1]


@pytest.fixture
def images(tmp_path):
    (tmp_path / "in").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(tmp_path / "in" / "a.png")
    (tmp_path / "masks").mkdir()
    return tmp_path


@pytest.fixture
def model_loads(monkeypatch):
    """Counts model loads by the segment command."""
    import clipseg_sparse.cli.segment as segment_cli

    loads = []
    real = segment_cli.load_model
    monkeypatch.setattr(segment_cli, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    return loads


@pytest.mark.parametrize("kind", ["float .npy", "3-D .npy", "pickled .npy", "two-array .npz", "RGB .png", "wrong size"])
def test_a_bad_region_file_is_one_line_naming_it(kind, images, model_loads, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(images / "cache"))
    name, says = _write_bad(kind, images / "masks" / "a")
    result = invoke("segment", images / "in", "--classes", "cat,sky", *TINY, "--attn", REGIONS_SPEC, "--regions", images / "masks", "--out", images / "out")
    line = one_line(result)
    assert str(images / "masks" / name) in line and says in line, line
    # what the file alone shows is found before the model loads; a size needs the image
    assert len(model_loads) == (1 if kind == "wrong size" else 0)
    assert not list((images / "out").glob("a*")) if (images / "out").exists() else True


@pytest.mark.parametrize("preset", ["scclip-l14", "corrclip"])
def test_a_spec_deeper_than_the_model_is_one_line_before_any_image(preset, images, monkeypatch):
    """scclip-l14 reads block 17, corrclip adds blocks 6..10: the tiny model has 3. Refused before the proxy
    backbones load and before any text or image is embedded."""
    import clipseg_sparse.models.proxies as proxies
    import clipseg_sparse.segment.segmenter as segmenter

    def no_work(*_a, **_k):
        raise AssertionError("work started before the spec was checked against the model")

    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(images / "cache"))
    monkeypatch.setattr(segmenter, "embed_names", no_work)
    monkeypatch.setattr(proxies, "load_backbone", no_work)
    np.save(images / "masks" / "a.npy", np.zeros((32, 40), np.int32))
    result = invoke("segment", images / "in", "--classes", "cat,sky", *TINY, "--preset", preset, "--regions", images / "masks", "--out", images / "out")
    line = one_line(result)
    assert "which is edited or past the last block; taps and inputs must come from blocks 1..2 of this model's 3" in line, line
    assert not (images / "out").exists() or not any((images / "out").iterdir())


def test_eval_refuses_a_spec_deeper_than_the_model_before_any_image(tmp_path, monkeypatch):
    from fake_benchmarks import make_benchmark

    import clipseg_sparse.segment.segmenter as segmenter

    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(segmenter, "embed_names", lambda *a, **k: (_ for _ in ()).throw(AssertionError("text embedded")))
    make_benchmark("voc21", tmp_path / "data", n=1, size=(32, 32))
    line = one_line(invoke("eval", "--dataset", "voc21", "--root", tmp_path / "data", *TINY, "--preset", "scclip-l14"))
    assert "reads block" in line and "blocks 1..2 of this model's 3" in line
