"""`clipseg-sparse sweep`, `report` and `reproduce`: grids of runs, their tables and plots, and the shipped grids
of the published tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import analysis as cli_analysis
from .common import PAMR_HELP, BankOpt, Device, DeviceOpt, Precision, check_out, fail, note_softmax_aliases, out_console, user_errors
from .ls import Listable, registry_table
from ..runtime.progress import err_console

app = typer.Typer()
# its default is evaluation.published.TOLERANCE, read when a report renders (importing it here would load torch for --help)
TolOpt = Annotated[Optional[float], typer.Option("--tolerance", min=0.0, help="Mark a difference from the paper's number beyond this many mIoU points (default 0.5).")]


def _split(text: str | None) -> list[str] | None:
    """Comma-separated flag value -> list; None when the flag was not given."""
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


RootOpt = Annotated[
    Optional[list[str]],
    typer.Option("--root", help="Dataset root: DIR for every dataset, or NAME=DIR for one (repeatable)."),
]
ImagesRootOpt = Annotated[Optional[Path], typer.Option("--images-root", help="COCO 2017 images folder for FG-OVD cells.")]
SweepRegionsOpt = Annotated[
    Optional[list[str]],
    typer.Option("--regions", help="Region masks of corrclip cells: DIR (DIR/<dataset>/ holds each dataset's), NAME=DIR for one, or sam2 (repeatable)."),
]


def _print_summary(summary, out: Path) -> None:
    from rich.markup import escape

    err_console.print(
        f"sweep: {summary.total} cells: {summary.skipped} already done, {summary.ran} ran"
        f"{f' ({summary.stale} of them recomputed: their data or checkpoint changed)' if summary.stale else ''}, "
        f"{len(summary.failed)} failed ({summary.wall_s:.1f} s); results in {out}",
        highlight=False,
    )
    for failure in summary.failed:
        err_console.print(f"  [red]failed[/] {escape(failure.cell.label)}: {escape(failure.error)}  ({failure.cell.hash}.error.json)", highlight=False, soft_wrap=True)


def _run_grid(grid, paths, device: Device, metric: str | None = None, shard: str | None = None):
    """Run the grid (under torchrun: this rank's share); returns (summary of all ranks, rank)."""
    from ..runtime.distributed import init_from_env, parse_shard
    from ..runtime.device import resolve_device
    from ..sweeps.grid import check_fgovd_negatives
    from ..sweeps.run import run_sweep

    part = parse_shard(shard) if shard is not None else None
    rank, _ = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    resolve_device(device.value)  # a missing GPU would otherwise fail every cell
    notes = check_fgovd_negatives(grid, metric)  # a report metric no file can give would fail the report
    for note in notes if rank == 0 else []:
        err_console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    summary = run_sweep(grid, paths, device=device.value, part=part)
    if rank == 0:
        _print_summary(summary, paths.out)
    return summary, rank


@app.command("sweep", no_args_is_help=True)
@user_errors()
def sweep(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder of result files (one per cell, named by its config hash).")],
    grid: Annotated[Optional[Path], typer.Option("--grid", help="TOML grid file with the keys below; flags given override it.")] = None,
    datasets: Annotated[Optional[str], typer.Option("--datasets", help="Comma-separated dataset names, e.g. voc21,ade20k.")] = None,
    fgovd: Annotated[Optional[list[Path]], typer.Option("--fgovd", help="FG-OVD benchmark JSON file (repeatable; one cell each).")] = None,
    presets: Annotated[Optional[str], typer.Option("--presets", help="Presets giving the block edits, e.g. sclip,naclip (default: unmodified block).")] = None,
    sources: Annotated[Optional[str], typer.Option("--sources", help="Score sources replacing each preset's, e.g. qk,qq,kk,vv,qq+kk.")] = None,
    normalizers: Annotated[Optional[str], typer.Option("--normalizers", help="Normalizers, e.g. softmax,entmax:1.5,sparsemax.")] = None,
    alphas: Annotated[Optional[str], typer.Option("--alphas", help="Shorthand: 1.25,1.5 adds entmax:1.25 and entmax:1.5.")] = None,
    specs: Annotated[Optional[str], typer.Option("--specs", help="Extra full attention specs, e.g. qq/entmax:1.5/nores/noffn.")] = None,
    resolutions: Annotated[Optional[str], typer.Option("--resolutions", help="Short-side resolutions, e.g. 224,336,448 (default: the protocol's).")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="open_clip model names or model-config JSON files, e.g. ViT-B-16,ViT-L-14.")] = None,
    pretrained: Annotated[Optional[str], typer.Option("--pretrained", help="Weights for every model: a tag, a checkpoint, or none.")] = None,
    precision: Annotated[Optional[Precision], typer.Option("--precision", help="Model precision.")] = None,
    protocol: Annotated[Optional[str], typer.Option("--protocol", help="Evaluation protocol (sclip, clearclip, ...).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Evaluate only the first N images / annotations per cell.")] = None,
    templates: Annotated[Optional[str], typer.Option("--templates", help="Prompt templates: openai, single, none or a file (default: each runner's own).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompt file (JSON: class name -> list of description sentences) for the eval cells, averaged with the templates.")] = None,
    pamr: Annotated[Optional[bool], typer.Option("--pamr/--no-pamr", help=PAMR_HELP + " Default: the protocol's; added to the grid's overrides.", show_default=False)] = None,
    root: RootOpt = None,
    images_root: ImagesRootOpt = None,
    regions: SweepRegionsOpt = None,
    bank: BankOpt = None,
    device: DeviceOpt = Device.auto,
    shard: Annotated[Optional[str], typer.Option("--shard", help="I/N: run only the I-th of N disjoint parts of the grid (every N-th cell), e.g. one per job of a job array.")] = None,
) -> None:
    """Run a grid of eval / FG-OVD runs; done cells are skipped, failures recorded, interruptions resumed.

    Several processes: `torchrun --nproc-per-node N -m clipseg_sparse sweep ...` deals the cells out to them.
    """
    import dataclasses

    from ..sweeps.grid import Grid, read_grid_file
    from ..sweeps.run import SweepPaths, parse_roots

    check_out(out, folder=True)
    given = {
        "datasets": _split(datasets), "fgovd": [str(f) for f in fgovd] if fgovd else None, "presets": _split(presets),
        "sources": _split(sources), "normalizers": _split(normalizers), "alphas": _split(alphas), "specs": _split(specs),
        "resolutions": _split(resolutions), "models": _split(models), "pretrained": pretrained,
        "precision": precision.value if precision else None, "protocol": protocol, "limit": limit, "templates": templates,
        "prompts": str(prompts) if prompts else None,
    }  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    note_softmax_aliases([*given.get("normalizers", []), *(f"entmax:{a}" for a in given.get("alphas", []))])
    for key, kind in (("resolutions", int), ("alphas", float)):
        try:
            if key in given:
                given[key] = [kind(v) for v in given[key]]
        except ValueError:
            fail(f"--{key} {','.join(given[key])}: expected comma-separated {'integers' if kind is int else 'numbers'}")
    if grid is not None:
        grid_file_spec = read_grid_file(grid, overrides=given)
        the_grid, roots, images = grid_file_spec.grid, dict(grid_file_spec.roots), grid_file_spec.images_root
    else:
        the_grid, roots, images = Grid.from_dict(given), {}, None
    if pamr is not None:
        the_grid = dataclasses.replace(the_grid, overrides={**the_grid.overrides, "pamr": pamr})
    roots.update(parse_roots(root or []))
    if bank is not None:
        from ..segment.bank import ImageBank

        ImageBank.open(bank)  # a missing or unfinished bank fails before any cell runs
    paths = SweepPaths(out=out, roots=roots, images_root=images_root or images, regions=parse_roots(regions or []), bank=bank)
    summary, _ = _run_grid(the_grid, paths, device, shard=shard)
    if summary.failed:
        raise typer.Exit(1)


