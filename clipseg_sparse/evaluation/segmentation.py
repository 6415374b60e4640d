"""Running a benchmark: one model, one attention spec, one protocol -> one resumable result file.

    clip = load_clip("ViT-B-16")
    record = evaluate(clip, "voc21", "/data/voc", "sclip-entmax", protocol="sclip", out=Path("voc21.json"))
    record["metrics"]["mIoU"]

Each image's per-class counts (see metrics.py) are appended to an item log beside `out`
(`<out>.progress.jsonl`); an interrupted run reads it back and only segments the remaining images, and
the final metrics are the sums over the log, so a resumed run reports what an uninterrupted one would.
A finished result whose configuration matches is returned as is, not recomputed, unless `overwrite`.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import UserValueError
from ..attention import AttentionSpec
from ..runtime.progress import inner_progress, progress_bar
from ..datasets import DATASETS, Benchmark, DatasetError, Sample, class_vocabulary
from ..datasets.labels import write_label_png
from ..runtime.distributed import all_reduce, rank_and_world, shard
from ..segment.images import load_image
from ..segment.pipelines import find_pipeline
from ..segment.resources import Resources
from ..segment.segmenter import Segmenter
from ..segment.windows import window_progress
from ..segment.vocabulary import Prompts
from .metrics import areas_to_record, intersect_and_union, record_to_areas, segmentation_metrics
from ..models.clip import DenseCLIP
from .protocols import PROTOCOLS
from ..files.results import ItemLog, logged_or_computed, open_run, result_record
from ..runtime.atomic import write_json_atomic


def prediction_path(save_pred: Path, sample: Sample) -> Path:
    """Where `--save-pred` writes a sample's prediction (its id keeps sub-folders, e.g. Cityscapes cities)."""
    return save_pred / f"{sample.id}.png"


def evaluate(
    clip: DenseCLIP | Any,
    dataset_name: str,
    root: str | Path,
    spec: AttentionSpec | str | None = None,
    protocol: str = "sclip",
    overrides: Mapping[str, Any] | None = None,
    class_names: str | None = "sclip",
    limit: int | None = None,
    out: Path | None = None,
    save_pred: Path | None = None,
    resume: bool = True,
    progress: bool = True,
    *,
    overwrite: bool = False,
    templates: str | None = None,
    cache_dir: str | Path | None = None,
    regions: Callable | None = None,
    prompts: Prompts | str | Path | None = None,
    bank=None,
    resources: Resources | None = None,
) -> dict:
    """Evaluate `clip` with `spec` on a benchmark and return the result record (docs/evaluation.md; schema 1).

    spec / class_names None take the protocol's pairing (its attention preset, its class-name set); the
    protocol's own preset takes the dataset's published constants (`Protocol.spec_for`). A spec that names
    a pipeline (`sam3[:CONFIDENCE]`, segment/pipelines.py) runs it instead, `clip` being its loaded model.
    overrides: InferenceSettings fields (resolution, window, stride, logit_scale, bg_threshold,
    area_threshold, batch_size, pamr, resize, pos_interp, remainder, ...) that win over the protocol. limit: the first N images only.
    out: result JSON (written atomically) with its checkpoint log beside it; resume=False restarts the
    log; overwrite=True recomputes a finished result. save_pred: a folder for palette PNG predictions
    in the dataset's own label encoding (reduce_zero_label datasets store class k as k + 1).
    Raises DatasetError for a missing / malformed dataset, ConfigMismatchError when `out` or its log
    hold another configuration, UserValueError for bad settings. regions: the region source of specs and
    stages that read region maps (CorrCLIP; see `Segmenter`), called with each sample's id. prompts: a
    prompt file of sentences per class name (`Segmenter`), recorded in the config. bank: the image
    bank of retrieval stages (CorrCLIPv2; `segment.bank.ImageBank`), recorded by its content hash.
    templates: the prompt templates (`resolve_templates`); None: the protocol's for the dataset (CLIPer's), else
    the 80 OpenAI templates.
    resources: these inputs and the external backbones' weights in one object (`segment.Resources`), in place
    of regions, prompts and bank.

    Under torchrun (an initialised process group) each rank scores every world-th image, the counts are
    summed over ranks and rank 0 writes `out`; every rank returns the same record.
    """
    bench = DATASETS.get(dataset_name)
    proto = PROTOCOLS.get(protocol)
    if limit is not None and limit < 1:
        raise UserValueError(f"limit must be >= 1 (got {limit})")
    every_sample = bench.samples(root)
    samples = every_sample[:limit]
    which = class_names or proto.class_names
    vocabulary, names_version = class_vocabulary(bench.name, which)
    settings = proto.settings(bench.name, overrides)
    templates = templates if templates is not None else proto.templates_for(bench.name) or "openai"
    if not bench.background and (settings.bg_threshold or settings.area_threshold):
        raise UserValueError(f"{bench.name} has no background class: bg_threshold and area_threshold must be 0")
    rank, world = rank_and_world()
    named = find_pipeline(spec if spec is not None else proto.attention)
    pipeline = find_pipeline(proto.pipeline_text(bench.name, spec)) if named else None  # the dataset's constants
    if pipeline is not None and isinstance(clip, DenseCLIP):
        raise UserValueError(f"{pipeline.name} is a pipeline with its own model, not a CLIP spec: pass the model its Pipeline.load gives")
    if pipeline is not None and (prompts is not None or (resources is not None and resources.prompts is not None)):
        raise UserValueError(f"prompts: {pipeline.name} is not a CLIP spec and embeds no prompt file")
    if pipeline is not None:  # not a CLIP spec (SAM 3): `clip` is the pipeline's loaded model
        segmenter = pipeline.build(clip, vocabulary, settings)
    else:
        spec = proto.spec_for(bench.name, spec)  # a preset's per-dataset constants (ResCLIP's)
        segmenter = Segmenter(
            clip, vocabulary, spec, settings, templates, cache_dir, progress=progress and rank == 0, regions=regions, prompts=prompts, bank=bank,
            resources=resources,
        )  # fmt: skip
    config = run_config(segmenter, bench, root, protocol, which, names_version, limit, bench.fingerprint(every_sample))

    finished, log = open_run(out, config, overwrite=overwrite, resume=resume, rank=rank, world=world)
    if finished is not None:
        return finished

    mine = shard(samples, rank, world)
    shown = progress and rank == 0
    with progress_bar("images") if shown else nullcontext() as bar, inner_progress("windows", "windows of the image under way", shown) as inner:
        task = bar.add_task(f"eval {bench.name}", total=len(mine)) if bar else None
        advance = (lambda: bar.advance(task)) if bar else (lambda: None)
        with window_progress(inner):
            totals, seconds, reused = _run(segmenter, bench, mine, log, save_pred, advance)
    totals = all_reduce(totals)
    seconds, reused = all_reduce(np.array([seconds]), op="max")[0], int(all_reduce(np.array([reused]))[0])
    record = eval_record(config, bench, totals, len(samples), seconds, reused)
    if out is not None and rank == 0:
        write_json_atomic(out, record)
    return record


