"""The `clipseg-sparse` command line: thin wrappers that parse, call the library and print.

Heavy imports (torch, open_clip) happen inside command bodies so that `--help` is instant.
Progress and logs go to stderr; tables and JSON to stdout.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

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
    progress_bar,
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


@app.command("segment", no_args_is_help=True)
def segment(
    inputs: Annotated[list[Path], typer.Argument(help="Image files and/or folders (searched recursively).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder; images keep their path relative to the folder given.")],
    classes: Annotated[Optional[str], typer.Option("--classes", "-c", help='Classes, comma-separated; "|" joins synonyms: "cat,dog|puppy,sky".')] = None,
    classes_file: Annotated[Optional[Path], typer.Option("--classes-file", help='One class per line, synonyms separated by ", ".')] = None,
    templates: Annotated[str, typer.Option("--templates", help="Prompt templates: openai (80), single, none, or a file with one {}-template per line.")] = "openai",
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Resize the short side to this (default 336; 0 = keep size).")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Sliding-window side (default 224; 0 = whole image).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride (default 112).")] = None,
    logit_scale: Annotated[Optional[float], typer.Option("--logit-scale", help="Softmax scale on cosine similarities (default 40).")] = None,
    background: Annotated[Optional[str], typer.Option("--background", help='Comma-separated names of a background class added as class 0, e.g. "sky,wall,floor".')] = None,
    bg_threshold: Annotated[Optional[float], typer.Option("--bg-threshold", help="Pixels whose top probability is below this become background (default 0).")] = None,
    area_threshold: Annotated[Optional[float], typer.Option("--area-threshold", help="Drop classes covering at most this fraction of the foreground (default 0).")] = None,
    preset: PresetOpt = None,
    attn: AttnOpt = None,
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Windows per forward pass (default 16).")] = None,
    save_probs: Annotated[bool, typer.Option("--save-probs", help="Also write per-class probabilities (float16, compressed npz).")] = False,
    mask_format: Annotated[str, typer.Option("--format", help="Label masks as png (palette PNG) or coco-rle (one COCO RLE JSON per image).")] = "png",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing outputs (default: keep them and skip finished images).")] = False,
) -> None:
    """Segment images with any vocabulary: a label PNG, an overlay and a JSON per image under --out.

    Default attention preset: sclip. Re-running the same command skips finished images.
    """
    from .discovery import InputError, discover_images
    from .outputs import OutputOptions
    from .registry import UnknownNameError
    from .text import Vocabulary, resolve_templates

    if (classes is None) == (classes_file is None):
        fail("give exactly one of --classes and --classes-file")
    try:
        vocabulary = Vocabulary.parse(classes) if classes is not None else Vocabulary.from_file(classes_file)
        if background:
            vocabulary = vocabulary.with_background(background.split(","))
        elif bg_threshold:
            raise ValueError("--bg-threshold needs --background (the class that low-confidence pixels become)")
        prompt_templates = resolve_templates(templates)
        options = OutputOptions(mask_format=mask_format, save_probs=save_probs, overwrite=overwrite)
        options.check_classes(len(vocabulary))
        found = discover_images(inputs, out)
    except (ValueError, FileNotFoundError, InputError, UnknownNameError) as e:
        fail(str(e))
    spec = resolve_attention(preset, attn, default="sclip")
    if found.not_images:
        names = ", ".join(str(p) for p in found.not_images[:5]) + (", ..." if len(found.not_images) > 5 else "")
        err_console.print(f"note: skipping {len(found.not_images)} file(s) that are not images: {names}", highlight=False)
    if not found.jobs:
        fail("no images found in the inputs")

    from .batch import plan_run, run_plan
    from .inference import InferenceSettings, Segmenter

    try:
        settings = InferenceSettings().replace(
            resolution=resolution, window=window, stride=stride, logit_scale=logit_scale,
            bg_threshold=bg_threshold, area_threshold=area_threshold, batch_size=batch_size,
        )
    except ValueError as e:
        fail(str(e))
    clip = load_model(model, pretrained, device, precision)
    segmenter = Segmenter(clip, vocabulary, spec=spec, settings=settings, templates=prompt_templates)
    try:
        plan = plan_run(found.jobs, out, options, segmenter.config())
    except InputError as e:
        fail(str(e))
    if plan.conflicts:
        (job, reason), n = plan.conflicts[0], len(plan.conflicts)
        fail(f"{n} image(s) already have outputs this run would replace ({reason}); use --overwrite or another --out")

    with progress_bar("images") as bar:
        task = bar.add_task("segmenting", total=len(plan.todo))

        def on_image(job, error: str | None) -> None:
            if error:
                bar.console.print(f"[red]failed:[/] {error}", highlight=False, soft_wrap=True)
            bar.advance(task)

        report = run_plan(segmenter, plan, options, on_image)

    _print_segment_summary(report, segmenter.class_names, len(found.not_images), out)
    if report.failed:
        raise typer.Exit(1)


def _print_segment_summary(report, class_names, not_images: int, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    counts = Table("images", "count", title=f"segment -> {out}")
    counts.add_row("segmented", str(report.segmented))
    counts.add_row("skipped (already done)", str(report.skipped))
    counts.add_row("failed", str(len(report.failed)))
    counts.add_row("not images", str(not_images))
    classes = Table("class", "mean pixel fraction", title=f"classes over {len(report.records)} image(s)")
    for name, frac in report.class_fractions(class_names).items():
        classes.add_row(name, f"{100 * frac:.1f}%")
    console = Console()
    console.print(counts)
    console.print(classes)
    if report.failed:
        err_console.print(f"[red]{len(report.failed)} image(s) could not be read:[/]", highlight=False)
    for path, reason in report.failed:
        err_console.print(f"  {reason}", highlight=False, soft_wrap=True)


def main() -> None:
    app()
