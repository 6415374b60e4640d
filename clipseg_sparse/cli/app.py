"""The `clipseg-sparse` command line: thin wrappers that parse, call the library and print.

Heavy imports (torch, open_clip) happen inside command bodies so that `--help` is instant.
Progress and logs go to stderr; tables and JSON to stdout.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import analysis as cli_analysis
from .common import (
    AttnOpt,
    Device,
    DeviceOpt,
    ModelOpt,
    Precision,
    PrecisionOpt,
    PresetOpt,
    PretrainedOpt,
    ProxyWeightsOpt,
    RegionsOpt,
    TemplatesOpt,
    check_out,
    fail,
    out_console,
    load_model,
    load_proxies,
    load_regions,
    note_softmax_aliases,
    resolve_attention,
)
from .dna import dna_app
from ..runtime.progress import err_console, progress_bar

app = typer.Typer(
    name="clipseg-sparse",
    help="Training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"clipseg-sparse {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """Training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention."""
    from ..runtime.allocator import keep_freed_memory

    keep_freed_memory()  # no page-fault churn between repeated same-sized tensors (see allocator.py)


PAMR_HELP = "PAMR refinement of the cosine maps at the original image size (10 iterations, dilations 8,16; NACLIP's post stage; runs on the whole image, not row-tiled, so it needs about (names + 20) x H x W floats)."


class Listable(str, Enum):
    presets = "presets"
    normalizers = "normalizers"
    models = "models"
    datasets = "datasets"
    protocols = "protocols"
    grids = "grids"
    stages = "stages"
    backbones = "backbones"


@app.command("ls")
def ls(what: Annotated[Listable, typer.Argument(help="What to list.")]) -> None:
    """List registered names: attention presets, normalizers, CLIP models, datasets, protocols, sweep grids, stages, proxy backbones."""
    from rich.table import Table

    console = out_console()
    if what is Listable.presets:
        from rich.markup import escape

        from ..attention import PRESETS

        table = Table("preset")
        table.add_column("spec", no_wrap=True)
        table.add_column("follows")
        for name in PRESETS:
            table.add_row(name, escape(str(PRESETS.get(name).spec)), PRESETS.help(name))  # [..] is not markup
    elif what is Listable.normalizers:
        table = Table("normalizer", "meaning")
        table.add_row("softmax", "standard attention (alpha = 1)")
        table.add_row("entmax:ALPHA", "alpha-entmax, 1 < ALPHA <= 2: exact zeros below a data-dependent threshold")
        table.add_row("sparsemax", "entmax:2, Euclidean projection onto the simplex")
        table.add_row("randmask:ALPHA", "control: softmax on a random subset as large as entmax:ALPHA's support")
    elif what is Listable.datasets:
        table = _datasets_table()
    elif what is Listable.protocols:
        table = _protocols_table()
    elif what is Listable.grids:
        table = _grids_table()
    elif what is Listable.stages:
        from ..attention import presets  # noqa: F401  (the preset modules register their stages: sam, samrefine)
        from ..stages import STAGES

        table = Table("stage", "kind and meaning")
        for name in STAGES:
            table.add_row(name, STAGES.help(name))
    elif what is Listable.backbones:
        from .ls import backbones_table

        table = backbones_table()
    else:
        import open_clip

        from ..models.clip import supported_models

        table = Table("model", "pretrained tags")
        for name in supported_models():
            table.add_row(name, ", ".join(open_clip.list_pretrained_tags_by_model(name)))
    console.print(table)


@app.command("segment", no_args_is_help=True)
def segment(
    inputs: Annotated[list[Path], typer.Argument(help="Image files and/or folders (searched recursively).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder; images keep their path relative to the folder given.")],
    classes: Annotated[Optional[str], typer.Option("--classes", "-c", help='Classes, comma-separated; "|" joins synonyms: "cat,dog|puppy,sky".')] = None,
    classes_file: Annotated[Optional[Path], typer.Option("--classes-file", help='One class per line, synonyms separated by ", ".')] = None,
    templates: TemplatesOpt = "openai",
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
    from ..files.inputs import InputError, discover_images
    from ..files.outputs import ClaimConflictError, OutputOptions
    from ..registry import UnknownNameError
    from ..segment.vocabulary import Vocabulary, resolve_templates

    if (classes is None) == (classes_file is None):
        fail("give exactly one of --classes and --classes-file")
    check_out(out, folder=True)
    try:
        vocabulary = Vocabulary.parse(classes) if classes is not None else Vocabulary.from_file(classes_file)
        if background:
            vocabulary = vocabulary.with_background(background.split(","))
        elif bg_threshold:
            raise ValueError("--bg-threshold needs --background (the class that low-confidence pixels become)")
        vocabulary.check_unique()
        prompt_templates = resolve_templates(templates)
        options = OutputOptions(mask_format=mask_format, save_probs=save_probs, overwrite=overwrite)
        options.check_classes(len(vocabulary))
        found = discover_images(inputs, out)
    except (ValueError, FileNotFoundError, InputError, UnknownNameError) as e:
        fail(str(e))
    spec = resolve_attention(preset, attn, default="sclip")
    for skipped, what in ((found.not_images, "that are not images"), (found.special, "that are not regular files (FIFO, socket, device)")):
        if skipped:
            names = ", ".join(str(p) for p in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
            err_console.print(f"note: skipping {len(skipped)} file(s) {what}: {names}", highlight=False, soft_wrap=True)
    if not found.jobs:
        fail("no images found in the inputs")

    from ..files.folder import plan_run, run_plan
    from ..runtime.distributed import init_from_env
    from ..segment.segmenter import InferenceSettings, Segmenter

    try:
        settings = InferenceSettings().replace(
            resolution=resolution, window=window, stride=stride, logit_scale=logit_scale,
            bg_threshold=bg_threshold, area_threshold=area_threshold, batch_size=batch_size, pamr=pamr or None,
        )
    except ValueError as e:
        fail(str(e))
    from ..segment.regions import region_reader

    region_src = load_regions(regions, [str(job.rel) for job in found.jobs], device, region_reader(spec, settings.stage_texts()))
    rank, world = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    clip = load_model(model, pretrained, device, precision)
    load_proxies(spec, clip, proxy_weights)
    try:
        segmenter = Segmenter(clip, vocabulary, spec=spec, settings=settings, templates=prompt_templates, progress=rank == 0, regions=region_src)
    except ValueError as e:  # a spec the model cannot run
        fail(str(e))
    try:
        plan = plan_run(found.jobs, out, options, segmenter.config())
    except InputError as e:
        fail(str(e))
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

            report = run_plan(segmenter, plan, options, on_image)
    except ClaimConflictError as e:  # a concurrent run on the same --out claimed an image first
        fail(conflict.format(n=1, reason=e) + "; the images this run finished are kept")

    if rank == 0:
        _print_segment_summary(report, segmenter.class_names, len(found.not_images) + len(found.special), out)
    if report.failed:
        raise typer.Exit(1)


def _print_segment_summary(report, class_names, not_images: int, out: Path) -> None:
    from rich.table import Table

    counts = Table("images", "count", title=f"segment -> {out}")
    counts.add_row("segmented", str(report.segmented))
    counts.add_row("skipped (already done)", str(report.skipped))
    counts.add_row("failed", str(len(report.failed)))
    counts.add_row("not images", str(not_images))
    classes = Table("class", "mean pixel fraction", title=f"classes over {len(report.records)} image(s)")
    for name, frac in report.class_fractions(class_names).items():
        classes.add_row(name, f"{100 * frac:.1f}%")
    console = out_console()
    console.print(counts)
    console.print(classes)
    if report.failed:
        err_console.print(f"[red]{len(report.failed)} image(s) failed:[/]", highlight=False)
    for path, reason in report.failed:
        err_console.print(f"  {reason}", highlight=False, soft_wrap=True)


def _datasets_table():
    from rich.table import Table

    from ..datasets import DATASETS

    table = Table("dataset", "classes", "background", "reduce_zero_label", "val images", "layout under --root", "what")
    for name in DATASETS:
        b = DATASETS.get(name)
        layout = "/".join(p for p in (b.layout, b.img_dir) if p) + f"/*{b.img_suffix}"
        table.add_row(name, str(b.num_classes), "class 0" if b.background else "-", "yes" if b.reduce_zero_label else "no",
                      str(b.num_images), layout, DATASETS.help(name))
    return table


def _protocols_table():
    from rich.table import Table

    from ..evaluation.protocols import PROTOCOLS

    table = Table("protocol", "attention", "class names", "all datasets", "per dataset", "follows (source)")
    fmt = lambda d: ", ".join(  # noqa: E731
        f"{k}={','.join(v)}" if isinstance(v, tuple) else f"{k}={v}" if isinstance(v, (bool, str)) else f"{k}={v:g}" for k, v in d.items()
    )
    for name in PROTOCOLS:
        p = PROTOCOLS.get(name)
        per = "\n".join(f"{ds}: {fmt(d)}" for ds, d in p.per_dataset.items())
        table.add_row(name, p.attention, p.class_names, fmt(p.defaults), per, f"{PROTOCOLS.help(name)}\n{p.source}")
    return table


@app.command("eval")
def eval_cmd(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Benchmark: voc21, voc20, context60, context59, ade20k, coco-stuff, coco-object, cityscapes (see `ls datasets`).")],
    root: Annotated[Path, typer.Option("--root", help="Folder holding the dataset in its mmseg layout (see datasets.md).")],
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    proxy_weights: ProxyWeightsOpt = "auto",
    regions: RegionsOpt = None,
    preset: PresetOpt = None,
    attn: AttnOpt = None,
    protocol: Annotated[str, typer.Option("--protocol", help="Settings of a published evaluation: sclip, clearclip, naclip, proxyclip (see `ls protocols`); also picks the attention preset and class names unless given.")] = "sclip",
    class_names: Annotated[Optional[str], typer.Option("--class-names", help="Prompt names: sclip (synonyms, stuff words for background), plain (ClearCLIP's), or a file with one class per line; default: the protocol's.")] = None,
    templates: TemplatesOpt = "openai",
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Short side images are resized to (0 = keep size).")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Sliding-window size in pixels (0 = whole image).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride in pixels.")] = None,
    logit_scale: Annotated[Optional[float], typer.Option("--logit-scale", help="Scale on cosines before the softmax over names.")] = None,
    bg_threshold: Annotated[Optional[float], typer.Option("--bg-threshold", help="Pixels whose top probability is below this become background (class 0).")] = None,
    area_threshold: Annotated[Optional[float], typer.Option("--area-threshold", help="Drop classes covering at most this fraction of the foreground (SCLIP's area_thd).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Sliding windows per forward pass.")] = None,
    pamr: Annotated[Optional[bool], typer.Option("--pamr/--no-pamr", help=PAMR_HELP + " Default: the protocol's (on for naclip).", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Evaluate the first N images only.")] = None,
    save_pred: Annotated[Optional[Path], typer.Option("--save-pred", help="Folder for palette PNG predictions in the dataset's label encoding.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Result JSON; a <out>.progress.jsonl beside it makes the run resumable.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Recompute even if --out holds a finished result or a partial run.")] = False,
) -> None:
    """Evaluate on a benchmark: dataset-level mIoU, per-class IoU, resumable with --out.

    Several processes: `torchrun --nproc-per-node N -m clipseg_sparse eval ...` shards the images.
    """
    from ..datasets import DATASETS, DatasetError, class_vocabulary
    from ..runtime.distributed import init_from_env
    from ..evaluation.segmentation import evaluate
    from ..evaluation.protocols import PROTOCOLS
    from ..files.results import ConfigMismatchError

    check_out(out, folder=False)
    check_out(save_pred, folder=True, option="--save-pred")
    try:
        bench, proto = DATASETS.get(dataset), PROTOCOLS.get(protocol)
        samples = bench.samples(root)[:limit]  # fail on a missing dataset or class-name file before loading the model
        vocabulary, _ = class_vocabulary(bench.name, class_names or proto.class_names)
    except (KeyError, DatasetError, ValueError) as e:
        fail(str(e))
    for repeated in vocabulary.repeated_names():  # published name sets are kept as published (SCLIP's COCO-Object)
        err_console.print(f"note: prompt names of {bench.name}: {repeated}; kept as given, the later class cannot win on that name", highlight=False, soft_wrap=True)
    spec = resolve_attention(preset, attn, default=proto.attention)
    overrides = dict(resolution=resolution, window=window, stride=stride, logit_scale=logit_scale,
                     bg_threshold=bg_threshold, area_threshold=area_threshold, batch_size=batch_size, pamr=pamr)
    try:
        stages = proto.settings(bench.name, overrides).stage_texts()
    except ValueError as e:
        fail(str(e))
    from ..segment.regions import region_reader

    region_src = load_regions(regions, [s.id for s in samples], device, region_reader(spec, stages))
    rank, _ = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    clip = load_model(model, pretrained, device, precision)
    load_proxies(spec, clip, proxy_weights, stages)
    shown = out is not None and out.exists() and not overwrite  # a finished result is read back, if its config matches
    try:
        record = evaluate(clip, bench.name, root, spec, protocol=protocol, overrides=overrides, class_names=class_names,
                          limit=limit, out=out, save_pred=save_pred, overwrite=overwrite, templates=templates, regions=region_src)
    except (DatasetError, ConfigMismatchError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    if rank > 0:
        return
    _note_shown(out, shown)
    out_console().print(_result_table(record))
    if out is not None:
        err_console.print(f"result: {out}", highlight=False)


def _note_shown(out: Path | None, shown: bool) -> None:
    if shown:
        err_console.print(f"{out} holds this configuration's finished result: showing it, not recomputing (--overwrite recomputes)", highlight=False, soft_wrap=True)


def _result_table(record: dict):
    """Per-class IoU / Acc and the means of an eval result record."""
    from rich.table import Table

    c = record["config"]
    pct = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    title = f"{c['dataset']} | {c['attention']} | {c['protocol']} | {c['model']} ({c['pretrained']}) | {record['num_images']} images"
    from rich.markup import escape

    table = Table("class", "IoU %", "Acc %", title=escape(title))  # spec strings hold [..]
    for name, m in record["per_class"].items():
        table.add_row(name, pct(m["IoU"]), pct(m["Acc"]))
    m = record["metrics"]
    table.add_section()
    table.add_row("[bold]mean[/]", f"[bold]{pct(m['mIoU'])}[/]", pct(m["mAcc"]))
    table.add_row("pixel accuracy", "", pct(m["aAcc"]))
    return table


convert_app = typer.Typer(help="Convert datasets into the layouts `eval` reads (see datasets.md).", no_args_is_help=True)
app.add_typer(convert_app, name="convert")
app.add_typer(dna_app, name="dna")


def _convert(kind: str, root: Path, split: str, out: Path | None, overwrite: bool, instances: Path | None = None) -> None:
    from ..datasets import DatasetError
    from ..datasets import convert as cv

    out = out or root
    dest = out / "annotations" / split
    with progress_bar("files") as bar:
        task = bar.add_task(f"{kind} {split}", total=None)
        step = lambda: bar.advance(task)  # noqa: E731
        try:
            if instances is not None:
                written = cv.coco_object_from_instances(instances, dest, overwrite, step)
            elif kind == "coco-object":
                written = cv.convert_stuffthingmaps(root / "annotations" / split, dest, cv.object_lut(), cv.OBJECT_SUFFIX, overwrite, step)
            else:
                written = cv.convert_stuffthingmaps(root / "annotations" / split, dest, cv.stuff_lut(), cv.STUFF_SUFFIX, overwrite, step)
        except DatasetError as e:
            fail(str(e))
    if out.resolve() != root.resolve() and (root / "images").is_dir() and not (out / "images").exists():
        (out / "images").symlink_to((root / "images").resolve(), target_is_directory=True)
    err_console.print(f"wrote {written} label files to {dest}", highlight=False)


StuffRootArg = Annotated[Path, typer.Argument(help="COCO-Stuff164k folder: images/<split>/*.jpg and annotations/<split>/*.png (raw stuffthingmaps).")]
SplitOpt = Annotated[str, typer.Option("--split", help="Sub-folder to convert.")]
ConvertOutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Dataset folder to write annotations/<split>/ into (default: ROOT); images/ is linked.")]
ConvertOverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Rewrite label files that already exist.")]


@convert_app.command("coco-stuff")
def convert_coco_stuff(root: StuffRootArg, split: SplitOpt = "val2017", out: ConvertOutOpt = None, overwrite: ConvertOverwriteOpt = False) -> None:
    """COCO-Stuff labels (*_labelTrainIds.png, 0..170, 255 unlabeled), as mmseg's coco_stuff164k.py."""
    _convert("coco-stuff", root, split, out, overwrite)


