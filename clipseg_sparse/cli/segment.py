"""`clipseg-sparse segment`: label maps, overlays and JSON for a folder of images, with any vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    PAMR_HELP,
    AttnOpt,
    BankOpt,
    Device,
    DeviceOpt,
    ModelOpt,
    Precision,
    PrecisionOpt,
    PresetOpt,
    PretrainedOpt,
    ProxyWeightsOpt,
    RegionsOpt,
    PromptsOpt,
    TemplatesOpt,
    bind_resources,
    check_out,
    fail,
    load_model,
    open_resources,
    out_console,
    resolve_attention,
    user_errors,
)
from ..runtime.progress import err_console, progress_bar

app = typer.Typer()


@app.command("segment", no_args_is_help=True)
@user_errors()
def segment(
    inputs: Annotated[list[Path], typer.Argument(help="Image files and/or folders (searched recursively).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder; images keep their path relative to the folder given.")],
    classes: Annotated[Optional[str], typer.Option("--classes", "-c", help='Classes, comma-separated; "|" joins synonyms: "cat,dog|puppy,sky".')] = None,
    classes_file: Annotated[Optional[Path], typer.Option("--classes-file", help='One class per line, synonyms separated by ", ".')] = None,
    templates: TemplatesOpt = "openai",
    prompts: PromptsOpt = None,
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
    proxy_weights: ProxyWeightsOpt = "auto",
    regions: RegionsOpt = None,
    bank: BankOpt = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Windows per forward pass (default 16).")] = None,
    pamr: Annotated[bool, typer.Option("--pamr", help=PAMR_HELP)] = False,
    save_probs: Annotated[bool, typer.Option("--save-probs", help="Also write per-class probabilities (float16, compressed npz).")] = False,
    mask_format: Annotated[str, typer.Option("--format", help="Label masks as png (palette PNG) or coco-rle (one COCO RLE JSON per image).")] = "png",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing outputs (default: keep them and skip finished images).")] = False,
) -> None:
    """Segment images with any vocabulary: a label PNG, an overlay and a JSON per image under --out.

    Default attention preset: sclip. Re-running the same command skips finished images.
    Several processes: `torchrun --nproc-per-node N -m clipseg_sparse segment ...` shards the images.
    """
    from ..files.inputs import discover_images
    from ..files.outputs import ClaimConflictError, OutputOptions
    from ..segment.vocabulary import Vocabulary, resolve_prompts, resolve_templates

    if (classes is None) == (classes_file is None):
        fail("give exactly one of --classes and --classes-file")
    check_out(out, folder=True)
    vocabulary = Vocabulary.parse(classes) if classes is not None else Vocabulary.from_file(classes_file)
    if background:
        vocabulary = vocabulary.with_background(background.split(","))
    elif bg_threshold:
        fail("--bg-threshold needs --background (the class that low-confidence pixels become)")
    vocabulary.check_unique()
    prompt_templates = resolve_templates(templates)
    prompt_file = resolve_prompts(prompts)  # a bad file fails before the model loads
    options = OutputOptions(mask_format=mask_format, save_probs=save_probs, overwrite=overwrite)
    options.check_classes(len(vocabulary))
    found = discover_images(inputs, out)
    spec = resolve_attention(preset, attn, default="sclip")
    for skipped, what in ((found.not_images, "that are not images"), (found.special, "that are not regular files (FIFO, socket, device)")):
        if skipped:
            names = ", ".join(str(p) for p in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
            err_console.print(f"note: skipping {len(skipped)} file(s) {what}: {names}", highlight=False, soft_wrap=True)
    if not found.jobs:
        fail("no images found in the inputs")

    from ..files.folder import plan_run, run_plan
    from ..runtime.distributed import init_from_env
    from ..runtime.progress import inner_progress
    from ..segment import InferenceSettings, Segmenter
    from ..segment.windows import window_progress

    settings = InferenceSettings().replace(
        resolution=resolution, window=window, stride=stride, logit_scale=logit_scale,
        bg_threshold=bg_threshold, area_threshold=area_threshold, batch_size=batch_size, pamr=pamr or None,
    )
    from ..segment.plan import Plan

    spec_plan = Plan.of(spec, settings)
    inputs = open_resources(spec_plan, device, [str(job.rel) for job in found.jobs], regions=regions, bank=bank, prompts=prompt_file, proxy_weights=proxy_weights)
    rank, world = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    clip = load_model(model, pretrained, device, precision)
    inputs = bind_resources(inputs, spec_plan, clip, vocabulary.flat_names)
    segmenter = Segmenter(clip, vocabulary, spec=spec, settings=settings, templates=prompt_templates, progress=rank == 0, resources=inputs)
    plan = plan_run(found.jobs, out, options, segmenter.config())
    conflict = "{n} image(s) already have outputs this run would replace ({reason}); use --overwrite or another --out"
    if plan.conflicts:
        fail(conflict.format(n=len(plan.conflicts), reason=plan.conflicts[0][1]))

    try:
        with progress_bar("images") as bar:
            bar.disable = rank > 0  # rank 0's bar counts its share
            task = bar.add_task("segmenting" + (f" (rank 0 of {world})" if world > 1 else ""), total=len(plan.todo[::world]))

            def on_image(job, error: str | None) -> None:
                if error:
                    bar.console.print(f"[red]failed:[/] {error}", highlight=False, soft_wrap=True)
                bar.advance(task)

            with inner_progress("windows", "windows of the image under way", show=rank == 0) as on_windows, window_progress(on_windows):
                report = run_plan(segmenter, plan, options, on_image)
    except ClaimConflictError as e:  # a concurrent run on the same --out claimed an image first
        fail(conflict.format(n=1, reason=e) + "; the images this run finished are kept")

    if rank == 0:
        _print_segment_summary(report, segmenter.class_names, len(found.not_images) + len(found.special), out)
    if report.failed:
        raise typer.Exit(1)


SUMMARY_CLASSES = 25  # rows of the class table, largest fraction first


def _print_segment_summary(report, class_names, not_images: int, out: Path) -> None:
    from rich.table import Table

    counts = Table("images", "count", title=f"segment -> {out}")
    counts.add_row("segmented", str(report.segmented))
    counts.add_row("skipped (already done)", str(report.skipped))
    if report.elsewhere:
        counts.add_row("skipped (another run on this --out had them)", str(report.elsewhere))
    counts.add_row("failed", str(len(report.failed)))
    counts.add_row("not images", str(not_images))
    classes = Table("class", "mean pixel fraction", title=f"classes over {len(report.records)} image(s)")
    fractions = list(report.class_fractions(class_names).items())
    for name, frac in fractions[:SUMMARY_CLASSES]:
        classes.add_row(name, f"{100 * frac:.1f}%")
    if len(fractions) > SUMMARY_CLASSES:  # a 10,000-class vocabulary: the rest is in the images' JSON records
        classes.add_row(f"... {len(fractions) - SUMMARY_CLASSES} more", f"{100 * sum(f for _, f in fractions[SUMMARY_CLASSES:]):.1f}%")
    console = out_console()
    console.print(counts)
    console.print(classes)
    if report.failed:
        err_console.print(f"[red]{len(report.failed)} image(s) failed:[/]", highlight=False)
    for path, reason in report.failed:
        err_console.print(f"  {reason}", highlight=False, soft_wrap=True)