@app.command("report", no_args_is_help=True)
@user_errors()
def report(
    results: Annotated[list[str], typer.Argument(help="Result files, folders (searched recursively) or globs.")],
    rows: Annotated[str, typer.Option("--rows", help="Key on the table rows: source, normalizer, alpha, block, dataset, model, resolution, ...")] = "source",
    cols: Annotated[str, typer.Option("--cols", help="Key on the table columns.")] = "normalizer",
    metric: Annotated[Optional[str], typer.Option("--metric", help="Metric in the cells (default mIoU, or FG-OVD mean top-1).")] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the tables as Markdown to this file.")] = None,
    csv: Annotated[Optional[Path], typer.Option("--csv", help="Also write the tables as CSV to this file.")] = None,
    plots: Annotated[Optional[Path], typer.Option("--plots", help="Write PNG plots (alpha, resolution, datasets) to this folder.")] = None,
    diffusivity: Annotated[Optional[Path], typer.Option("--diffusivity", help="Also write gain-vs-diffusivity plots and tables to this folder (needs `analyze` results of the softmax specs among RESULTS).")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Instead: an HTML gallery of the RESULTS folders (segment outputs or eval --save-pred; NAME=DIR names a column) in this file.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="With --html: the dataset of --save-pred folders (images, labels, per-image mIoU).")] = None,
    root: Annotated[Optional[Path], typer.Option("--root", help="With --html --dataset: the dataset's folder.")] = None,
    html_table: Annotated[Optional[Path], typer.Option("--html-table", help="Also write the tables as an HTML page to this file.")] = None,
    leaderboard: Annotated[bool, typer.Option("--leaderboard", help="Instead of rows x cols: every paper's row beside this run's rows, one per normalizer, over the 8 benchmarks (the field's Table 1).")] = False,
    tolerance: TolOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing Markdown/CSV/plot/HTML files.")] = False,
) -> None:
    """Tables of result files (rows x cols of one metric, delta vs softmax of the same source) and plots.

    Where a paper reports the run (the same protocol, CLIP, settings and preset up to its normalizer), a cell
    also shows the paper's number and the difference, marked `!` beyond --tolerance (`ls published`).
    With --html: a static gallery page of prediction folders instead (images x specs, sortable by the
    difference in per-image mIoU between two specs)."""
    from ..sweeps.records import collect

    if html is not None:
        return cli_analysis.gallery(results, html, dataset, root, overwrite)
    outputs = ((markdown, "--markdown", False), (csv, "--csv", False), (html_table, "--html-table", False), (plots, "--plots", True), (diffusivity, "--diffusivity", True))
    for path, option, folder in outputs:
        check_out(path, folder=folder, option=option)  # before reading any result: nothing is lost to a bad path
    records = collect(results)
    _render_report(records, rows, cols, metric, Outputs(markdown, csv, html_table, plots), overwrite, tolerance, leaderboard)
    if diffusivity is not None:
        cli_analysis.gain_report(records, results, diffusivity, metric, overwrite)