@convert_app.command("coco-object")
def convert_coco_object(
    root: StuffRootArg,
    split: SplitOpt = "val2017",
    out: ConvertOutOpt = None,
    overwrite: ConvertOverwriteOpt = False,
    instances: Annotated[Optional[Path], typer.Option("--instances", help="Rasterise this COCO instances JSON with pycocotools instead (approximate; see datasets.md).")] = None,
) -> None:
    """COCO-Object labels (*_instanceTrainIds.png, 0 background, 1..80 things), as SCLIP's cvt_coco_object.py."""
    _convert("coco-object", root, split, out, overwrite, instances)


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
    templates: TemplatesOpt = "none",
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Short side images are resized to (default 336; 0 = keep size).")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Sliding-window size in pixels (default 224; 0 = whole image).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride in pixels (default 112).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N images of each benchmark file.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Result JSON with every region's scores; a <out>.progress.jsonl beside it makes the run resumable.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Recompute even if --out holds a finished result or a partial run.")] = False,
) -> None:
    """Fine-grained region-caption matching on FG-OVD: top-1 and rank of the positive caption among hard negatives.

    Default attention: the sclip preset for pool and mask (dense features need a segmentation-style edit to be local), unmodified clip for crop (the benchmark authors' protocol).
    Several processes: `torchrun --nproc-per-node N -m clipseg_sparse fgovd ...` shards the images.
    """
    from ..runtime.distributed import init_from_env
    from ..evaluation.fgovd import evaluate_fgovd, split_name
    from ..evaluation.fgovd.report import metrics_table
    from ..segment.segmenter import InferenceSettings

    check_out(out, folder=False)
    for path in benchmark:  # before loading the model
        if not path.is_file():
            fail(f"{path}: benchmark file not found")
        try:
            split_name(path)
        except KeyError as e:
            fail(str(e))
    spec = resolve_attention(preset, attn, default="clip" if region is Region.crop else "sclip")
    try:
        settings = InferenceSettings().replace(resolution=resolution, window=window, stride=stride)
    except ValueError as e:
        fail(str(e))
    kwargs = {k: v for k, v in {"scale_factor": scale_factor, "negatives": negatives}.items() if v is not None}
    rank, _ = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    clip = load_model(model, pretrained, device, precision)
    shown = out is not None and out.exists() and not overwrite  # a finished result is read back, if its config matches
    try:
        result = evaluate_fgovd(
            clip, benchmark, images, spec, region=region.value, settings=settings, templates=templates, limit=limit, out=out, overwrite=overwrite, **kwargs
        )
    except (OSError, ValueError) as e:  # missing files, malformed benchmark, config mismatch, unreadable image
        fail(str(e))
    if rank > 0:
        return
    _note_shown(out, shown)
    out_console().print(metrics_table(result["metrics"], result["config"]["benchmarks"], result["config"]["negatives"]))
    if out is not None:
        err_console.print(f"result: {out}", highlight=False)


