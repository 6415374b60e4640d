"""`clipseg-sparse analyze`, `explain` and `demo`, and the gallery and diffusivity parts of `report`.

Thin wrappers: parse, call clipseg_sparse.analysis.statistics / explain / demo, print. Heavy imports in the bodies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    Device,
    DeviceOpt,
    ModelOpt,
    Precision,
    PrecisionOpt,
    PretrainedOpt,
    ProtocolModelOpt,
    ProtocolPretrainedOpt,
    BankOpt,
    ProxyWeightsOpt,
    RegionsOpt,
    bind_resources,
    check_out,
    check_preset,
    fail,
    load_model,
    load_pipeline,
    open_resources,
    out_console,
    user_errors,
)
from ..runtime.progress import err_console

PresetsOpt = Annotated[Optional[list[str]], typer.Option("--preset", help="Attention preset (repeat to compare several; see `ls presets`), or SAM 3 pipelines (`sam3`, `sam3-entmax`: its detector's query rows; `ls pipelines`).")]
AttnsOpt = Annotated[Optional[list[str]], typer.Option("--attn", help="Attention spec such as qq/entmax:1.5/nores/noffn (repeatable).")]

app = typer.Typer()


def resolve_specs(presets: list[str] | None, attns: list[str] | None, default: str) -> list:
    """Every --preset then every --attn, as AttentionSpecs without repeats; the default when none given."""
    from ..attention import AttentionSpec

    for name in presets or []:
        check_preset(name)
    texts = [*(presets or []), *(attns or [])] or [default]
    specs = [AttentionSpec.parse(t) for t in texts]
    return list(dict.fromkeys(specs))


def resolve_pipelines(presets: list[str] | None, attns: list[str] | None) -> list | None:
    """The pipelines the --preset values name (SAM 3: its detector's attention), or None when they name
    attention presets; a mix, or --attn with a pipeline, is refused in one line."""
    from ..segment.pipelines import find_pipeline

    found = [find_pipeline(p) for p in presets or []]
    if not any(found):
        return None
    if not all(found) or attns:
        fail("--preset: give SAM 3 pipelines or attention presets / --attn specs, not both (each reads another model)")
    return list({p.name: p for p in found}.values())


def analysis_file(out: Path, dataset: str, spec, config_key: str) -> Path:
    """OUT/<dataset>__<spec with / and : made file-safe>__<hash>.json: one result file per spec."""
    slug = str(spec).replace("/", "_").replace(":", "-").replace("+", "-")
    return out / f"{dataset}__{slug}__{config_key}.json"


@app.command("analyze", no_args_is_help=True)
@user_errors()
def analyze(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Labelled benchmark (see `ls datasets`).")],
    root: Annotated[Path, typer.Option("--root", help="Folder holding the dataset in its mmseg layout (see docs/datasets.md).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for one result JSON per spec (resumable); none: print only.")] = None,
    preset: PresetsOpt = None,
    attn: AttnsOpt = None,
    model: ProtocolModelOpt = None,
    pretrained: ProtocolPretrainedOpt = None,
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    protocol: Annotated[Optional[str], typer.Option("--protocol", help="Gives resolution and windows per dataset, and the CLIP weights unless given (see `ls protocols`; default sclip, and a pipeline's own protocol for it: sam3).")] = None,
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Short side images are resized to (0 = keep size).")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Sliding-window size in pixels (0 = whole image).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride in pixels.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Windows per forward pass.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N images.")] = None,
    per_head: Annotated[bool, typer.Option("--per-head", help="Also keep every statistic per attention head.")] = False,
    stuff: Annotated[Optional[str], typer.Option("--stuff", help="Comma-separated class names counted as background/stuff (default: the dataset's list).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Recompute finished or partial results in --out.")] = False,
    regions: RegionsOpt = None,
    proxy_weights: ProxyWeightsOpt = "auto",
) -> None:
    """Attention statistics on labelled data: entropy, support, non-zeros, own-class mass, diffusivity.

    Per query patch of the last edited block (labels reduced to the patch grid by majority; void patches
    skipped), averaged over heads, then per image, per class and over the dataset. Default spec: sclip.
    Presets whose attention reads region masks (corrclip, corrclipv2) take --regions; no --bank: retrieval
    acts after the attention. SAM 3 pipelines (`--preset sam3`, `sam3-entmax`) are measured on their detector:
    the last decoder layer's image cross-attention of the instances kept for each prompted class in the image.
    """
    from ..analysis.statistics import analysis_plan, analyze as run_analysis
    from ..datasets import DATASETS
    from ..evaluation.protocols import PROTOCOLS
    from ..files.results import config_hash

    check_out(out, folder=True)
    bench = DATASETS.get(dataset)
    samples = bench.samples(root)  # a missing dataset fails before the model loads
    stuff_ids = None
    if stuff is not None:
        names = [n.strip() for n in stuff.split(",") if n.strip()]
        missing = [n for n in names if n not in bench.classes]
        if missing:
            fail(f"--stuff: {', '.join(missing)} not among the {bench.name} classes (e.g. {', '.join(bench.classes[:5])}, ...)")
        stuff_ids = [bench.classes.index(n) for n in names]
    pipelines = resolve_pipelines(preset, attn)
    if pipelines is not None:
        return analyze_pipelines(pipelines, bench, root, out, protocol, pretrained, device, precision, limit, per_head, stuff_ids, overwrite, proxy_weights)
    protocol = protocol or "sclip"
    proto = PROTOCOLS.get(protocol)
    specs = resolve_specs(preset, attn, default="sclip")
    overrides = dict(resolution=resolution, window=window, stride=stride, batch_size=batch_size)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    plans = [analysis_plan(spec, protocol, bench.name, overrides) for spec in specs]
    # only the attention's readers need regions: analyze runs no stage (regionvote, retrieve act after it)
    inputs = open_resources(plans, device, [s.id for s in samples[:limit]], attention=True, regions=regions, proxy_weights=proxy_weights)
    clip = load_model(*proto.clip_weights(model, pretrained), device, precision)
    inputs = inputs.for_model(clip)
    bound = []
    for plan in plans:  # as eval: the backbones load (or fail in one line) before any image is read
        bound.append(bind_resources(inputs, plan, clip, attention=True))
    records = []
    for spec, used in zip(specs, bound):
        key = config_hash({"model": clip.config(), "root": str(root.resolve()), "protocol": protocol, **overrides, "limit": limit,
                           "per_head": per_head, "stuff": stuff_ids, **({"regions": used.regions.source()} if used.regions else {})})[:8]  # fmt: skip
        path = analysis_file(out, bench.name, spec, key) if out is not None else None
        records.append(run_analysis(clip, bench.name, root, spec, protocol, overrides, limit, path, per_head, stuff_ids, overwrite=overwrite, resources=inputs))
        if path is not None:
            err_console.print(f"result: {path}", highlight=False)
    out_console().print(analysis_table(records))


def analyze_pipelines(pipelines, bench, root: Path, out: Path | None, protocol: str | None, pretrained, device, precision, limit, per_head: bool,
                      stuff_ids, overwrite: bool, proxy_weights: str) -> None:  # fmt: skip
    """`analyze --preset sam3[...]`: the detector's query rows of each pipeline on one loaded model."""
    from ..analysis.statistics import analyze as run_analysis
    from ..evaluation.protocols import PROTOCOLS
    from ..files.results import config_hash

    from ..segment.pipelines import split_pipeline

    if protocol is None:  # the pipeline's own: `sam3` and `sam3-entmax` run the `sam3` protocol
        protocol = split_pipeline(pipelines[0].name)[0].removesuffix("-entmax")
        if protocol not in PROTOCOLS:
            fail(f"--preset {pipelines[0].name}: no protocol of that name; give --protocol (`ls protocols`)")
    PROTOCOLS.get(protocol)
    model = load_pipeline(pipelines[0], proxy_weights, pretrained or "hub", device, precision)
    records = []
    for pipeline in pipelines:
        key = config_hash({"model": model.config(), "root": str(root.resolve()), "protocol": protocol, "limit": limit, "per_head": per_head, "stuff": stuff_ids})[:8]
        path = analysis_file(out, bench.name, pipeline.name, key) if out is not None else None
        records.append(run_analysis(model, bench.name, root, pipeline.name, protocol, None, limit, path, per_head, stuff_ids, overwrite=overwrite))
        if path is not None:
            err_console.print(f"result: {path}", highlight=False)
    out_console().print(analysis_table(records))


def analysis_table(records: list[dict]):
    """One row per spec: the dataset-level means of every statistic."""
    from rich.markup import escape
    from rich.table import Table

    from ..analysis.statistics import STATS

    c = records[0]["config"]
    title = f"attention statistics | {c['dataset']} | {c['model']} ({c['pretrained']}) | {records[0]['num_images']} images, {records[0]['patches']} query patches"
    table = Table("attention", *STATS, title=title, title_justify="left")
    for rec in records:
        m = rec["metrics"]
        table.add_row(escape(rec["config"]["attention"]), *("-" if m[s] is None else f"{m[s]:.3f}" for s in STATS))
    return table


@app.command("explain", no_args_is_help=True)
@user_errors()
def explain(
    image: Annotated[Path, typer.Argument(help="The image to explain.", show_default=False)],
    point: Annotated[str, typer.Option("--point", help="X,Y pixel of the original image whose patch's attention is shown.")],
    classes: Annotated[str, typer.Option("--classes", "-c", help='Classes, comma-separated; "|" joins synonyms.')],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="PNG to write (default IMAGE_STEM.explain.png here).")] = None,
    preset: PresetsOpt = None,
    attn: AttnsOpt = None,
    head: Annotated[Optional[int], typer.Option("--head", min=0, help="Show one attention head (0-based) instead of the mean over heads.")] = None,
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Short side the image is resized to (default 336).")] = None,
    templates: Annotated[str, typer.Option("--templates", help="Prompt templates: openai (80), single, none, or a file.")] = "openai",
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    regions: RegionsOpt = None,
    bank: BankOpt = None,
    proxy_weights: ProxyWeightsOpt = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out file.")] = False,
) -> None:
    """One PNG: per spec, the attention of the patch under --point over the image (entmax's exact zeros
    in grey) beside the segmentation overlay, titled with the row's entropy and support size. With SAM 3
    pipelines (`--preset sam3`, `sam3-entmax`): the image attention of the detector's query behind the label
    at --point (the top-scoring kept instance of that class)."""
    from ..analysis.explain import explain as run_explain, write_explain
    from ..segment.plan import Plan
    from ..segment.settings import InferenceSettings
    from ..segment.vocabulary import Vocabulary

    out = out or Path(f"{image.stem}.explain.png")
    if out.is_dir():
        fail(f"--out {out}: is a folder; give the PNG file to write")
    check_out(out, folder=False)
    if out.exists() and not overwrite:
        fail(f"--out {out}: exists; pass --overwrite to replace it")
    try:
        x, y = (int(v) for v in point.split(","))
    except ValueError:
        fail(f"--point {point!r}: expected X,Y in pixels, e.g. 120,80")
    if not image.is_file():
        fail(f"{image}: image not found")
    vocabulary = Vocabulary.parse(classes)
    vocabulary.check_unique()  # as segment: a repeated name could never win
    pipelines = resolve_pipelines(preset, attn)
    if pipelines is not None:
        return explain_pipelines(pipelines, image, vocabulary, (x, y), out, head, pretrained, device, precision, proxy_weights)
    specs = resolve_specs(preset, attn, default="sclip")
    settings = InferenceSettings().replace(resolution=resolution)
    plans = [Plan.of(spec, settings) for spec in specs]
    inputs = open_resources(plans, device, [image.name], regions=regions, bank=bank, proxy_weights=proxy_weights)
    clip = load_model(model, pretrained, device, precision)
    inputs = inputs.for_model(clip)
    for plan in plans:  # as segment: the backbones load (or fail in one line) before any image is read
        bind_resources(inputs, plan, clip, vocabulary.flat_names)
    views = run_explain(clip, image, vocabulary, specs, (x, y), settings, templates, head, resources=inputs)
    note = " - RANDOM WEIGHTS: the maps show the mechanics only" if clip.pretrained == "none" else ""
    write_explain(views, out, caption=f"{image.name}, point ({x}, {y}), {clip.model_name} ({clip.pretrained}){note}")
    for view in views:
        out_console().print(view.title.replace("\n", ": "), highlight=False, markup=False)  # a spec's [options] are not markup
    err_console.print(f"wrote {out}", highlight=False)