@dataclass(frozen=True)
class Outputs:
    """Where a report is written besides the terminal (None: not written)."""

    markdown: Path | None = None
    csv: Path | None = None
    html: Path | None = None
    plots: Path | None = None

    @classmethod
    def folder(cls, out: Path, stem: str) -> "Outputs":
        """`reproduce`'s files: OUT/STEM.md, .csv, .html and OUT/plots/."""
        return cls(out / f"{stem}.md", out / f"{stem}.csv", out / f"{stem}.html", out / "plots")


def _render_report(records, rows, cols, metric, outputs: Outputs, overwrite: bool, tolerance: float | None = None, board: bool = False) -> None:
    """Tables (or the leaderboard) to stdout, optional Markdown / CSV / HTML files and plots; raises
    ReportError on bad input. tolerance None: `evaluation.published.TOLERANCE`."""
    from ..evaluation.published import TOLERANCE

    from ..sweeps.plots import PLOT_FILES, write_plots
    from ..sweeps.records import ReportError, default_metric
    from ..sweeps.report import leaderboard, pivot, to_csv, to_html, to_markdown, to_rich

    plots = None if board else outputs.plots  # the leaderboard has no plots
    for path in (outputs.markdown, outputs.csv, outputs.html, *(plots / n for n in PLOT_FILES if plots is not None)):
        if path is not None and path.exists() and not overwrite:
            raise ReportError(f"{path} exists; pass --overwrite to replace it")
    metric = metric or (default_metric(records) if records else "mIoU")
    tolerance = TOLERANCE if tolerance is None else tolerance
    tables = [leaderboard(records, tolerance)] if board else pivot(records, rows=rows, cols=cols, metric=metric, tolerance=tolerance)
    console = out_console()
    for table in tables:
        console.print(to_rich(table))
    renders = ((outputs.markdown, to_markdown), (outputs.csv, to_csv), (outputs.html, to_html))
    for path, render in renders:
        if path is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(tables), encoding="utf-8")
        err_console.print(f"wrote {path}", highlight=False)
    if plots is not None:
        for path in write_plots(records, metric, plots, overwrite=overwrite):
            err_console.print(f"wrote {path}", highlight=False)