def _split(text: str | None) -> list[str] | None:
    """Comma-separated flag value -> list; None when the flag was not given."""
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def _grids_table():
    from rich.table import Table

    from ..sweeps.grid import GRIDS, read_grid_file

    table = Table("grid", "cells", "what")
    for name in GRIDS:
        cells = len(read_grid_file(GRIDS.get(name), benchmarks_dir=".").grid.cells())
        table.add_row(name, str(cells), GRIDS.help(name))
    return table


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
    err_console.print(
        f"sweep: {summary.total} cells: {summary.skipped} already done, {summary.ran} ran"
        f"{f' ({summary.stale} of them recomputed: their data changed)' if summary.stale else ''}, "
        f"{len(summary.failed)} failed ({summary.wall_s:.1f} s); results in {out}",
        highlight=False,
    )
    for failure in summary.failed:
        err_console.print(f"  [red]failed[/] {failure.cell.label}: {failure.error}  ({failure.cell.hash}.error.json)", highlight=False)


def _run_grid(grid, paths, device: Device, metric: str | None = None, shard: str | None = None):
    """Run the grid (under torchrun: this rank's share); returns (summary of all ranks, rank)."""
    from ..runtime.distributed import init_from_env, parse_shard
    from ..runtime.device import resolve_device
    from ..sweeps.grid import check_fgovd_negatives
    from ..sweeps.run import run_sweep

    try:  # a missing GPU would otherwise fail every cell; a report metric no file can give, the report
        part = parse_shard(shard) if shard is not None else None
        rank, _ = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
        resolve_device(device.value)
        notes = check_fgovd_negatives(grid, metric)
    except ValueError as e:
        fail(str(e))
    for note in notes if rank == 0 else []:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    summary = run_sweep(grid, paths, device=device.value, part=part)
    if rank == 0:
        _print_summary(summary, paths.out)
    return summary, rank