def explain_pipelines(pipelines, image: Path, vocabulary, point: tuple[int, int], out: Path, head, pretrained, device, precision, proxy_weights) -> None:
    """`explain --preset sam3[...]`: one view per pipeline on one loaded model."""
    from ..analysis.explain import explain_pipeline, write_explain
    from ..segment.settings import InferenceSettings

    model = load_pipeline(pipelines[0], proxy_weights, pretrained, device, precision)
    views = [explain_pipeline(p.build(model, vocabulary, InferenceSettings()), image, point, head, image.name) for p in pipelines]
    config = model.config()
    note = " - RANDOM WEIGHTS: the maps show the mechanics only" if config["pretrained"] == "none" else ""
    write_explain(views, out, caption=f"{image.name}, point {point}, SAM 3 ({config['pretrained']}){note}")
    for view in views:
        out_console().print(view.title.replace("\n", ": "), highlight=False, markup=False)
    err_console.print(f"wrote {out}", highlight=False)


def gain_report(records, sources: list[str], out_dir: Path, metric: str | None, overwrite: bool) -> None:
    """`report --diffusivity DIR`: gain vs diffusivity plots and tables; raises ReportError on bad input."""
    from ..analysis.diffusivity import correlations_rich, read_analyses, write_gain_report

    metric = metric or "mIoU"
    written, rows, class_rows = write_gain_report(records, read_analyses(sources), out_dir, metric, overwrite)
    console = out_console()
    console.print(correlations_rich(rows, f"{metric} gain vs softmax diffusivity"))
    if class_rows:
        console.print(correlations_rich(class_rows, "per-class IoU gain vs class diffusivity"))
    for path in written:
        err_console.print(f"wrote {path}", highlight=False)


