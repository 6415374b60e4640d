"""The `clipseg-sparse` command line: thin wrappers that parse, call the library and print.

Heavy imports (torch, open_clip) happen inside command bodies so that `--help` is instant.
Progress and logs go to stderr; tables and JSON to stdout.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_common import Device, DeviceOpt, Precision, fail

app = typer.Typer(
    name="clipseg-sparse",
    help="Training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"clipseg-sparse {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """Training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention."""


class Listable(str, Enum):
    presets = "presets"
    normalizers = "normalizers"
    models = "models"
    grids = "grids"


@app.command("ls")
def ls(what: Annotated[Listable, typer.Argument(help="What to list.")]) -> None:
    """List registered names: attention presets, normalizers, CLIP models, shipped sweep grids."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if what is Listable.presets:
        from .attention import PRESETS

        table = Table("preset")
        table.add_column("spec", no_wrap=True)
        table.add_column("follows")
        for name in PRESETS:
            table.add_row(name, str(PRESETS.get(name).spec), PRESETS.help(name))
    elif what is Listable.normalizers:
        table = Table("normalizer", "meaning")
        table.add_row("softmax", "standard attention (alpha = 1)")
        table.add_row("entmax:ALPHA", "alpha-entmax, 1 < ALPHA <= 2: exact zeros below a data-dependent threshold")
        table.add_row("sparsemax", "entmax:2, Euclidean projection onto the simplex")
        table.add_row("randmask:ALPHA", "control: softmax on a random subset as large as entmax:ALPHA's support")
    elif what is Listable.grids:
        table = _grids_table()
    else:
        import open_clip

        table = Table("model", "pretrained tags")
        for name in open_clip.list_models():
            if name.startswith("ViT"):
                table.add_row(name, ", ".join(open_clip.list_pretrained_tags_by_model(name)))
    console.print(table)


def _split(text: str | None) -> list[str] | None:
    """Comma-separated flag value -> list; None when the flag was not given."""
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def _grids_table():
    from rich.table import Table

    from .sweep import GRIDS, read_grid_file

    table = Table("grid", "cells", "what")
    for name in GRIDS:
        cells = len(read_grid_file(GRIDS.get(name), benchmarks_dir=".").grid.cells())
        table.add_row(name, str(cells), GRIDS.help(name))
    return table


def ListOpt(flag: str, help: str):
    """A comma-separated list option, None when not given."""
    return Annotated[Optional[str], typer.Option(flag, help=help)]


RootOpt = Annotated[
    Optional[list[str]],
    typer.Option("--root", help="Dataset root: DIR for every dataset, or NAME=DIR for one (repeatable)."),
]
ImagesRootOpt = Annotated[Optional[Path], typer.Option("--images-root", help="COCO 2017 images folder for FG-OVD cells.")]


def _print_summary(summary, out: Path) -> None:
    from .cli_common import err_console

    err_console.print(
        f"sweep: {summary.total} cells: {summary.skipped} already done, {summary.ran} ran, "
        f"{len(summary.failed)} failed ({summary.wall_s:.1f} s); results in {out}",
        highlight=False,
    )
    for failure in summary.failed:
        err_console.print(f"  [red]failed[/] {failure.cell.label}: {failure.error}  ({failure.cell.hash}.error.json)", highlight=False)


def _run_grid(grid, paths, device) -> "object":
    from .sweep import run_sweep

    summary = run_sweep(grid, paths, device=device.value)
    _print_summary(summary, paths.out)
    return summary