@app.command("sweep", no_args_is_help=True)
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
    pamr: Annotated[Optional[bool], typer.Option("--pamr/--no-pamr", help=PAMR_HELP + " Default: the protocol's; added to the grid's overrides.", show_default=False)] = None,
    root: RootOpt = None,
    images_root: ImagesRootOpt = None,
    regions: SweepRegionsOpt = None,
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
    }  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    note_softmax_aliases([*given.get("normalizers", []), *(f"entmax:{a}" for a in given.get("alphas", []))])
    for key, kind in (("resolutions", int), ("alphas", float)):
        try:
            if key in given:
                given[key] = [kind(v) for v in given[key]]
        except ValueError:
            fail(f"--{key} {','.join(given[key])}: expected comma-separated {'integers' if kind is int else 'numbers'}")
    try:
        if grid is not None:
            grid_file_spec = read_grid_file(grid, overrides=given)
            the_grid, roots, images = grid_file_spec.grid, dict(grid_file_spec.roots), grid_file_spec.images_root
        else:
            the_grid, roots, images = Grid.from_dict(given), {}, None
        if pamr is not None:
            the_grid = dataclasses.replace(the_grid, overrides={**the_grid.overrides, "pamr": pamr})
    except ValueError as e:
        fail(str(e))
    roots.update(parse_roots(root or []))
    paths = SweepPaths(out=out, roots=roots, images_root=images_root or images, regions=parse_roots(regions or []))
    summary, _ = _run_grid(the_grid, paths, device, shard=shard)
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
    diffusivity: Annotated[Optional[Path], typer.Option("--diffusivity", help="Also write gain-vs-diffusivity plots and tables to this folder (needs `analyze` results of the softmax specs among RESULTS).")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Instead: an HTML gallery of the RESULTS folders (segment outputs or eval --save-pred; NAME=DIR names a column) in this file.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="With --html: the dataset of --save-pred folders (images, labels, per-image mIoU).")] = None,
    root: Annotated[Optional[Path], typer.Option("--root", help="With --html --dataset: the dataset's folder.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing Markdown/CSV/plot/HTML files.")] = False,
) -> None:
    """Tables of result files (rows x cols of one metric, delta vs softmax of the same source) and plots.

    With --html: a static gallery page of prediction folders instead (images x specs, sortable by the
    difference in per-image mIoU between two specs)."""
    from ..sweeps.records import ReportError, collect

    if html is not None:
        return cli_analysis.gallery(results, html, dataset, root, overwrite)
    try:
        records = collect(results)
        _render_report(records, rows, cols, metric, markdown, csv, plots, overwrite)
        if diffusivity is not None:
            cli_analysis.gain_report(records, results, diffusivity, metric, overwrite)
    except ReportError as e:
        fail(str(e))


