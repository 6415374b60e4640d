"""Each FG-OVD split is reported at the N of hard negatives it supports, and a grid asking for an N a file
cannot give fails before any cell runs (issue 15, finding 7)."""

import json
from pathlib import Path

import pytest

from clipseg_sparse.evaluation.fgovd import fgovd_metrics
from clipseg_sparse.evaluation.fgovd.data import negative_counts
from clipseg_sparse.evaluation.fgovd.metrics import supported_negatives
from clipseg_sparse.sweeps.grid import Grid, check_fgovd_negatives
from conftest import TINY_CONFIG
from test_common import assert_one_line_error, invoke

FULL = Path(__file__).parents[2] / "data" / "fgovd" / "transparency.json"


def test_the_real_transparency_file_is_reported_at_two_negatives():
    counts = negative_counts(FULL)
    assert len(counts) == 409 and sum(c == 2 for c in counts) == 377 and max(counts) == 8
    # by hand: 408 regions reach N = 2 (one has a single negative), only 31 reach N = 3
    assert sum(c >= 2 for c in counts) == 408 and sum(c >= 3 for c in counts) == 31
    assert supported_negatives(counts, 10) == 2
    assert supported_negatives([10] * 5, 10) == 10 and supported_negatives([10] * 5, 4) == 4
    assert supported_negatives([1, 1, 3, 3], 10) == 3  # half the regions reach 3
    assert supported_negatives([], 10) is None


def test_metrics_hold_each_split_at_its_own_n():
    records = [{"split": "transparency", "scores": s} for s in ([0.9, 0.1, 0.2], [0.1, 0.5, 0.0], [0.8, 0.2, 0.9, 0.1, 0.0])]
    records += [{"split": s, "scores": [0.5] + [0.1 * i for i in range(10)]} for s in ("hard", "medium", "easy")]
    m = fgovd_metrics(records, negatives=10)
    assert m["transparency.n"] == 2 and m["hard.n"] == 10 and m["mean.n"] == 10
    # transparency at N = 2, by hand: ranks 1, 2, 2 -> top-1 1/3, mean rank 5/3
    assert m["transparency.top1"] == pytest.approx(100 / 3) and m["transparency.mean_rank"] == pytest.approx(5 / 3)
    assert m["transparency.count"] == 3 and m["transparency.top1"] == m["transparency.top1@2"]
    assert "transparency.top1@10" not in m  # what the old grid's top1@10 report asked for
    # hard at N = 10: scores 0.0..0.9 against 0.5 -> 0.5..0.9 tie or beat it: rank 1 + 5 = 6
    assert m["hard.mean_rank"] == 6 and m["mean.top1"] == 0.0


def test_a_report_metric_no_file_can_give_fails_before_running(tmp_path):
    grid = Grid(models=[TINY_CONFIG], pretrained="none", fgovd=[str(FULL)], negatives=10)
    with pytest.raises(ValueError, match=r"report metric top1@10: transparency.json has no region with 10 hard negatives \(at most 8\)"):
        check_fgovd_negatives(grid, "top1@10")
    assert check_fgovd_negatives(grid, "top1") == [
        "transparency.json: most regions have fewer than 10 hard negatives; reported at N = 2 (`top1` = top1@2)"
    ]
    toml = tmp_path / "mine.toml"
    toml.write_text(f'models = ["{TINY_CONFIG}"]\npretrained = "none"\nfgovd = ["{FULL}"]\nnegatives = 10\n\n[report]\nrows = "source"\ncols = "dataset"\nmetric = "top1@10"\n')
    result = invoke("reproduce", toml, "--out", tmp_path / "out", "--images-root", tmp_path)
    assert_one_line_error(result, "report metric top1@10", "transparency.json")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.json"))  # no cell ran


def test_the_shipped_fgovd_grid_reports_each_split_at_its_own_n():
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    spec = read_grid_file(GRIDS.get("fgovd"), benchmarks_dir=FULL.parent)
    assert spec.report["metric"] == "top1"
    transparency = Grid(models=spec.grid.models, pretrained=spec.grid.pretrained, negatives=spec.grid.negatives, fgovd=[str(FULL)])
    check_fgovd_negatives(transparency, spec.report["metric"])  # no error: the grid can be reported
