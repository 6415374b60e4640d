"""Nothing non-finite is recorded: spec values nan / inf are refused when parsed, and an image whose class
scores become non-finite (a threshold that masks every attention score) fails with one line, no file written.
A normalizer on a spec with no normalizer slot (source `id`) is refused rather than recorded as run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.cli.app import app
from clipseg_sparse.segment.labels import ClassMaps, NonFiniteScores
from clipseg_sparse.segment.maps import DenseMap
from conftest import TINY_CONFIG


@pytest.mark.parametrize("text", ["qq/softmax/neg:nan", "qq/softmax/neg:inf", "qq/softmax/neg:-inf", "qq/softmax/temp:inf",
                                  "qq/softmax/gauss:nan", "qq/softmax/gauss:inf", "qq/softmax/cls:nan", "qq/entmax:nan",
                                  "sclip/neg:nan", "lposs/hook:lp:pixel:inf", "trident/hook:sam:nan"])  # fmt: skip
def test_non_finite_spec_values_are_refused(text):
    with pytest.raises(ValueError, match="finite|not a number|alpha|bad stage"):
        AttentionSpec.parse(text)


@pytest.mark.parametrize("field", ["negative", "temperature", "gauss_sigma", "cls_residual"])
def test_non_finite_fields_are_refused(field):
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            AttentionSpec(source=("qq",), **{field: value})


def _maps(value: float) -> ClassMaps:
    cosine = torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(0))
    cosine[1, 2, 3] = value
    return ClassMaps(DenseMap(cosine), [0, 1, 2], 3, 40.0)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("bg", [0.0, 0.5])
def test_non_finite_scores_fail_the_labels(value, bg):
    with pytest.raises(NonFiniteScores, match="not finite"):
        _maps(value).labels(bg)


def test_finite_scores_keep_their_labels():
    maps = _maps(0.5)
    expected = maps.rows(0, 4).argmax(0).numpy()
    assert np.array_equal(_maps(0.5).labels(), expected)


def test_segment_fails_an_image_whose_scores_are_not_finite(tmp_path):
    image = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["segment", str(image), "--classes", "a,b", "--model", TINY_CONFIG, "--pretrained", "none",
                                      "--attn", "qq[thresh:10]/softmax", "--save-probs", "--resolution", "64", "--window", "64",
                                      "--stride", "32", "--device", "cpu", "--out", str(out)], env={"COLUMNS": "300"})  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "class scores are not finite" in result.output and "Traceback" not in result.output
    assert not out.exists() or not any(p.is_file() and p.suffix != ".log" for p in out.rglob("*"))


@pytest.mark.parametrize("text", ["maskclip/entmax:1.5", "id/entmax:1.5", "lposs/sparsemax", "lposs+/entmax:1.25"])
def test_a_normalizer_on_a_spec_without_a_slot_is_refused(text):
    with pytest.raises(ValueError, match="source 'id'.*would change nothing"):
        AttentionSpec.parse(text)


def test_ls_presets_says_which_presets_have_a_normalizer_slot():
    result = CliRunner().invoke(app, ["ls", "presets"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 3}
    assert "normalizer slot" in result.stdout
    assert "│ no " in rows["maskclip"] and "│ no " in rows["lposs"] and "│ yes " in rows["sclip"]