@app.command("sweep", no_args_is_help=True)
def sweep(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder of result files (one per cell, named by its config hash).")],
    grid: Annotated[Optional[Path], typer.Option("--grid", help="TOML grid file with the keys below; flags given override it.")] = None,
    datasets: ListOpt("--datasets", "Comma-separated dataset names, e.g. voc21,ade20k.") = None,
    fgovd: Annotated[Optional[list[Path]], typer.Option("--fgovd", help="FG-OVD benchmark JSON file (repeatable; one cell each).")] = None,
    presets: ListOpt("--presets", "Presets giving the block edits, e.g. sclip,naclip (default: unmodified block).") = None,
    sources: ListOpt("--sources", "Score sources replacing each preset's, e.g. qk,qq,kk,vv,qq+kk.") = None,
    normalizers: ListOpt("--normalizers", "Normalizers, e.g. softmax,entmax:1.5,sparsemax.") = None,
    alphas: ListOpt("--alphas", "Shorthand: 1.25,1.5 adds entmax:1.25 and entmax:1.5.") = None,
    specs: ListOpt("--specs", "Extra full attention specs, e.g. qq/entmax:1.5/nores/noffn.") = None,
    resolutions: ListOpt("--resolutions", "Short-side resolutions, e.g. 224,336,448 (default: the protocol's).") = None,
    models: ListOpt("--models", "open_clip model names or model-config JSON files, e.g. ViT-B-16,ViT-L-14.") = None,
    pretrained: Annotated[Optional[str], typer.Option("--pretrained", help="Weights for every model: a tag, a checkpoint, or none.")] = None,
    precision: Annotated[Optional[Precision], typer.Option("--precision", help="Model precision.")] = None,
    protocol: Annotated[Optional[str], typer.Option("--protocol", help="Evaluation protocol (sclip, clearclip, ...).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Evaluate only the first N images / annotations per cell.")] = None,
    templates: Annotated[Optional[str], typer.Option("--templates", help="Prompt templates: openai, single, none or a file (default: each runner's own).")] = None,
    root: RootOpt = None,
    images_root: ImagesRootOpt = None,
    device: DeviceOpt = Device.auto,
) -> None:
    """Run a grid of eval / FG-OVD runs; done cells are skipped, failures recorded, interruptions resumed."""
    from .sweep import Grid, SweepPaths, parse_roots, read_grid_file

    given = {
        "datasets": _split(datasets), "fgovd": [str(f) for f in fgovd] if fgovd else None, "presets": _split(presets),
        "sources": _split(sources), "normalizers": _split(normalizers), "alphas": _split(alphas), "specs": _split(specs),
        "resolutions": _split(resolutions), "models": _split(models), "pretrained": pretrained,
        "precision": precision.value if precision else None, "protocol": protocol, "limit": limit, "templates": templates,
    }  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    try:
        if given.get("resolutions"):
            given["resolutions"] = [int(r) for r in given["resolutions"]]
        if given.get("alphas"):
            given["alphas"] = [float(a) for a in given["alphas"]]
        if grid is not None:
            spec = read_grid_file(grid, overrides=given)
            the_grid, roots, images = spec.grid, dict(spec.roots), spec.images_root
        else:
            the_grid, roots, images = Grid.from_dict(given), {}, None
    except ValueError as e:
        fail(str(e))
    roots.update(parse_roots(root or []))
    paths = SweepPaths(out=out, roots=roots, images_root=images_root or images)
    summary = _run_grid(the_grid, paths, device)
    if summary.failed:
        raise typer.Exit(1)


@app.command("report", no_args_is_help=True)
def report(
    results: Annotated[list[str], typer.Argument(help="Result files, folders (searched recursively) or globs.")],
    rows: Annotated[str, typer.Option("--rows", help="Key on the table rows: source, normalizer, alpha, block, dataset, model, resolution, ...")] = "source",
    cols: Annotated[str, typer.Option("--cols", help="Key on the table columns.")] = "normalizer",
    metric: Annotated[Optional[str], typer.Option("--metric", help="Metric in the cells (default mIoU, or FG-OVD mean top-1).")] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the tables as Markdown to this file.")] = None,
    csv: Annotated[Optional[Path], typer.Option("--csv", help="Also write the tables as CSV to this file.")] = None,
    plots: Annotated[Optional[Path], typer.Option("--plots", help="Write PNG plots (alpha, resolution, datasets) to this folder.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing Markdown/CSV/plot files.")] = False,
) -> None:
    """Tables of result files (rows x cols of one metric, delta vs softmax of the same source) and plots."""
    from .report import ReportError, collect

    try:
        records = collect(results)
        _render_report(records, rows, cols, metric, markdown, csv, plots, overwrite)
    except ReportError as e:
        fail(str(e))


