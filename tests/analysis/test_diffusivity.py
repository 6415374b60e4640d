"""Gain vs diffusivity on hand-written result files whose correlations are known by construction."""

import csv
import io
import json
import math

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.analysis.diffusivity import (
    correlations,
    gain_cells,
    least_squares,
    pearson,
    ranks,
    read_analyses,
    spearman,
    write_gain_report,
)
from clipseg_sparse.sweeps.records import ReportError, collect

BASE = {"model": "ViT-B-16", "pretrained": "openai", "precision": "fp32", "resolution": 336, "window": 224, "stride": 112}
DIFFUSIVITY = {"voc21": 0.1, "context60": 0.2, "ade20k": 0.4, "coco-stuff": 0.7}
CLASS_DIFF = {"cat": 0.3, "dog": 0.6}


def test_statistics_of_known_relations():
    x = [0.1, 0.2, 0.4, 0.7]
    assert pearson(x, [3 * v + 1 for v in x]) == pytest.approx(1.0)
    assert pearson(x, [-2 * v for v in x]) == pytest.approx(-1.0)
    cubic = [v**3 for v in x]  # monotone, not linear
    assert spearman(x, cubic) == pytest.approx(1.0) and pearson(x, cubic) < 0.99
    assert least_squares(x, [3 * v + 1 for v in x]) == pytest.approx((3.0, 1.0))
    assert ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    # Spearman with ties: the Pearson r of the mean ranks, worked out by hand
    rx, ry = [1, 2, 3, 4], [1, 2.5, 2.5, 4]
    mx = my = 2.5
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    assert spearman([1, 2, 3, 4], [7, 8, 8, 9]) == pytest.approx(num / den)
    assert math.isnan(pearson([1.0], [2.0])) and math.isnan(pearson([1, 1, 1], [1, 2, 3]))


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def results(tmp_path):
    """softmax mIoU 20 everywhere; entmax:1.5 gains 10 x diffusivity (exact line), entmax:1.25 gains
    100 x diffusivity^3 (monotone, not linear), randmask:1.5 loses 2 x diffusivity."""
    gains = {"qq/entmax:1.5": lambda d: 10 * d, "qq/entmax:1.25": lambda d: 100 * d**3, "qq/randmask:1.5": lambda d: -2 * d}
    for i, (dataset, diff) in enumerate(DIFFUSIVITY.items()):
        config = {**BASE, "dataset": dataset}
        per_class = {"cat": {"IoU": 30.0}, "dog": {"IoU": 40.0}, "bird": {"IoU": None}}
        _write(tmp_path / "sweep" / f"{dataset}-soft.json",
               {"kind": "eval", "config": {**config, "attention": "qq/softmax"}, "metrics": {"mIoU": 20.0}, "per_class": per_class})  # fmt: skip
        for spec, gain in gains.items():
            own = {"cat": {"IoU": 30.0 + gain(CLASS_DIFF["cat"])}, "dog": {"IoU": 40.0 + gain(CLASS_DIFF["dog"])}, "bird": {"IoU": 5.0}}
            _write(tmp_path / "sweep" / f"{dataset}-{spec.replace('/', '_')}.json",
                   {"kind": "eval", "config": {**config, "attention": spec}, "metrics": {"mIoU": 20.0 + gain(diff)}, "per_class": own})  # fmt: skip
        per_class_stats = {name: {"patches": 10, "diffusivity": d} for name, d in CLASS_DIFF.items()}
        _write(tmp_path / "analysis" / f"{dataset}.json",
               {"kind": "analysis", "config": {**config, "attention": "qq/softmax"}, "metrics": {"diffusivity": diff},
                "per_class": per_class_stats, "created": f"2026-01-0{i + 1}"})  # fmt: skip
    # an analysis of another resolution matches nothing
    _write(tmp_path / "analysis" / "other.json",
           {"kind": "analysis", "config": {**BASE, "resolution": 448, "dataset": "voc21", "attention": "qq/softmax"}, "metrics": {"diffusivity": 0.9}})  # fmt: skip
    return tmp_path


