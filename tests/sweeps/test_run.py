"""Real sweeps with the tiny random ViT on generated datasets in their exact on-disk layouts."""

import json
import shutil

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.sweeps.grid import Grid
from clipseg_sparse.sweeps.plots import write_plots
from clipseg_sparse.sweeps.records import collect, default_metric
from clipseg_sparse.sweeps.report import pivot, to_markdown
from clipseg_sparse.sweeps.run import SweepPaths, run_sweep
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark

SIZE = (48, 64)


def grid(**changes):
    base = dict(models=[TINY_CONFIG], pretrained="none", datasets=["ade20k", "voc21", "context59"],
                normalizers=["softmax", "entmax:1.5"], resolutions=[48, 64], templates="single")  # fmt: skip
    return Grid(**{**base, **changes})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to share among threads; on a busy machine two threads make
    each forward ~100x slower than one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_benchmark("ade20k", root / "ade", n=3, size=SIZE)
    make_benchmark("voc21", root / "voc", n=2, size=SIZE, seed=1)
    return root


def roots(data_root):
    # context59 points at a folder that does not exist: its cells must fail and be recorded
    return {"ade20k": data_root / "ade", "voc21": data_root / "voc", "context59": data_root / "missing"}


class Counter:
    """Wraps a function and counts its calls; raises KeyboardInterrupt at call number `interrupt_at`."""

    def __init__(self, fn, interrupt_at=None):
        self.fn, self.calls, self.interrupt_at = fn, 0, interrupt_at

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.fn(*args, **kwargs)


def counting(monkeypatch, interrupt_at=None):
    """Count model loads and segmented images (optionally interrupting at one image)."""
    import clipseg_sparse.models.clip
    from clipseg_sparse.segment.segmenter import Segmenter

    loads = Counter(clipseg_sparse.models.clip.load_clip)
    images = Counter(Segmenter.predict_labels, interrupt_at)
    monkeypatch.setattr(clipseg_sparse.models.clip, "load_clip", loads)
    monkeypatch.setattr(Segmenter, "predict_labels", lambda self, rgb, name=None: images(self, rgb, name))
    return loads, images