def _render_report(records, rows, cols, metric, markdown, csv, plots, overwrite: bool) -> None:
    """Tables to stdout, optional Markdown / CSV files and plots; raises ReportError on bad input."""
    from ..sweeps.plots import PLOT_FILES, write_plots
    from ..sweeps.records import ReportError, default_metric
    from ..sweeps.report import pivot, to_csv, to_markdown, to_rich

    for path in (markdown, csv, *(plots / n for n in PLOT_FILES if plots is not None)):
        if path is not None and path.exists() and not overwrite:
            raise ReportError(f"{path} exists; pass --overwrite to replace it")
    metric = metric or (default_metric(records) if records else "mIoU")
    tables = pivot(records, rows=rows, cols=cols, metric=metric)
    console = out_console()
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
    table: Annotated[Optional[str], typer.Argument(help="Shipped grid name (see --list), or a TOML grid file with a \\[report] table (rows, cols, metric).")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the shipped grids and exit.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Results folder (default results/TABLE).")] = None,
    root: RootOpt = None,
    images_root: ImagesRootOpt = None,
    regions: SweepRegionsOpt = None,
    benchmarks: Annotated[Optional[Path], typer.Option("--benchmarks", help="Folder of the FG-OVD benchmark JSON files.")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="Replace the grid's models (e.g. a model-config JSON for a smoke run).")] = None,
    pretrained: Annotated[Optional[str], typer.Option("--pretrained", help="Replace the grid's weights (tag, checkpoint or none).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N images / annotations per cell (smoke run).")] = None,
    device: DeviceOpt = Device.auto,
) -> None:
    """Run a shipped grid (a published table) and render its report (OUT/report.md, report.csv, plots/)."""
    from ..sweeps.grid import GRIDS, read_grid_file
    from ..sweeps.records import ReportError, collect
    from ..sweeps.run import SweepPaths, parse_roots
    from ..registry import UnknownNameError

    if list_ or table is None:
        out_console().print(_grids_table())
        return
    given = {k: v for k, v in {"models": _split(models), "pretrained": pretrained, "limit": limit}.items() if v is not None}
    try:
        grid_file = Path(table) if table.endswith(".toml") else GRIDS.get(table)
        grid_file_spec = read_grid_file(grid_file, overrides=given, benchmarks_dir=benchmarks)
    except (UnknownNameError, ValueError) as e:
        fail(str(e))
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
                           report.get("metric"), out / "report.md", out / "report.csv", out / "plots", overwrite=True)  # fmt: skip
    except ReportError as e:
        fail(f"no report: {e}")
    if summary.failed:
        raise typer.Exit(1)


