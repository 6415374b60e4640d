"""`clipseg-sparse calibrate`: ActiveSAM's class signatures from unlabeled images (`methods/activesam_ecd.py`),
the file `--preset activesam-ecd:FILE.npz` decodes with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import Device, DeviceOpt, Precision, PrecisionOpt, ProxyWeightsOpt, check_out, fail, load_pipeline, note, user_errors
from ..runtime.progress import err_console

app = typer.Typer()


@app.command("calibrate", no_args_is_help=True)
@user_errors()
def calibrate(
    inputs: Annotated[list[Path], typer.Argument(help="Image files and/or folders (searched recursively): the unlabeled pool, in sorted order.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="The signature file to write (.npz); an unfinished run beside it (FILE.partial.npz) is resumed.")],
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Calibrate the vocabulary `eval` runs on this dataset (`ls datasets`), with --class-names.")] = None,
    class_names: Annotated[str, typer.Option("--class-names", help="With --dataset: the name set (segearth, the activesam-ecd protocol's) or a class file.")] = "segearth",
    classes: Annotated[Optional[str], typer.Option("--classes", "-c", help='Or classes, comma-separated; "|" joins synonyms: "background,cat,dog|puppy".')] = None,
    classes_file: Annotated[Optional[Path], typer.Option("--classes-file", help='Or one class per line, synonyms separated by ", ".')] = None,
    preset: Annotated[str, typer.Option("--preset", help="The pipeline whose class maps are measured: activesam-ecd, activesam-ecd/NORMALIZER or activesam-ecd-entmax.")] = "activesam-ecd",
    every: Annotated[int, typer.Option("--every", min=1, help="Use every Nth image of the pool (the published one: COCO-Stuff train2017 with --every 12).")] = 1,
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    proxy_weights: ProxyWeightsOpt = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Recompute even if --out exists or a run in progress has another configuration.")] = False,
) -> None:
    """Estimate ActiveSAM's class signatures (Exclusive Concept Decoding) of one vocabulary from unlabeled
    images; no label is read. A background class is the class named `background`. Resumable: run the same
    command again after a stop; an unreadable image is skipped with a note and listed in the file."""
    from ..datasets import class_vocabulary
    from ..files.inputs import discover_images
    from ..methods import activesam_ecd
    from ..models.proxies import ProxyBackbones
    from ..segment.settings import InferenceSettings
    from ..segment.vocabulary import Vocabulary

    check_out(out, folder=False)
    activesam_ecd.signature_path(out)
    if sum(x is not None for x in (dataset, classes, classes_file)) != 1:
        fail("give exactly one of --dataset, --classes and --classes-file")
    if dataset is not None:
        vocabulary = class_vocabulary(dataset, class_names)[0]
    else:
        vocabulary = Vocabulary.parse(classes) if classes is not None else Vocabulary.from_file(classes_file)
    pipeline = activesam_ecd.measured(preset)
    pipeline.check(vocabulary)  # its WordNet lookups, before the model loads
    found = discover_images(inputs, out)
    images = [job.source for job in found.jobs][::every]
    if not images:
        fail("no images found in the inputs")
    weights = ProxyBackbones(weights=proxy_weights, clip_weights="hub").resolved_weights(pipeline.backbone)
    activesam_ecd.open_calibration(out, activesam_ecd.calibration_config(pipeline.name, vocabulary, images, weights), overwrite)
    segmenter = pipeline.build(load_pipeline(pipeline, weights, "hub", device, precision), vocabulary, InferenceSettings())
    signatures = activesam_ecd.calibrate(segmenter, images, out, weights=weights, overwrite=overwrite, progress=True, note=note)
    calibrated = int((~signatures.uncalibrated).sum())
    err_console.print(f"{out}: {len(images)} images, {calibrated} of {len(vocabulary)} classes calibrated", highlight=False, soft_wrap=True)

