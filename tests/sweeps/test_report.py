"""The reporter on hand-written result files (the result schema is its input; the numbers are made up
here and every expected table entry below is worked out by hand from them)."""

import csv
import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from clipseg_sparse.sweeps.plots import alpha_series, dataset_series, resolution_series, write_plots
from clipseg_sparse.sweeps.records import ReportError, collect, default_metric
from clipseg_sparse.sweeps.report import pivot, to_csv, to_markdown, to_rich

BASE = {
    "model": "ViT-B-16",
    "pretrained": "openai",
    "precision": "fp32",
    "protocol": "sclip",
    "window": 224,
    "stride": 112,
    "logit_scale": 40.0,
}
# (dataset, resolution, attention) -> mIoU
RUNS = {
    ("voc21", 336, "qk/softmax/noffn"): 20.0,
    ("voc21", 336, "qk/entmax:1.5/noffn"): 24.0,
    ("voc21", 336, "qk/sparsemax/noffn"): 22.5,
    ("voc21", 336, "qq/softmax/noffn"): 40.0,
    ("voc21", 336, "qq/entmax:1.5/noffn"): 45.0,
    ("voc21", 336, "qq/sparsemax/noffn"): 43.0,
    ("voc21", 336, "qq/randmask:1.5/noffn"): 38.0,
    ("voc21", 336, "qq+kk/softmax/noffn"): 59.1,
    ("voc21", 336, "qq+kk/entmax:1.5/noffn"): 60.3,
    ("voc21", 448, "qq/softmax/noffn"): 41.0,
    ("voc21", 448, "qq/entmax:1.5/noffn"): 47.5,
    ("ade20k", 336, "qq/softmax/noffn"): 16.0,
    ("ade20k", 336, "qq/entmax:1.5/noffn"): 17.25,
    ("ade20k", 336, "kk/entmax:1.5/noffn"): 15.0,  # no kk softmax run: no delta
}


def write_result(path, kind, config, metrics, created="2025-01-01T00:00:00"):
    record = {"schema": 1, "kind": kind, "config": config, "metrics": metrics, "per_class": {},
              "versions": {"torch": "x"}, "timing": {"wall_s": 1.0}, "created": created}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    for i, ((dataset, res, attn), miou) in enumerate(RUNS.items()):
        config = {**BASE, "dataset": dataset, "resolution": res, "attention": attn, "classes": [dataset, "x"]}
        write_result(folder / f"r{i:02d}.json", "eval", config, {"mIoU": miou, "mAcc": miou + 10, "aAcc": 90.0})
    # things a results folder also holds, which are not results
    (folder / "deadbeef.error.json").write_text(json.dumps({"schema": 1, "kind": "error", "error": "boom"}))
    (folder / "r00.jsonl").write_text('{"config": {}}\n')
    (folder / "broken.json").write_text("{not json")
    return folder


def test_collect_folders_files_globs_and_skips_non_results(results):
    assert len(collect([results])) == len(RUNS)
    assert len(collect([results / "r00.json", results / "r01.json"])) == 2
    assert len(collect([str(results / "r0*.json")])) == 10
    with pytest.raises(ReportError, match="no such file"):
        collect([results / "nope*.json"])


def test_collect_keeps_newest_of_duplicate_runs(results, tmp_path):
    config = {**BASE, "dataset": "voc21", "resolution": 336, "attention": "qk/softmax/noffn", "classes": ["voc21", "x"]}
    write_result(tmp_path / "copy" / "again.json", "eval", config, {"mIoU": 21.0}, created="2025-02-01T00:00:00")
    records = collect([results, tmp_path / "copy"])
    assert len(records) == len(RUNS)
    [qk] = [r for r in records if r.config["attention"] == "qk/softmax/noffn" and r.config["dataset"] == "voc21"
            and r.config["resolution"] == 336]  # fmt: skip
    assert qk.metrics["mIoU"] == 21.0


def test_derived_keys(results):
    rec = next(r for r in collect([results]) if r.config["attention"] == "qq+kk/entmax:1.5/noffn")
    assert (rec.keys["source"], rec.keys["normalizer"], rec.keys["alpha"], rec.keys["block"]) == ("qq+kk", "entmax:1.5", 1.5, "noffn")