def run_config(
    segmenter: Segmenter, bench: Benchmark, root, protocol: str, class_names: str, names_version: str, limit, data: str
) -> dict:
    """The flat configuration written next to the numbers (everything that changes them); `data` is the
    fingerprint of the whole split (Benchmark.fingerprint), so changed files make a stored result stale."""
    seg = {k: v for k, v in segmenter.config().items() if k != "classes"}
    return {
        **seg,
        "dataset": bench.name,
        "root": str(Path(root).resolve()),
        "data": data,
        "protocol": protocol,
        "class_names": class_names,
        "class_names_version": names_version,
        "limit": limit,
    }


def _run(segmenter: Segmenter, bench: Benchmark, samples: list[Sample], log: ItemLog | None, save_pred, advance: Callable[[], None]):
    """Sum the per-class counts over `samples`, reusing logged images. Returns (3 x C, seconds, reused)."""
    C = bench.num_classes
    totals = np.zeros((3, C), dtype=np.int64)
    seconds, reused = 0.0, 0
    for sample in samples:
        has_pred = save_pred is None or prediction_path(Path(save_pred), sample).is_file()
        rec, was_logged = logged_or_computed(
            log, sample.id, lambda: {"areas": areas_to_record(_score(segmenter, bench, sample, save_pred))}, reusable=has_pred
        )
        totals += record_to_areas(rec["areas"], C)
        seconds += float(rec["seconds"])
        reused += was_logged
        advance()
    return totals, seconds, reused


def _score(segmenter: Segmenter, bench: Benchmark, sample: Sample, save_pred) -> np.ndarray:
    label = bench.load_label(sample.label)
    rgb = load_image(sample.image)
    if rgb.shape[:2] != label.shape:
        raise DatasetError(f"{bench.name}: image {sample.image} is {rgb.shape[:2]} but label {sample.label} is {label.shape}")
    pred = segmenter.predict_labels(rgb, sample.id)
    if save_pred is not None:
        write_label_png(prediction_path(Path(save_pred), sample), bench.encode(pred))
    return intersect_and_union(pred, label, bench.num_classes)


def _percent(x: float) -> float | None:
    return None if np.isnan(x) else 100.0 * float(x)


def eval_record(config: dict, bench: Benchmark, totals: np.ndarray, num_images: int, seconds: float, reused: int) -> dict:
    """The schema-1 eval result: metrics in %, per-class IoU / Acc in % (None = NaN, class absent)."""
    m = segmentation_metrics(totals)
    return result_record(
        "eval",
        config,
        metrics={"mIoU": _percent(m["mIoU"]), "mAcc": _percent(m["mAcc"]), "aAcc": _percent(m["aAcc"])},
        timing={"wall_s": seconds, "images_per_s": num_images / seconds if seconds > 0 else None, "resumed_images": reused},
        per_class={name: {"IoU": _percent(iou), "Acc": _percent(acc)} for name, iou, acc in zip(bench.classes, m["IoU"], m["Acc"])},
        num_images=num_images,
    )

