"""The `clipseg-sparse` command line: thin wrappers that parse, call the library and print.

Heavy imports (torch, open_clip) happen inside command bodies so that `--help` is instant.
Progress and logs go to stderr; tables and JSON to stdout.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from .cli_common import Device, DeviceOpt, Precision, PrecisionOpt, fail

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


@app.command("ls")
def ls(what: Annotated[Listable, typer.Argument(help="What to list.")]) -> None:
    """List registered names: attention presets, normalizers, CLIP models."""
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
    else:
        import open_clip

        table = Table("model", "pretrained tags")
        for name in open_clip.list_models():
            if name.startswith("ViT"):
                table.add_row(name, ", ".join(open_clip.list_pretrained_tags_by_model(name)))
    console.print(table)


@app.command("bench")
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="ViT-B/16 at 224 px only, without the slow package solvers (seconds).")] = False,
    device: DeviceOpt = Device.cpu,
    precision: PrecisionOpt = Precision.fp32,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Benchmark only this model (name or config JSON).")] = None,
) -> None:
    """Time fast entmax vs the entmax package vs softmax, the patched forward, and segmentation overhead."""
    from rich.console import Console

    from .bench import run_all, rich_tables
    from .model import resolve_device

    try:
        rows = run_all(quick=quick, device=str(resolve_device(device.value)), precision=precision.value, model=model)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    console = Console()
    for table in rich_tables(rows):
        console.print(table)


def main() -> None:
    app()