def test_cells_pair_each_sparse_run_with_its_softmax_run_and_analysis(results):
    records = collect([results / "sweep"])
    analyses = read_analyses([results / "analysis", results / "sweep"])
    assert len(analyses) == 5
    cells = gain_cells(records, analyses)
    assert len(cells) == 3 * 4
    by = {(c.dataset, c.normalizer): c for c in cells}
    c = by[("ade20k", "entmax:1.5")]
    assert (c.diffusivity, c.baseline, c.value, c.attention) == (0.4, 20.0, pytest.approx(24.0), "qq/softmax")
    assert c.gain == pytest.approx(4.0)
    rows = {r.group: r for r in correlations(cells)}
    assert rows["entmax:1.5"].n == 4 and rows["entmax:1.5"].pearson == pytest.approx(1.0)
    assert (rows["entmax:1.5"].slope, rows["entmax:1.5"].intercept) == pytest.approx((10.0, 0.0), abs=1e-9)
    assert rows["entmax:1.25"].spearman == pytest.approx(1.0) and rows["entmax:1.25"].pearson < 0.99
    assert rows["randmask:1.5"].pearson == pytest.approx(-1.0)
    assert list(rows) == ["entmax:1.25", "entmax:1.5", "randmask:1.5", "entmax family"] and rows["entmax family"].n == 8


def test_per_class_cells_use_class_iou_and_class_diffusivity(results):
    cells = gain_cells(collect([results / "sweep"]), read_analyses([results / "analysis"]), per_class=True)
    assert len(cells) == 3 * 4 * 2  # bird has no IoU in the softmax runs and no patches in the analyses
    dog = next(c for c in cells if c.class_name == "dog" and c.normalizer == "entmax:1.5" and c.dataset == "voc21")
    assert (dog.diffusivity, dog.baseline, dog.gain) == (0.6, 40.0, pytest.approx(6.0))
    rows = {r.group: r for r in correlations(cells)}
    assert rows["entmax:1.5"].pearson == pytest.approx(1.0) and rows["entmax:1.5"].n == 8


def test_gain_report_files_and_cli(results, tmp_path):
    out = tmp_path / "gain"
    written, rows, class_rows = write_gain_report(collect([results / "sweep"]), read_analyses([results]), out)
    assert {p.name for p in written} == {"gain-vs-diffusivity.png", "gain-vs-diffusivity.csv", "gain-vs-diffusivity.md",
                                          "gain-vs-diffusivity-per-class.png", "gain-vs-diffusivity-per-class.csv"}  # fmt: skip
    assert Image.open(out / "gain-vs-diffusivity.png").size == (640, 460)
    table = list(csv.DictReader(io.StringIO((out / "gain-vs-diffusivity.csv").read_text())))
    assert len(table) == 12 and {"diffusivity", "baseline", "value", "gain", "normalizer"} <= set(table[0])
    row = next(r for r in table if r["dataset"] == "coco-stuff" and r["normalizer"] == "entmax:1.5")
    assert float(row["gain"]) == pytest.approx(7.0) and float(row["diffusivity"]) == 0.7
    md = (out / "gain-vs-diffusivity.md").read_text()
    assert "| entmax:1.5 | 4 | 1.000 | 1.000 | 10.000 | 0.000 |" in md and "per-class IoU" in md
    with pytest.raises(ReportError, match="exists"):
        write_gain_report(collect([results / "sweep"]), read_analyses([results]), out)
    with pytest.raises(ReportError, match="no cell"):
        write_gain_report(collect([results / "sweep"]), [], tmp_path / "none")

    runner = CliRunner()
    result = runner.invoke(app, ["report", str(results / "sweep"), str(results / "analysis"), "--diffusivity", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert "Pearson r" in result.stdout and "entmax family" in result.stdout
    assert (tmp_path / "cli" / "gain-vs-diffusivity.png").is_file()
    missing = runner.invoke(app, ["report", str(results / "sweep"), "--diffusivity", str(tmp_path / "cli2")])
    assert missing.exit_code == 2 and "no cell" in missing.stderr
    assert np.isfinite([r.pearson for r in class_rows]).all()
