"""What a probe of the commands found (issue 35): non-finite scores fail an image in one line, `ls presets`
names the normalizer slot."""

from __future__ import annotations

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from conftest import TINY_CONFIG


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


def test_ls_presets_says_which_presets_have_a_normalizer_slot():
    result = CliRunner().invoke(app, ["ls", "presets"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 3}
    assert "normalizer slot" in result.stdout
    assert "│ no " in rows["maskclip"] and "│ no " in rows["lposs"] and "│ yes " in rows["sclip"]