def gallery(folders: list[str], out: Path, dataset: str | None, root: Path | None, overwrite: bool) -> None:
    """`report --html OUT FOLDER...`: the static gallery page."""
    from ..analysis.gallery import write_gallery

    if (dataset is None) != (root is None):
        fail("--dataset and --root go together (the dataset whose images and labels the predictions are of)")
    if out.is_dir():
        fail(f"--html {out}: is a folder; give the .html file to write")
    check_out(out, folder=False, option="--html")
    path, page = write_gallery(folders, out, dataset, root, overwrite)
    err_console.print(f"wrote {path}: {len(page.rows)} images x {len(page.columns)} columns ({', '.join(page.columns)})", highlight=False, markup=False)


@app.command("demo")
@user_errors()
def demo(
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    preset: PresetsOpt = None,
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Short side images are resized to (default 336).")] = None,
    templates: Annotated[str, typer.Option("--templates", help="Prompt templates: openai (80), single, none, or a file.")] = "openai",
    host: Annotated[str, typer.Option("--host", help="Interface to serve on (default: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to serve on.")] = 7860,
    regions: Annotated[Optional[str], typer.Option("--regions", help="Region masks for the presets that read them (CorrCLIP): sam2 (extra .\\[proxy]); without it those presets are not offered.")] = None,
    proxy_weights: ProxyWeightsOpt = "auto",
) -> None:
    """A local web demo (Gradio; pip install -e ".\\[demo]"): upload, type classes, compare presets, click for attention.

    --pretrained none runs with random weights (labelled so in the page) to try it without downloads.
    """
    try:
        import gradio  # noqa: F401
    except ImportError:
        fail('the demo needs Gradio: pip install -e ".[demo]" (or pip install "clipseg-sparse[demo]")')
    from ..attention import PRESETS
    from ..analysis.demo import DEFAULT_PRESETS, build_demo, launch
    from ..segment.settings import InferenceSettings

    for name in preset or []:
        if name not in PRESETS:
            fail(PRESETS.unknown_message(name))
    settings = InferenceSettings().replace(resolution=resolution)
    check_port(host, port)  # before the model loads
    if regions not in (None, "sam2"):
        fail(f"--regions {regions}: the demo takes sam2 (uploads have no region-mask files)")
    region_src = open_resources([], device, regions=regions).regions  # sam2's extra checked before the model loads
    clip = load_model(model, pretrained, device, precision)
    clip.proxy_weights = proxy_weights  # the backbones of proxy presets (random ones with --pretrained none)
    err_console.print(f"serving on http://{host}:{port} (Ctrl-C stops it)", highlight=False)
    launch(build_demo(clip, settings, templates, preset or DEFAULT_PRESETS, region_src), host, port)


def check_port(host: str, port: int) -> None:
    """One line, exit 2, when the demo could not serve on host:port (in use, or not an address of this machine)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as e:
        fail(f"--host {host} --port {port}: cannot serve there ({e.strerror or e}); pick another --port, or stop what uses it")