def test_pivot_source_by_normalizer_splits_by_dataset_and_resolution(results):
    tables = pivot(collect([results]), rows="source", cols="normalizer", metric="mIoU")
    assert [t.title for t in tables] == [
        "dataset=ade20k, resolution=336",
        "dataset=voc21, resolution=336",
        "dataset=voc21, resolution=448",
    ]
    voc = tables[1]
    assert voc.row_values == ["qk", "qq", "qq+kk"]
    assert voc.col_values == ["softmax", "entmax:1.5", "sparsemax", "randmask:1.5"]
    cell = voc.cell("qq", "entmax:1.5")
    assert cell.value == 45.0 and cell.delta == pytest.approx(5.0)
    assert voc.cell("qq", "sparsemax").delta == pytest.approx(3.0)
    assert voc.cell("qq", "randmask:1.5").delta == pytest.approx(-2.0)
    assert voc.cell("qk", "entmax:1.5").delta == pytest.approx(4.0)
    assert voc.cell("qq+kk", "entmax:1.5").delta == pytest.approx(1.2)
    assert voc.cell("qq", "softmax").delta is None
    assert voc.cell("qq+kk", "sparsemax") is None
    # the delta is against the softmax run at the same resolution, not the other one
    assert tables[2].cell("qq", "entmax:1.5").delta == pytest.approx(6.5)
    ade = tables[0]
    assert ade.cell("kk", "entmax:1.5").value == 15.0 and ade.cell("kk", "entmax:1.5").delta is None


def test_pivot_dataset_by_resolution(results):
    records = [r for r in collect([results]) if r.keys["source"] == "qq" and r.keys["normalizer"] in ("softmax", "entmax:1.5")]
    tables = pivot(records, rows="dataset", cols="resolution", metric="mAcc")
    assert [t.title for t in tables] == ["normalizer=softmax", "normalizer=entmax:1.5"]
    ent = tables[1]
    assert ent.row_values == ["ade20k", "voc21"] and ent.col_values == [336, 448]
    assert ent.cell("voc21", 448).value == 57.5 and ent.cell("voc21", 448).delta == pytest.approx(6.5)
    assert ent.cell("ade20k", 448) is None


def test_markdown_and_csv(results):
    tables = pivot(collect([results]), metric="mIoU")
    md = to_markdown(tables)
    assert "**mIoU: dataset=voc21, resolution=336**" in md
    assert "| qq | 40.00 | 45.00 (+5.00) | 43.00 (+3.00) | 38.00 (-2.00) |" in md
    assert "| qq+kk | 59.10 | 60.30 (+1.20) |  |  |" in md
    assert "| source \\ normalizer | softmax | entmax:1.5 |" in md  # ade20k table has no sparsemax column
    rows = list(csv.reader(io.StringIO(to_csv(tables))))
    header = next(r for r in rows if "source" in r and "sparsemax" in r)
    assert header[:4] == ["dataset", "resolution", "metric", "source"]
    qq = next(r for r in rows if r[:4] == ["voc21", "336", "mIoU", "qq"])
    line = dict(zip(header, qq))
    assert float(line["entmax:1.5"]) == 45.0 and float(line["delta entmax:1.5"]) == pytest.approx(5.0)
    assert float(line["delta randmask:1.5"]) == pytest.approx(-2.0) and float(line["softmax"]) == 40.0


def test_rich_table(results):
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    for t in pivot(collect([results])):
        console.print(to_rich(t))
    text = console.export_text()
    assert "mIoU: dataset=voc21, resolution=448" in text
    assert "47.50 (+6.50)" in text and "60.30 (+1.20)" in text


def test_errors(results, tmp_path):
    records = collect([results])
    with pytest.raises(ReportError, match="metric 'IoU'"):
        pivot(records, metric="IoU")
    with pytest.raises(ReportError, match="unknown key 'sauce'"):
        pivot(records, rows="sauce")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no result files"):
        pivot(collect([tmp_path / "empty"]), metric="mIoU")


