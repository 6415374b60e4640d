"""What `analyze` and `report --html` print (cli/analysis.py): a spec's `[...]` modifiers are text, not rich
markup, so the spec printed is the canonical one (issue 35, reliability 13)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from conftest import TINY_CONFIG

ADE_ROOT = Path(__file__).parents[1] / "data" / "ade20k"
SPEC = "qk[cos,scale:4]/softmax"
TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu", "--resolution", "32", "--window", "0"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})


def test_the_analyze_table_prints_a_spec_with_its_modifiers(tmp_path):
    result = invoke("analyze", "--dataset", "ade20k", "--root", ADE_ROOT, *TINY, "--limit", "1", "--attn", SPEC)
    assert result.exit_code == 0, result.output
    assert f"│ {SPEC} " in result.stdout, result.stdout


def test_the_report_html_line_prints_a_spec_with_its_modifiers(tmp_path):
    image = ADE_ROOT / "ADEChallengeData2016" / "images" / "validation" / "ADE_val_00000001.jpg"
    segmented = invoke("segment", image, "--classes", "a,b", *TINY, "--templates", "single", "--attn", SPEC, "--out", tmp_path / "seg")
    assert segmented.exit_code == 0, segmented.output
    result = invoke("report", tmp_path / "seg", "--html", tmp_path / "g.html")
    assert result.exit_code == 0, result.output
    assert f"1 columns ({SPEC})" in result.stderr, result.stderr
