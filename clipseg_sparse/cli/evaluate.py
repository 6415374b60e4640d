"""`clipseg-sparse eval`, `fgovd` and `convert`: scores on segmentation and FG-OVD benchmarks, and the
dataset conversions `eval` reads."""

from __future__ import annotations

from enum import Enum
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
    ProtocolModelOpt,
    ProtocolPretrainedOpt,
    ProxyWeightsOpt,
    RegionsOpt,
    PromptsOpt,
    TemplatesOpt,
    bind_resources,
    check_out,
    fail,
    load_model,
    load_pipeline,
    note_shown,
    open_resources,
    out_console,
    resolve_attention,
    user_errors,
)
from ..runtime.progress import err_console, progress_bar

app = typer.Typer()


@app.command("eval")
@user_errors()
def eval_cmd(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Benchmark: voc21, voc20, context60, context59, ade20k, coco-stuff, coco-object, cityscapes (see `ls datasets`).")],
    root: Annotated[Path, typer.Option("--root", help="Folder holding the dataset in its mmseg layout (see docs/datasets.md).")],
    model: ProtocolModelOpt = None,
    pretrained: ProtocolPretrainedOpt = None,
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    proxy_weights: ProxyWeightsOpt = "auto",
    regions: RegionsOpt = None,
    bank: BankOpt = None,
    preset: PresetOpt = None,
    attn: AttnOpt = None,
    protocol: Annotated[str, typer.Option("--protocol", help="Settings of a published evaluation: sclip, clearclip, naclip, proxyclip, corrclip-metaclip, ... (see `ls protocols`); also picks the attention preset, class names and CLIP weights unless given.")] = "sclip",
    class_names: Annotated[Optional[str], typer.Option("--class-names", help="Prompt names: sclip (synonyms, stuff words for background), plain (ClearCLIP's), or a file with one class per line; default: the protocol's.")] = None,
    templates: Annotated[Optional[str], typer.Option("--templates", help="Prompt templates: openai (80), single, none, or a file with one {}-template per line; default: the protocol's (CLIPer's per dataset), else openai.")] = None,
    prompts: PromptsOpt = None,
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
    from ..datasets import DATASETS, class_vocabulary
    from ..runtime.distributed import init_from_env
    from ..evaluation.segmentation import evaluate
    from ..evaluation.protocols import PROTOCOLS

    check_out(out, folder=False)
    check_out(save_pred, folder=True, option="--save-pred")
    bench, proto = DATASETS.get(dataset), PROTOCOLS.get(protocol)
    samples = bench.samples(root)[:limit]  # fail on a missing dataset or class-name file before loading the model
    vocabulary, _ = class_vocabulary(bench.name, class_names or proto.class_names)
    for repeated in vocabulary.repeated_names():  # published name sets are kept as published (SCLIP's COCO-Object)
        err_console.print(f"note: prompt names of {bench.name}: {repeated}; kept as given, the later class cannot win on that name", highlight=False, soft_wrap=True)
    from ..segment.pipelines import find_pipeline

    pipeline = None if attn else find_pipeline(preset if preset is not None else proto.attention)  # sam3: not a CLIP spec
    from ..segment.vocabulary import resolve_prompts

    prompt_file = resolve_prompts(prompts)  # a bad file fails before the model loads
    if pipeline is not None and prompt_file is not None:
        fail(f"--prompts: {pipeline.name} is not a CLIP spec and embeds no prompt file")
    overrides = dict(resolution=resolution, window=window, stride=stride, logit_scale=logit_scale,
                     bg_threshold=bg_threshold, area_threshold=area_threshold, batch_size=batch_size, pamr=pamr)
    inputs = None
    if pipeline is None:
        from ..segment.plan import Plan

        spec = resolve_attention(preset, attn, default=proto.attention)
        spec_plan = Plan.of(proto.spec_for(bench.name, spec), proto.settings(bench.name, overrides))  # as `evaluate` runs it
        inputs = open_resources(spec_plan, device, [s.id for s in samples], regions=regions, bank=bank, prompts=prompt_file, proxy_weights=proxy_weights)
    elif regions is not None or bank is not None:
        fail(f"--{'regions' if regions is not None else 'bank'}: {pipeline.name} reads no {'region masks' if regions is not None else 'image bank'}")
    else:
        spec = preset
        if pipeline.check is not None:
            pipeline.check(vocabulary)  # e.g. ActiveSAM's WordNet lookups, before the model loads
    rank, _ = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    model, pretrained = proto.clip_weights(model, pretrained)  # command line > protocol > library default
    if pipeline is None:
        clip = load_model(model, pretrained, device, precision)
        inputs = bind_resources(inputs, spec_plan, clip, vocabulary.flat_names)
    else:
        clip = load_pipeline(pipeline, proxy_weights, pretrained, device, precision)
    shown = out is not None and out.exists() and not overwrite  # a finished result is read back, if its config matches
    record = evaluate(clip, bench.name, root, spec, protocol=protocol, overrides=overrides, class_names=class_names,
                      limit=limit, out=out, save_pred=save_pred, overwrite=overwrite, templates=templates, resources=inputs)
    if rank > 0:
        return
    note_shown(out, shown)
    out_console().print(_result_table(record))
    if out is not None:
        err_console.print(f"result: {out}", highlight=False)


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


class Region(str, Enum):
    pool = "pool"
    mask = "mask"
    crop = "crop"


@app.command("fgovd")
@user_errors()
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
    from ..attention import resolve_spec
    from ..evaluation.fgovd.evaluate import check_stages
    from ..evaluation.fgovd.report import metrics_table
    from ..segment.settings import InferenceSettings

    check_out(out, folder=False)
    for path in benchmark:  # before loading the model
        if not path.is_file():
            fail(f"{path}: benchmark file not found")
        split_name(path)
    spec = resolve_attention(preset, attn, default="clip" if region is Region.crop else "sclip")
    settings = InferenceSettings().replace(resolution=resolution, window=window, stride=stride)
    check_stages(resolve_spec(spec), settings)  # before loading the model
    kwargs = {k: v for k, v in {"scale_factor": scale_factor, "negatives": negatives}.items() if v is not None}
    rank, _ = init_from_env()  # torchrun: join the group; auto device is then this rank's GPU
    clip = load_model(model, pretrained, device, precision)
    shown = out is not None and out.exists() and not overwrite  # a finished result is read back, if its config matches
    result = evaluate_fgovd(
        clip, benchmark, images, spec, region=region.value, settings=settings, templates=templates, limit=limit, out=out, overwrite=overwrite, **kwargs
    )
    if rank > 0:
        return
    note_shown(out, shown)
    out_console().print(metrics_table(result["metrics"], result["config"]["benchmarks"], result["config"]["negatives"]))
    if out is not None:
        err_console.print(f"result: {out}", highlight=False)


convert_app = typer.Typer(help="Convert datasets into the layouts `eval` reads (see docs/datasets.md).", no_args_is_help=True)


def _convert(kind: str, root: Path, split: str, out: Path | None, overwrite: bool, instances: Path | None = None) -> None:
    from ..datasets import convert as cv

    out = out or root
    check_out(out, folder=True)
    dest = out / "annotations" / split
    with progress_bar("files") as bar:
        task = bar.add_task(f"{kind} {split}", total=None)
        step = lambda: bar.advance(task)  # noqa: E731
        if instances is not None:
            written = cv.coco_object_from_instances(instances, dest, overwrite, step)
        elif kind == "coco-object":
            written = cv.convert_stuffthingmaps(root / "annotations" / split, dest, cv.object_lut(), cv.OBJECT_SUFFIX, overwrite, step)
        else:
            written = cv.convert_stuffthingmaps(root / "annotations" / split, dest, cv.stuff_lut(), cv.STUFF_SUFFIX, overwrite, step)
    if out.resolve() != root.resolve() and (root / "images").is_dir() and not (out / "images").exists():
        (out / "images").symlink_to((root / "images").resolve(), target_is_directory=True)
    err_console.print(f"wrote {written} label files to {dest}", highlight=False)


StuffRootArg = Annotated[Path, typer.Argument(help="COCO-Stuff164k folder: images/<split>/*.jpg and annotations/<split>/*.png (raw stuffthingmaps).")]
SplitOpt = Annotated[str, typer.Option("--split", help="Sub-folder to convert.")]
ConvertOutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Dataset folder to write annotations/<split>/ into (default: ROOT); images/ is linked.")]
ConvertOverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Rewrite label files that already exist.")]


@convert_app.command("coco-stuff")
@user_errors()
def convert_coco_stuff(root: StuffRootArg, split: SplitOpt = "val2017", out: ConvertOutOpt = None, overwrite: ConvertOverwriteOpt = False) -> None:
    """COCO-Stuff labels (*_labelTrainIds.png, 0..170, 255 unlabeled), as mmseg's coco_stuff164k.py."""
    _convert("coco-stuff", root, split, out, overwrite)


@convert_app.command("coco-object")
@user_errors()
def convert_coco_object(
    root: StuffRootArg,
    split: SplitOpt = "val2017",
    out: ConvertOutOpt = None,
    overwrite: ConvertOverwriteOpt = False,
    instances: Annotated[Optional[Path], typer.Option("--instances", help="Rasterise this COCO instances JSON with pycocotools instead (approximate; see docs/datasets.md).")] = None,
) -> None:
    """COCO-Object labels (*_instanceTrainIds.png, 0 background, 1..80 things), as SCLIP's cvt_coco_object.py."""
    _convert("coco-object", root, split, out, overwrite, instances)