def test_fgovd_results_split_into_per_split_records(tmp_path):
    # one run over three benchmark files (its own means), and one run over one file
    for name, attn, splits, top1 in (("a", "qq/softmax", ["hard", "medium", "easy"], [20.0, 40.0, 60.0]),
                                     ("b", "qq/entmax:1.5", ["hard", "medium", "easy"], [26.0, 41.0, 59.0]),
                                     ("c", "qq/entmax:1.5", ["color"], [70.0])):  # fmt: skip
        config = {**BASE, "benchmarks": splits, "attention": attn, "region": "pool", "negatives": 10}
        metrics = {}
        for split, t in zip(splits, top1):
            metrics |= {f"{split}.top1@10": t, f"{split}.top1@2": t + 20, f"{split}.mean_rank@10": 2.0, f"{split}.count@10": 5.0}
        if len(splits) == 3:
            metrics |= {"mean.top1@10": sum(top1) / 3, "mean.top1@2": sum(top1) / 3 + 20}
        write_result(tmp_path / f"{name}.json", "fgovd", config, metrics)
    records = collect([tmp_path])
    assert len(records) == 4 + 4 + 1
    assert default_metric(records) == "top1@10"  # not top1@2, which sorts after it as text
    hard = next(r for r in records if r.keys["dataset"] == "hard" and r.keys["normalizer"] == "softmax")
    assert hard.metrics == {"top1@10": 20.0, "top1@2": 40.0, "mean_rank@10": 2.0, "count@10": 5.0}
    [table] = pivot([r for r in records if r.keys["benchmarks"] != ["color"]], rows="normalizer", cols="dataset", metric="top1@10")
    assert table.col_values == ["easy", "hard", "mean", "medium"]
    assert table.cell("entmax:1.5", "hard").delta == pytest.approx(6.0)
    assert table.cell("entmax:1.5", "mean").value == pytest.approx(42.0)
    assert table.cell("entmax:1.5", "mean").delta == pytest.approx(2.0)
    # the single-file run has no softmax partner: shown without a delta
    color = next(r for r in records if r.keys["dataset"] == "color")
    assert color.metrics["top1@10"] == 70.0 and color.keys["split"] == "color"


def test_series_prepared_for_plots(results):
    records = collect([results])
    alpha = alpha_series(records, "mIoU")
    titles = [t for t, _ in alpha.panels]
    assert titles == ["dataset=ade20k, resolution=336", "dataset=voc21, resolution=336", "dataset=voc21, resolution=448"]
    voc = dict(alpha.panels)["dataset=voc21, resolution=336"]
    assert list(voc) == ["qk", "qq", "qq+kk"]
    assert voc["qq"] == [(1.0, 40.0), (1.5, 45.0), (2.0, 43.0)]  # randmask left out
    assert voc["qq+kk"] == [(1.0, 59.1), (1.5, 60.3)]
    assert alpha.x_values == [1.0, 1.5, 2.0]

    res = resolution_series(records, "mIoU")
    voc_qq = dict(res.panels)["dataset=voc21, source=qq"]
    assert voc_qq["softmax"] == [(336, 40.0), (448, 41.0)]
    assert voc_qq["entmax:1.5"] == [(336, 45.0), (448, 47.5)]

    bars = dataset_series([r for r in records if r.keys["resolution"] == 336], "mIoU")
    qq = dict(bars.panels)["source=qq"]
    assert qq["softmax"] == [("ade20k", 16.0), ("voc21", 40.0)]
    assert qq["entmax:1.5"] == [("ade20k", 17.25), ("voc21", 45.0)]
    assert "randmask:1.5" not in qq


def _assert_real_plot(path):
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape[0] >= 300 and img.shape[1] >= 400
    assert img.std() > 10  # not a blank canvas
    # matplotlib's first two default colours (C0 blue, C1 orange) are drawn: lines or bars are there
    for colour in ((31, 119, 180), (255, 127, 14)):
        assert (np.abs(img.astype(int) - colour).sum(-1) < 30).sum() > 50, colour


def test_write_plots(results, tmp_path):
    out = tmp_path / "plots"
    written = write_plots(collect([results]), "mIoU", out)
    assert sorted(p.name for p in written) == ["alpha.png", "datasets.png", "resolution.png"]
    for path in written:
        _assert_real_plot(path)
    with pytest.raises(ReportError, match="exists"):
        write_plots(collect([results]), "mIoU", out)
    assert len(write_plots(collect([results]), "mIoU", out, overwrite=True)) == 3


def test_plots_need_data_to_show(results, tmp_path):
    one_res = [r for r in collect([results]) if r.keys["resolution"] == 336 and r.keys["dataset"] == "voc21"]
    written = write_plots(one_res, "mIoU", tmp_path / "p")
    assert [p.name for p in written] == ["alpha.png", "datasets.png"]  # no resolution study in the data