@app.command("bench")
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="ViT-B/16 at 224 px only, without the slow package solvers (seconds).")] = False,
    device: DeviceOpt = Device.cpu,
    precision: PrecisionOpt = Precision.fp32,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Benchmark only this model (name or config JSON).")] = None,
    suites: Annotated[str, typer.Option("--suites", help="Comma-separated: normalizer, forward, segment, ttfm (time to first mask: 150 new classes x 80 templates, cold cache, vs open_clip's encode_text), windows (vs the published one-window-per-forward loop), bf16.")] = "normalizer,forward,segment,ttfm,windows,bf16",
) -> None:
    """Time fast entmax vs the entmax package vs softmax, the patched forward, segmentation overhead, time to first mask, the published window loop and bf16."""
    from ..bench.run import run_all, rich_tables
    from ..runtime.device import resolve_device

    try:
        chosen = [s.strip() for s in suites.split(",") if s.strip()]
        rows = run_all(quick=quick, device=str(resolve_device(device.value)), precision=precision.value, model=model, suites=chosen)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    console = out_console()
    for table in rich_tables(rows):
        console.print(table)


app.command("analyze", no_args_is_help=True)(cli_analysis.analyze)
app.command("explain", no_args_is_help=True)(cli_analysis.explain)
app.command("demo")(cli_analysis.demo)


INTERRUPTED = (
    "interrupted: finished work is kept; run the same command again to resume "
    "(segment and sweep always resume; eval, fgovd and analyze when given --out)"
)


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, Slurm's time limit, docker stop) handled as Ctrl-C: the run stops where it is and
    keeps its finished work (every write is atomic), then exits with 143 (128 + SIGTERM)."""


_signals: list[int] = []


def _on_sigterm(signum: int, frame) -> None:
    _signals.append(signum)
    raise Terminated()


def main() -> None:
    import signal

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app()
    except SystemExit as e:
        if e.code == 130:  # typer's exit status for Ctrl-C, and for SIGTERM (raised as a KeyboardInterrupt)
            err_console.print(INTERRUPTED, highlight=False)
            if _signals:
                raise SystemExit(128 + _signals[0]) from None
        raise
    finally:  # main() called in-process (tests, notebooks) leaves the caller's handler as it was
        signal.signal(signal.SIGTERM, previous)
