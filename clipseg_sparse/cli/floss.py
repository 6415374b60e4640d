"""`clipseg-sparse floss rank`: FLOSS's offline step, the 80 templates ranked per class on unlabeled images
(`methods/floss.py`); `--preset NAME+floss` / `floss:PATH` then read the file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    AttnOpt,
    Device,
    DeviceOpt,
    ModelOpt,
    Precision,
    PrecisionOpt,
    PresetOpt,
    PretrainedOpt,
    bind_resources,
    check_out,
    fail,
    load_model,
    note,
    open_resources,
    out_console,
    resolve_attention,
    user_errors,
)

floss_app = typer.Typer(help="FLOSS (ICCV 2025): per-class expert templates; `rank` writes the file --preset NAME+floss reads.", no_args_is_help=True)


@floss_app.command("rank", no_args_is_help=True)
@user_errors()
def rank(
    inputs: Annotated[list[Path], typer.Argument(help="Unlabeled image files and/or folders (searched recursively).", show_default=False)],
    classes: Annotated[Optional[str], typer.Option("--classes", "-c", help='Classes, comma-separated; "|" joins synonyms.')] = None,
    classes_file: Annotated[Optional[Path], typer.Option("--classes-file", help='One class per line, synonyms separated by ", ".')] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="The rank file (JSON; default: where floss:auto looks for this model, weights, spec and names).")] = None,
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Resize the short side to this (default 336; 0 = keep size).")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Sliding-window side (default 224; 0 = whole image).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride (default 112).")] = None,
    logit_scale: Annotated[float, typer.Option("--logit-scale", help="Softmax scale on cosine similarities (FLOSS's NACLIP: 100).")] = 100.0,
    preset: PresetOpt = None,
    attn: AttnOpt = None,
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
) -> None:
    """Rank the 80 ImageNet templates per class by the mean entropy of the pixels each predicts as that class
    (FLOSS's offline step, no labels). Default preset: naclip (a `floss` option in it is dropped). Resumable: run
    the same command again after a stop; OUT.partial.json holds the images done."""
    from ..files.inputs import discover_images
    from ..methods.floss import base_spec, rank_file, rank_templates
    from ..segment import InferenceSettings, Segmenter
    from ..segment.plan import Plan
    from ..segment.vocabulary import Vocabulary

    if (classes is None) == (classes_file is None):
        fail("give exactly one of --classes and --classes-file")
    vocabulary = Vocabulary.parse(classes) if classes is not None else Vocabulary.from_file(classes_file)
    vocabulary.check_unique()
    if out is not None:
        check_out(out, folder=False)
    spec = base_spec(resolve_attention(preset, attn, default="naclip"))
    settings = InferenceSettings().replace(resolution=resolution, window=window, stride=stride, logit_scale=logit_scale)
    found = discover_images(inputs, (out or Path.cwd() / "floss").with_name(".floss-rank-outputs"))
    if not found.jobs:
        fail("no images found in the inputs")
    plan = Plan.of(spec, settings)
    resources = open_resources(plan, device, [str(job.rel) for job in found.jobs])
    clip = load_model(model, pretrained, device, precision)
    segmenter = Segmenter(clip, vocabulary, spec=spec, settings=settings, templates="openai", resources=bind_resources(resources, plan, clip, vocabulary.flat_names))
    target = out or rank_file(clip, spec, vocabulary.flat_names)
    result = rank_templates(segmenter, [(job.source, str(job.rel)) for job in found.jobs], target, note=note, progress=True)
    top = {name: [row["template_id"] for row in entry["entropy_ranking"] if row["pixel_percentage"] > 0][:4] for name, entry in result["classes"].items()}
    out_console().print(f"ranked {result['clipseg_sparse']['images']} image(s) with {spec}: {target}", highlight=False, soft_wrap=True)
    for name, ids in top.items():
        out_console().print(f"  {name}: top templates {ids or 'none (never predicted)'}", highlight=False, soft_wrap=True)
