"""The `clipseg-sparse` command line: thin wrappers that parse, call the library and print.

Heavy imports (torch, open_clip) happen inside command bodies so that `--help` is instant.
Progress and logs go to stderr; tables and JSON to stdout.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .cli_common import (
    AttnOpt,
    Device,
    DeviceOpt,
    ModelOpt,
    Precision,
    PrecisionOpt,
    PresetOpt,
    PretrainedOpt,
    err_console,
    fail,
    load_model,
    resolve_attention,
)

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


class Region(str, Enum):
    pool = "pool"
    mask = "mask"
    crop = "crop"


@app.command("fgovd")
def fgovd(
    benchmark: Annotated[list[Path], typer.Option("--benchmark", "-b", help="FG-OVD benchmark JSON (repeat for several); the split comes from the file name.")],
    images: Annotated[Path, typer.Option("--images", help="COCO 2017 root holding val2017/ and train2017/.")],
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    preset: PresetOpt = None,
    attn: AttnOpt = None,
    region: Annotated[Region, typer.Option("--region", help="pool: dense features in the box; mask: in the polygon; crop: the box encoded whole.")] = Region.pool,
    scale_factor: Annotated[Optional[float], typer.Option("--scale-factor", help="Enlarge the crop about its centre (crop only; default 1).")] = None,
    negatives: Annotated[Optional[int], typer.Option("--negatives", "-n", help="Hard negatives per region; metrics for N = 1..this (default 10).")] = None,
    templates: Annotated[Optional[str], typer.Option("--templates", help="Caption templates: none (as written, default), single, openai or a file.")] = None,
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Short side after resizing (0 = keep).")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Sliding-window side (0 = whole image).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Only the first LIMIT images of each benchmark file.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Result JSON (with per-region scores); the run resumes from its *.items.jsonl log.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Discard an earlier result and log at --out.")] = False,
) -> None:
    """Fine-grained region-caption matching on FG-OVD: top-1 and rank of the positive caption among hard negatives.

    Default attention: the sclip preset for pool and mask (dense features need a segmentation-style edit to be local), unmodified clip for crop (the benchmark authors' protocol).
    """
    from .fgovd import DEFAULT_NEGATIVES, evaluate_fgovd
    from .fgovd.report import metrics_table
    from .inference import InferenceSettings

    spec = resolve_attention(preset, attn, default="clip" if region is Region.crop else "sclip")
    try:
        settings = InferenceSettings().replace(resolution=resolution, window=window, stride=stride)
    except ValueError as e:
        fail(str(e))
    kwargs = {k: v for k, v in {"scale_factor": scale_factor, "negatives": negatives, "templates": templates}.items() if v is not None}
    clip = load_model(model, pretrained, device, precision)
    try:
        result = evaluate_fgovd(
            clip, benchmark, images, spec, region=region.value, settings=settings, limit=limit, out=out, resume=not overwrite, **kwargs
        )
    except (OSError, ValueError) as e:  # missing files, malformed benchmark, config mismatch, unreadable image
        fail(str(e))
    n = negatives or DEFAULT_NEGATIVES
    Console().print(metrics_table(result["metrics"], result["config"]["benchmarks"], n))
    if out is not None:
        err_console.print(f"wrote {out}")


def main() -> None:
    app()