def test_report_cli(results, tmp_path):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    runner = CliRunner()
    out = tmp_path / "rep"
    args = ["report", str(results), "--rows", "source", "--cols", "normalizer", "--metric", "mIoU",
            "--markdown", str(out / "t.md"), "--csv", str(out / "t.csv"), "--plots", str(out / "plots")]  # fmt: skip
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "45.00 (+5.00)" in result.stdout and "dataset=voc21, resolution=448" in result.stdout
    assert "| qq | 40.00 | 45.00 (+5.00) | 43.00 (+3.00) | 38.00 (-2.00) |" in (out / "t.md").read_text()
    assert "delta entmax:1.5" in (out / "t.csv").read_text()
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["alpha.png", "datasets.png", "resolution.png"]
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "exists" in again.output and "45.00" not in again.stdout
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0
    bad = runner.invoke(app, ["report", str(results), "--metric", "IoU"])
    assert bad.exit_code == 2 and "metric 'IoU'" in bad.output


def test_csv_header_has_the_delta_columns_of_every_table_it_heads(results):
    """Issue 15 finding 6 (`reproduce resolution`): the softmax table came first without deltas, so the
    shared header had 6 columns and the entmax rows below it 8."""
    records = [r for r in collect([results]) if r.keys["source"] == "qq" and r.keys["normalizer"] in ("softmax", "entmax:1.5")]
    rows = list(csv.reader(io.StringIO(to_csv(pivot(records, rows="dataset", cols="resolution", metric="mIoU")))))
    header = rows[0]
    assert header == ["normalizer", "metric", "dataset", "336", "448", "delta 336", "delta 448"]
    assert all(len(r) == len(header) for r in rows)  # one block: no blank line, no second header
    line = dict(zip(header, next(r for r in rows if r[:3] == ["entmax:1.5", "mIoU", "voc21"])))
    assert float(line["delta 448"]) == pytest.approx(47.5 - 41.0) and float(line["delta 336"]) == pytest.approx(45.0 - 40.0)
    soft = dict(zip(header, next(r for r in rows if r[:3] == ["softmax", "mIoU", "voc21"])))
    assert soft["delta 448"] == "" and float(soft["448"]) == 41.0


def published_run(folder, protocol, dataset, miou, normalizer="softmax", **change):
    """A result file of `protocol` run as published on `dataset` (its settings, spec, class names, the paper's
    CLIP) with the given mIoU; `change` alters its config."""
    import dataclasses

    from clipseg_sparse.evaluation.protocols import PROTOCOLS
    from clipseg_sparse.evaluation.published import PUBLISHED

    p, entry = PROTOCOLS.get(protocol), PUBLISHED.get(protocol)
    config = {**dataclasses.asdict(p.settings(dataset)), "protocol": protocol, "dataset": dataset, "model": entry.model, "pretrained": entry.pretrained,
              "class_names": p.class_names, "attention": str(p.spec_for(dataset).replace(normalizer=normalizer)), **change}  # fmt: skip
    write_result(folder / f"{protocol}-{dataset}-{normalizer}-{len(list(folder.glob('*.json')) if folder.exists() else [])}.json", "eval", config,
                 {"mIoU": miou, "mAcc": 0.0, "aAcc": 0.0})  # fmt: skip