@pytest.fixture(scope="module")
def swept(data_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as mp:
        loads, images = counting(mp)
        summary = run_sweep(grid(), SweepPaths(out, roots(data_root)), device="cpu", progress=False)
    return out, summary, loads.calls, images.calls


def result_files(out):
    return sorted(p for p in out.glob("*.json") if not p.name.endswith(".error.json"))


def test_sweep_writes_one_result_per_cell_and_records_failures(swept):
    out, summary, loads, images = swept
    cells = grid().cells()
    assert summary.total == len(cells) == 3 * 2 * 2
    assert (summary.ran, summary.skipped, len(summary.failed)) == (8, 0, 4)
    assert loads == 1  # one model for the whole sweep
    assert images == 2 * 2 * (3 + 2)  # normalizers x resolutions x (ade20k + voc21 images)
    files = result_files(out)
    assert [p.stem for p in files] == sorted(c.hash for c in cells if c.data != "context59")
    for path in files:
        record = json.loads(path.read_text())
        cell = next(c for c in cells if c.hash == path.stem)
        cfg = record["config"]
        assert (cfg["dataset"], cfg["attention"], cfg["resolution"]) == (cell.data, cell.attention, cell.resolution)
        assert 0.0 <= record["metrics"]["mIoU"] <= 100.0
    errors = sorted(out.glob("*.error.json"))
    assert [p.name.split(".")[0] for p in errors] == sorted(c.hash for c in cells if c.data == "context59")
    error = json.loads(errors[0].read_text())
    assert error["kind"] == "error" and error["config"]["dataset"] == "context59"
    assert "DatasetError" in error["error"] and "missing" in error["error"] and error["traceback"]
    assert {f.cell.data for f in summary.failed} == {"context59"}


def test_rerun_skips_done_cells_without_recomputing(swept, data_root, monkeypatch):
    out, *_ = swept
    before = {p: p.stat().st_mtime_ns for p in result_files(out)}
    loads, images = counting(monkeypatch)
    summary = run_sweep(grid(), SweepPaths(out, roots(data_root)), device="cpu", progress=False)
    assert (summary.skipped, summary.ran, len(summary.failed)) == (8, 0, 4)  # failed cells are retried
    assert images.calls == 0
    assert {p: p.stat().st_mtime_ns for p in result_files(out)} == before


def test_failed_cells_run_once_their_data_is_there(swept, data_root, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    shutil.copytree(swept[0], out)
    fixed = {**roots(data_root), "context59": tmp_path / "ctx"}
    make_benchmark("context59", fixed["context59"], n=2, size=SIZE, seed=2)
    loads, images = counting(monkeypatch)
    summary = run_sweep(grid(), SweepPaths(out, fixed), device="cpu", progress=False)
    assert (summary.skipped, summary.ran, len(summary.failed)) == (8, 4, 0)
    assert images.calls == 4 * 2
    assert not list(out.glob("*.error.json")) and len(result_files(out)) == 12


def test_interrupted_sweep_resumes_where_it_stopped(swept, data_root, tmp_path, monkeypatch):
    small = grid(datasets=["ade20k", "voc21"])  # 8 cells; the same cells (and hashes) as in `swept`
    out = tmp_path / "sweep"
    loads, images = counting(monkeypatch, interrupt_at=5)  # Ctrl-C on the 2nd image of the 2nd cell
    with pytest.raises(KeyboardInterrupt):
        run_sweep(small, SweepPaths(out, roots(data_root)), device="cpu", progress=False)
    cells = small.cells()
    assert [p.stem for p in result_files(out)] == [cells[0].hash]
    progress_log = out / f"{cells[1].hash}.progress.jsonl"
    assert len(progress_log.read_text().splitlines()) == 1 + 1  # header + the one finished image

    loads, images = counting(monkeypatch)
    summary = run_sweep(small, SweepPaths(out, roots(data_root)), device="cpu", progress=False)
    assert (summary.skipped, summary.ran, len(summary.failed)) == (1, 7, 0)
    assert images.calls == 2 * 2 * (3 + 2) - 3 - 1  # all images but the first cell's 3 and the one logged
    # resumed results equal the uninterrupted sweep's, cell by cell
    for path in result_files(out):
        again = json.loads(path.read_text())["metrics"]
        assert again == pytest.approx(json.loads((swept[0] / path.name).read_text())["metrics"])


def test_report_of_a_sweep(swept, tmp_path):
    out, *_ = swept
    records = collect([out])
    assert len(records) == 8
    tables = pivot(records, rows="normalizer", cols="resolution", metric="mIoU")
    assert [t.title for t in tables] == ["dataset=ade20k", "dataset=voc21"]
    raw = {}
    for path in result_files(out):
        cfg, metrics = (json.loads(path.read_text())[k] for k in ("config", "metrics"))
        raw[cfg["dataset"], cfg["attention"], cfg["resolution"]] = metrics["mIoU"]
    voc = tables[1]
    for res in (48, 64):
        soft, ent = raw["voc21", "qk/softmax", res], raw["voc21", "qk/entmax:1.5", res]
        assert voc.cell("softmax", res).value == soft and voc.cell("softmax", res).delta is None
        assert voc.cell("entmax:1.5", res).delta == pytest.approx(ent - soft)
    md = to_markdown(tables)
    soft, ent = raw["ade20k", "qk/softmax", 64], raw["ade20k", "qk/entmax:1.5", 64]
    assert f"| entmax:1.5 | {raw['ade20k', 'qk/entmax:1.5', 48]:.2f}" in md
    assert f"{ent:.2f} ({ent - soft:+.2f}) |" in md
    written = write_plots(records, "mIoU", tmp_path / "plots")
    assert sorted(p.name for p in written) == ["alpha.png", "datasets.png", "resolution.png"]
    for path in written:
        img = np.asarray(Image.open(path).convert("RGB")).astype(int)
        assert img.shape[0] > 200 and img.std() > 10
        assert (np.abs(img - (31, 119, 180)).sum(-1) < 30).sum() > 50  # the first series is drawn


def test_cli_sweep_report_and_reproduce(data_root, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["sweep", "--models", TINY_CONFIG, "--pretrained", "none", "--datasets", "voc21,context59",
            "--alphas", "1.5", "--normalizers", "softmax", "--resolutions", "48", "--templates", "single",
            "--root", str(data_root / "missing"), "--root", f"voc21={data_root / 'voc'}", "--out", str(out), "--device", "cpu"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output  # context59's cells failed, voc21's ran
    assert "4 cells: 0 already done, 2 ran, 2 failed" in result.stderr
    assert "text: 56 names x 1 templates" in result.stderr and "prompts/s" in result.stderr  # inside the cells
    assert len(result_files(out)) == 2 and len(list(out.glob("*.error.json"))) == 2
    again = runner.invoke(app, args)
    assert "4 cells: 2 already done, 0 ran, 2 failed" in again.stderr

    rep = runner.invoke(app, ["report", str(out), "--rows", "dataset", "--cols", "normalizer", "--csv", str(tmp_path / "t.csv")],
                        env={"COLUMNS": "200"})  # fmt: skip
    assert rep.exit_code == 0, rep.output
    [record] = [json.loads(p.read_text()) for p in result_files(out) if "entmax" in json.loads(p.read_text())["config"]["attention"]]
    assert f"{record['metrics']['mIoU']:.2f}" in rep.stdout
    assert "dataset,metric" not in (tmp_path / "t.csv").read_text()  # nothing else varies: no group columns
    assert (tmp_path / "t.csv").read_text().startswith("metric,dataset,softmax,entmax:1.5,delta entmax:1.5\n")

    toml = tmp_path / "mine.toml"
    toml.write_text(
        f'description = "tiny"\nmodels = ["{TINY_CONFIG}"]\npretrained = "none"\ndatasets = ["voc21"]\n'
        f'alphas = [1.25, 1.5]\nnormalizers = ["softmax", "sparsemax"]\nresolutions = [48]\ntemplates = "single"\n'
        f'[roots]\nvoc21 = "{data_root / "voc"}"\n[report]\nrows = "source"\ncols = "normalizer"\n'
    )
    repro = runner.invoke(app, ["reproduce", str(toml), "--out", str(tmp_path / "repro"), "--device", "cpu"], env={"COLUMNS": "200"})
    assert repro.exit_code == 0, repro.output
    md = (tmp_path / "repro" / "report.md").read_text()
    assert "| source \\ normalizer | softmax | entmax:1.25 | entmax:1.5 | sparsemax |" in md
    assert sorted(p.name for p in (tmp_path / "repro" / "plots").iterdir()) == ["alpha.png", "datasets.png"]
    assert (tmp_path / "repro" / "report.csv").is_file() and "<table>" in (tmp_path / "repro" / "report.html").read_text()


def test_reproduce_leaderboard_runs_the_papers_grids_and_renders_table_1(data_root, tmp_path):
    """A smoke run (tiny random CLIP, one image): the cells run and the leaderboard is written with every
    paper's row; random weights are not the paper's CLIP, so no run row is compared (tests/sweeps/test_report.py
    covers the comparison)."""
    runner = CliRunner()
    out = tmp_path / "board"
    args = ["reproduce", "leaderboard", "--only", "sclip", "--models", TINY_CONFIG, "--pretrained", "none", "--limit", "1",
            "--root", str(data_root / "missing"), "--root", f"voc21={data_root / 'voc'}", "--out", str(out), "--device", "cpu"]  # fmt: skip
    result = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 1, result.output  # the seven benchmarks without data failed; voc21 ran
    assert "16 cells: 0 already done, 2 ran, 14 failed" in result.stderr
    md = (out / "leaderboard.md").read_text()
    assert "| sclip (paper, ViT-B-16:openai) | 59.10 | 30.40 |" in md and "| pearl (paper, ViT-B-16:openai) |" in md
    assert len(list((out / "sclip").glob("*.json"))) >= 2 and (out / "leaderboard.html").is_file()
    for bad, message in ((["--only", "nope"], "unknown published result 'nope'"), (["--only", "segearth-ov3"], "eval --protocol segearth-ov3")):
        refused = runner.invoke(app, ["reproduce", "leaderboard", *bad, "--out", str(tmp_path / "x")])
        assert refused.exit_code == 2 and message in refused.output
    assert runner.invoke(app, ["reproduce", "sfp", "--only", "sfp"]).exit_code == 2


def readme_demo_commands():
    """The shell commands of the docs' runnable sweep example (docs/sweeps.md), continuation lines joined."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "sweeps.md").read_text()
    block = text.split("## A sweep you can run without downloads", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.replace("\\\n", "").splitlines() if line.strip()]


def test_docs_sweep_example_runs(tmp_path, monkeypatch):
    """The docs' demo, run as written except for fewer images (--limit 1) at 64 px, for speed."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    tests_dir = Path(__file__).parents[1]
    make_data, sweep_cmd, report_cmd = readme_demo_commands()
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(make_data)
    assert argv[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", argv[2].replace("'tests'", repr(str(tests_dir)))], check=True)
    assert len(list((tmp_path / "demo/data").rglob("*.jpg"))) == 8

    sweep_args = [a.replace("tests/data/tiny-vit.json", TINY_CONFIG) for a in shlex.split(sweep_cmd)[1:]]
    runner = CliRunner()
    result = runner.invoke(app, [*sweep_args, "--limit", "1", "--resolutions", "64", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "40 cells: 0 already done, 40 ran, 0 failed" in result.stderr
    assert len(result_files(tmp_path / "demo/results")) == 40

    report = runner.invoke(app, shlex.split(report_cmd)[1:], env={"COLUMNS": "200"})
    assert report.exit_code == 0, report.output
    md = (tmp_path / "demo/report.md").read_text()
    page = (tests_dir.parent / "docs" / "sweeps.md").read_text()
    for line in md.splitlines():
        if line.startswith("**") or line.startswith("| source"):
            assert line in page  # the page shows this report's titles and header rows
    assert sorted(p.name for p in (tmp_path / "demo/plots").iterdir()) == ["alpha.png", "datasets.png"]


def test_fgovd_cells(tmp_path):
    """FG-OVD cells on the 2-image subset of the real Transparency file (images drawn at their declared sizes)."""
    from test_fgovd import SUBSET, make_images

    make_images(SUBSET, tmp_path / "coco")
    g = grid(datasets=[], fgovd=[str(SUBSET)], resolutions=[64], overrides={"window": 0}, templates=None)
    out = tmp_path / "sweep"
    no_images = run_sweep(g, SweepPaths(out), device="cpu", progress=False)
    assert (no_images.ran, len(no_images.failed)) == (0, 2)
    assert "--images-root" in no_images.failed[0].error
    summary = run_sweep(g, SweepPaths(out, images_root=tmp_path / "coco"), device="cpu", progress=False)
    assert (summary.ran, len(summary.failed)) == (2, 0) and not list(out.glob("*.error.json"))
    raw = {}
    for path in result_files(out):
        record = json.loads(path.read_text())
        assert record["kind"] == "fgovd" and record["config"]["benchmarks"] == ["transparency"]
        raw[record["config"]["attention"]] = record["metrics"]
    records = collect([out])
    most = max(len(a["neg_category_ids"]) for a in json.loads(SUBSET.read_text())["annotations"])
    assert most == 2 and raw["qk/softmax"]["transparency.n"] == 2  # every region has 2: the split's own N is 2
    assert default_metric(records) == "top1"  # each split at the N it supports
    [table] = pivot(records, rows="normalizer", cols="dataset")
    assert table.col_values == ["transparency"]
    soft, ent = raw["qk/softmax"][f"transparency.top1@{most}"], raw["qk/entmax:1.5"][f"transparency.top1@{most}"]
    assert table.cell("softmax", "transparency").value == soft
    assert table.cell("entmax:1.5", "transparency").delta == pytest.approx(ent - soft)