def _render_report(records, rows, cols, metric, markdown, csv, plots, overwrite: bool) -> None:
    """Tables to stdout, optional Markdown / CSV files and plots; raises ReportError on bad input."""
    from rich.console import Console

    from .cli_common import err_console
    from .report import ReportError, default_metric, pivot, to_csv, to_markdown, to_rich, write_plots

    from .report import PLOT_FILES

    for path in (markdown, csv, *(plots / n for n in PLOT_FILES if plots is not None)):
        if path is not None and path.exists() and not overwrite:
            raise ReportError(f"{path} exists; pass --overwrite to replace it")
    metric = metric or (default_metric(records) if records else "mIoU")
    tables = pivot(records, rows=rows, cols=cols, metric=metric)
    console = Console()
    for table in tables:
        console.print(to_rich(table))
    for path, text in ((markdown, to_markdown(tables) if markdown else ""), (csv, to_csv(tables) if csv else "")):
        if path is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        err_console.print(f"wrote {path}", highlight=False)
    if plots is not None:
        for path in write_plots(records, metric, plots, overwrite=overwrite):
            err_console.print(f"wrote {path}", highlight=False)


@app.command("reproduce")
def reproduce(
    table: Annotated[Optional[str], typer.Argument(help="Shipped grid name (see --list), or a TOML grid file with a [report] table.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the shipped grids and exit.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Results folder (default results/TABLE).")] = None,
    root: RootOpt = None,
    images_root: ImagesRootOpt = None,
    benchmarks: Annotated[Optional[Path], typer.Option("--benchmarks", help="Folder of the FG-OVD benchmark JSON files.")] = None,
    models: ListOpt("--models", "Replace the grid's models (e.g. a model-config JSON for a smoke run).") = None,
    pretrained: Annotated[Optional[str], typer.Option("--pretrained", help="Replace the grid's weights (tag, checkpoint or none).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Only the first N images / annotations per cell (smoke run).")] = None,
    device: DeviceOpt = Device.auto,
) -> None:
    """Run a shipped grid (a published table) and render its report (OUT/report.md, report.csv, plots/)."""
    from rich.console import Console

    from .report import ReportError, collect
    from .sweep import GRIDS, SweepPaths, parse_roots, read_grid_file
    from .registry import UnknownNameError

    if list_ or table is None:
        Console().print(_grids_table())
        return
    given = {k: v for k, v in {"models": _split(models), "pretrained": pretrained, "limit": limit}.items() if v is not None}
    try:
        grid_file = Path(table) if table.endswith(".toml") else GRIDS.get(table)
        spec = read_grid_file(grid_file, overrides=given, benchmarks_dir=benchmarks)
    except (UnknownNameError, ValueError) as e:
        fail(str(e))
    missing = [f for f in spec.grid.fgovd if not Path(f).is_file()]
    if missing:
        fail(f"FG-OVD benchmark file(s) not found: {', '.join(missing)}; pass --benchmarks DIR")
    out = out or Path("results") / grid_file.stem
    paths = SweepPaths(out=out, roots={**spec.roots, **parse_roots(root or [])}, images_root=images_root or spec.images_root)
    summary = _run_grid(spec.grid, paths, device)
    report = spec.report
    try:  # report files are derived from the results in OUT, so they are regenerated each time
        _render_report(collect(summary.results), report.get("rows", "source"), report.get("cols", "normalizer"),
                       report.get("metric"), out / "report.md", out / "report.csv", out / "plots", overwrite=True)  # fmt: skip
    except ReportError as e:
        fail(f"no report: {e}")
    if summary.failed:
        raise typer.Exit(1)


def main() -> None:
    app()