def test_cells_get_the_papers_number_and_the_difference(tmp_path):
    """SCLIP's paper prints VOC21 59.1: a softmax run at 60.0 is 0.9 over (marked beyond 0.5), entmax at 59.4 is
    +0.3 (not marked); a run at another resolution gets no paper number."""
    folder = tmp_path / "r"
    published_run(folder, "sclip", "voc21", 60.0)
    published_run(folder, "sclip", "voc21", 59.4, normalizer="entmax:1.5")
    published_run(folder, "sclip", "voc21", 50.0, resolution=448)
    [table448, table336] = sorted(pivot(collect([folder]), rows="source", cols="normalizer"), key=lambda t: t.title, reverse=True)
    assert all(c.paper is None for c in table448.cells.values())
    soft, ent = table336.cell("qq+kk", "softmax"), table336.cell("qq+kk", "entmax:1.5")
    assert (soft.paper.published, soft.paper.beyond, ent.paper.beyond) == (59.1, True, False)
    md = to_markdown([table336])
    assert "60.00; paper 59.1 (+0.90)! | 59.40 (-0.60); paper 59.1 (+0.30) |" in md
    assert "- sclip (ViT-B-16:openai): SCLIP paper Table 1" in md and "|D| > 0.5" in md
    assert "|D| > 1" in to_markdown(pivot(collect([folder]), tolerance=1.0)) and "59.1 (+0.90)!" not in to_markdown(pivot(collect([folder]), tolerance=1.0))
    rows = list(csv.reader(io.StringIO(to_csv([table336]))))
    line = dict(zip(rows[0], rows[1]))
    assert float(line["paper softmax"]) == 59.1 and float(line["vs paper entmax:1.5"]) == pytest.approx(0.3)
    rich = render_rich(to_rich(table336))
    assert "paper 59.1 (+0.90)!" in rich and "paper 59.1 (+0.30)" in rich


def render_rich(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_leaderboard_puts_each_paper_row_above_this_runs_rows(tmp_path):
    from clipseg_sparse.evaluation.published import EIGHT, PUBLISHED
    from clipseg_sparse.sweeps.report import leaderboard, to_html

    folder = tmp_path / "r"
    paper = PUBLISHED.get("trident").miou
    for d in EIGHT:
        published_run(folder, "trident", d, paper[d] + 1.0)  # every benchmark 1 point over the paper
        published_run(folder, "trident", d, paper[d] - 2.0, normalizer="entmax:1.5")
    published_run(folder, "trident", "voc21", 80.0, model="ViT-B-16-quickgelu", pretrained="metaclip_fullcc")  # trident-metaclip's row
    board = leaderboard(collect([folder]))
    rows = board.row_values
    i = rows.index("trident (paper, ViT-B-16:openai)")
    assert rows[i + 1 : i + 3] == ["trident (softmax)", "trident (entmax:1.5)"]
    assert rows.index("ovstitcher (paper, ViT-B-16:openai)") < i < rows.index("sclip (paper, ViT-B-16:openai)")  # best published average first
    assert board.cell(rows[i], "avg-8").value == pytest.approx(45.825) and board.cell(rows[i], "avg-8").paper is None
    soft_avg = board.cell("trident (softmax)", "avg-8")
    assert soft_avg.value == pytest.approx(46.825) and soft_avg.paper.delta == pytest.approx(1.0) and soft_avg.paper.beyond
    ent = board.cell("trident (entmax:1.5)", "ade20k").paper
    assert ent.delta == pytest.approx(-2.0) and not ent.beyond  # another normalizer's difference is its gain, never a gap
    assert not board.cell("trident (entmax:1.5)", "avg-8").paper.beyond
    assert board.cell("trident-metaclip (softmax)", "voc21").paper.published == 68.4
    assert board.cell("trident-metaclip (softmax)", "avg-8") is None  # one benchmark ran: no average
    html = to_html([board])
    assert "<td>trident (softmax)</td>" in html and re.search(r"class='paper beyond'>paper 45\.8\d? \(\+1\.00\)!", html)
    assert "YuHengsss/Trident@a93b346 assets/data_result.png" in html


def test_report_cli_leaderboard_and_html_table(tmp_path):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    folder = tmp_path / "r"
    published_run(folder, "pearl", "voc21", 63.0)
    runner = CliRunner()
    out = tmp_path / "o"
    result = runner.invoke(app, ["report", str(folder), "--html-table", str(out / "t.html"), "--markdown", str(out / "t.md"), "--tolerance", "2"],
                           env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "paper 64.1 (-1.10)" in result.stdout and "paper 64.1 (-1.10)!" not in (out / "t.md").read_text()
    assert "<span class='paper'>paper 64.1 (-1.10)</span>" in (out / "t.html").read_text()
    board = runner.invoke(app, ["report", str(folder), "--leaderboard", "--markdown", str(out / "b.md")], env={"COLUMNS": "250"})
    assert board.exit_code == 0, board.output
    assert "| pearl (softmax) | 63.00; paper 64.1 (-1.10)! |" in (out / "b.md").read_text()
    assert runner.invoke(app, ["report", str(folder), "--tolerance", "-1"]).exit_code == 2