@app.command("reproduce")
@user_errors()
def reproduce(
    table: Annotated[Optional[str], typer.Argument(help="Shipped grid name (see --list), `leaderboard` (every paper's preset and protocol, see `ls published`), or a TOML grid file with a \\[report] table (rows, cols, metric).")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the shipped grids and exit.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Results folder (default results/TABLE).")] = None,
    root: RootOpt = None,
    images_root: ImagesRootOpt = None,
    regions: SweepRegionsOpt = None,
    benchmarks: Annotated[Optional[Path], typer.Option("--benchmarks", help="Folder of the FG-OVD benchmark JSON files.")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="Replace the grid's models (e.g. a model-config JSON for a smoke run).")] = None,
    pretrained: Annotated[Optional[str], typer.Option("--pretrained", help="Replace the grid's weights (tag, checkpoint or none).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N images / annotations per cell (smoke run).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompt file (JSON: class name -> list of description sentences) for the eval cells, e.g. OV-Stitcher's class_biased_template.json.")] = None,
    tolerance: TolOpt = None,
    only: Annotated[Optional[str], typer.Option("--only", help="With leaderboard: only these papers' protocols (comma-separated, see `ls published`).")] = None,
    device: DeviceOpt = Device.auto,
) -> None:
    """Run a shipped grid (a published table) and render its report (OUT/report.md, .csv, .html, plots/), the
    papers' numbers beside every cell that has one.

    `reproduce leaderboard` runs every paper's preset on the benchmarks it reports, softmax and entmax, each
    into OUT/PROTOCOL/, and renders the field's Table 1 (OUT/leaderboard.md, .csv, .html)."""
    from ..sweeps.grid import GRIDS, leaderboard_grids, read_grid_file
    from ..sweeps.records import ReportError, collect
    from ..sweeps.run import SweepPaths, parse_roots

    if list_ or table is None:
        out_console().print(registry_table(Listable.grids))
        return
    given = {"models": _split(models), "pretrained": pretrained, "limit": limit, "prompts": str(prompts) if prompts else None}
    given = {k: v for k, v in given.items() if v is not None}
    if only is not None and table != "leaderboard":
        fail("--only goes with `reproduce leaderboard`")
    if table == "leaderboard":
        out = out or Path("results") / "leaderboard"
        check_out(out, folder=True)
        roots, region_roots = parse_roots(root or []), parse_roots(regions or [])
        results, failed, rank = [], 0, 0
        grids = leaderboard_grids(given, _split(only))
        for name, grid in grids.items():  # every grid is checked before the first runs
            err_console.print(f"leaderboard: {name}", highlight=False)
            summary, rank = _run_grid(grid, SweepPaths(out=out / name, roots=roots, images_root=images_root, regions=region_roots), device)
            results += summary.results
            failed += len(summary.failed)
        if rank == 0:
            _render_report(collect(results), "method", "dataset", "mIoU", Outputs.folder(out, "leaderboard"), True, tolerance, board=True)
        if failed:
            raise typer.Exit(1)
        return
    grid_file = Path(table) if table.endswith(".toml") else GRIDS.get(table)
    grid_file_spec = read_grid_file(grid_file, overrides=given, benchmarks_dir=benchmarks)
    missing = [f for f in grid_file_spec.grid.fgovd if not Path(f).is_file()]
    if missing:
        fail(f"{len(missing)} FG-OVD benchmark file(s) not found, e.g. {missing[0]}; pass --benchmarks DIR (the folder holding them)")
    out = out or Path("results") / grid_file.stem
    check_out(out, folder=True)
    paths = SweepPaths(out=out, roots={**grid_file_spec.roots, **parse_roots(root or [])}, images_root=images_root or grid_file_spec.images_root,
                       regions=parse_roots(regions or []))
    report = grid_file_spec.report
    summary, rank = _run_grid(grid_file_spec.grid, paths, device, report.get("metric"))
    try:  # report files are derived from the results in OUT, so they are regenerated each time (by rank 0)
        if rank == 0:
            _render_report(collect(summary.results), report.get("rows", "source"), report.get("cols", "normalizer"),
                           report.get("metric"), Outputs.folder(out, "report"), True, tolerance)  # fmt: skip
    except ReportError as e:
        fail(f"no report: {e}")
    if summary.failed:
        raise typer.Exit(1)
