"""Running FG-OVD: score every benchmark region against its positive and hard-negative captions.

Annotations of all given benchmark files are grouped by image, so each COCO image is read and encoded
once for all its regions (the eight files share most images). Each image's scores go to the same
item log `eval` keeps beside its result (`<out>.progress.jsonl`); an interrupted run resumes from it, and
the metrics are always recomputed from the logged scores, so a resumed run gives the same numbers as an
uninterrupted one. A finished result with the same configuration is returned, not recomputed.
Under torchrun each rank scores every world-th image and logs it in its own item log, as `evaluate`
does; the scores are gathered and rank 0 writes the result.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import torch

from ...attention import AttentionSpec, resolve_spec
from ...errors import UserValueError
from ...stages import resolve_stages
from ...runtime.distributed import gather, rank_and_world, shard
from ...runtime.progress import progress_bar
from ...segment.images import load_image
from ...segment.preprocess import prepare
from ...segment.settings import InferenceSettings
from ...models.clip import DenseCLIP
from ...registry import Registry
from ...files.results import logged_or_computed, open_run, result_record
from ...runtime.fingerprint import file_id
from ...runtime.atomic import write_json_atomic
from ...segment.vocabulary import embed_names, resolve_templates, templates_id
from .data import BenchmarkFile, RegionAnnotation, check_images, check_segmentations, read_benchmark
from .metrics import fgovd_metrics
from .pooling import WindowFeatures, box_map, encode_crops, mask_map

#: region mode -> what it embeds
REGIONS: Registry[str] = Registry("FG-OVD region mode")
for _name, _what in (
    ("pool", "mean of the dense patch features inside the box (fractional coverage at the edges)"),
    ("mask", "mean of the dense patch features inside the segmentation mask"),
    ("crop", "the box cut out (x scale factor) and encoded whole, as the benchmark authors did"),
):
    REGIONS.register(_name, _what, help=_what)

DEFAULT_NEGATIVES = 10


def _select(benchmarks: Sequence[BenchmarkFile], limit: int | None) -> dict[str, list[RegionAnnotation]]:
    """file_name -> annotations of every benchmark, the first `limit` images of each file only."""
    groups: dict[str, list[RegionAnnotation]] = {}
    for bench in benchmarks:
        keep = set(bench.images()[:limit] if limit is not None else bench.images())
        for ann in bench.annotations:
            if ann.file_name in keep:
                groups.setdefault(ann.file_name, []).append(ann)
    return groups


def _read_image(path: Path, ann: RegionAnnotation):
    rgb = load_image(path, exif_transpose=False)  # COCO boxes refer to the stored pixels
    if rgb.shape[:2] != (ann.height, ann.width):
        raise UserValueError(
            f"{path}: image is {rgb.shape[1]}x{rgb.shape[0]} but the benchmark declares {ann.width}x{ann.height} "
            f"(image id {ann.image_id}, fields 'width'/'height'); wrong COCO root or a different image"
        )
    return rgb


def region_embeddings(
    clip: DenseCLIP,
    rgb,
    annotations: Sequence[RegionAnnotation],
    spec: AttentionSpec,
    region: str,
    settings: InferenceSettings,
    scale_factor: float = 1.0,
) -> torch.Tensor:
    """A x D L2-normalised embeddings of the regions of one H x W x 3 uint8 image (encoded once)."""
    if region == "crop":
        return encode_crops(clip, rgb, [a.box for a in annotations], spec, scale_factor, settings.batch_size)
    height, width = rgb.shape[:2]
    pixels = prepare(rgb, clip, settings, resize="torch", multiple=0)  # as FG-OVD was always measured: float resize, unrounded
    size = tuple(pixels.shape[-2:])
    scale = (size[0] / height, size[1] / width)
    feats = WindowFeatures.compute(clip, pixels, spec, settings)
    if region == "pool":
        maps = torch.stack([box_map(a.box, scale, size) for a in annotations])
    else:
        maps = torch.stack([mask_map(a, size) for a in annotations])
    empty = (maps.sum((1, 2)) <= 0).nonzero()
    if len(empty):
        a = annotations[int(empty[0])]
        field = "bbox" if region == "pool" else "segmentation"
        raise UserValueError(f"{a.split} annotation id {a.id} (image id {a.image_id}): field {field!r} covers no pixel of the image")
    return feats.pool(maps)


def check_stages(spec: AttentionSpec, settings: InferenceSettings) -> None:
    """UserValueError for a stage FG-OVD cannot run. Its regions are pooled from dense features, so token
    stages (which edit the features, e.g. SC-CLIP's `lof`) run; every other kind acts on class maps,
    labels or the whole-image pipeline of `Segmenter` (PAMR, SAM, region votes, retrieval, propagation)
    and would be skipped without a word, leaving numbers that claim a method they did not run."""
    other = [s.name for s in resolve_stages((*spec.hooks, *settings.stage_texts())) if s.kind != "token"]
    if other:
        raise UserValueError(
            f"fgovd pools region embeddings from dense features and cannot run stage(s) {', '.join(other)} of {spec} "
            "(they act on class maps or labels): give --attn with the spec without them"
        )


def evaluate_fgovd(
    clip: DenseCLIP,
    benchmarks: list[Path],
    images_root: Path,
    spec: AttentionSpec | str | None,
    region: str = "pool",
    negatives: int = DEFAULT_NEGATIVES,
    settings: InferenceSettings | None = None,
    templates: str | Sequence[str] = "none",
    scale_factor: float = 1.0,
    limit: int | None = None,
    out: Path | None = None,
    resume: bool = True,
    progress: bool = True,
    *,
    overwrite: bool = False,
) -> dict:
    """Evaluate region-caption matching on FG-OVD benchmark files; returns the schema-1 result record.

    benchmarks: FG-OVD JSON files (the split comes from each file name). images_root: the COCO 2017 root
    (holding val2017/ and train2017/). spec: the attention spec (a preset name or spec text works).
    region: pool | mask | crop (see `regions`). negatives: score the first N hard negatives and report
    N = 1..negatives. templates: caption templates, `none` = each caption as written. limit: only the
    first `limit` images of each file. out: result JSON with its checkpoint log `<out>.progress.jsonl`
    beside it, as `evaluate` keeps; resume=False restarts the log; overwrite=True recomputes a finished
    result. Raises ConfigMismatchError when `out` or its log hold another configuration,
    BenchmarkFormatError / MissingImageError for bad inputs.
    """
    spec = resolve_spec(spec)
    clip.check_spec(spec)
    settings = settings or InferenceSettings()
    check_stages(spec, settings)
    REGIONS.get(region)
    if negatives < 1:
        raise UserValueError(f"negatives must be >= 1 (got {negatives})")
    if scale_factor <= 0:
        raise UserValueError(f"scale_factor must be > 0 (got {scale_factor})")
    if limit is not None and limit < 1:
        raise UserValueError(f"limit must be >= 1 (got {limit})")
    templates = resolve_templates(templates)  # fails early on a bad template argument
    loaded = [read_benchmark(p) for p in benchmarks]
    splits = [b.split for b in loaded]
    if len(set(splits)) != len(splits):
        raise UserValueError(f"each split can be given once (got {', '.join(splits)})")
    config = {
        **clip.config(),
        "attention": str(spec),
        "benchmarks": splits,
        "benchmark_files": [file_id(p) for p in benchmarks],  # the files, not only their split names
        "images_root": str(Path(images_root).resolve()),
        "region": region,
        "negatives": negatives,
        "scale_factor": scale_factor,
        "templates": templates_id(templates),
        **dataclasses.asdict(settings),
        "limit": limit,
    }
    groups = _select(loaded, limit)
    annotations = [a for anns in groups.values() for a in anns]
    if region == "mask":
        check_segmentations(annotations)
    check_images(annotations, images_root)

    rank, world = rank_and_world()
    finished, log = open_run(out, config, overwrite=overwrite, resume=resume, rank=rank, world=world)
    if finished is not None:
        return finished

    captions = list(dict.fromkeys(c for a in annotations for c in a.captions[: negatives + 1]))
    text = embed_names(clip, captions, templates, progress=progress and rank == 0).to(clip.device)
    row = {c: i for i, c in enumerate(captions)}

    records: list[dict] = []
    seconds, reused = 0.0, 0
    mine = shard(list(groups.items()), rank, world)
    with progress_bar("images") if progress and rank == 0 else nullcontext() as bar:
        task = bar.add_task("fgovd", total=len(mine)) if bar else None
        for file_name, anns in mine:

            @torch.inference_mode()
            def score_image() -> dict:
                rgb = _read_image(Path(images_root) / file_name, anns[0])
                emb = region_embeddings(clip, rgb, anns, spec, region, settings, scale_factor)
                return {"annotations": [
                    {"id": a.id, "split": a.split, "scores": (text[[row[c] for c in a.captions[: negatives + 1]]] @ e).tolist()}
                    for a, e in zip(anns, emb)
                ]}  # fmt: skip

            rec, was_logged = logged_or_computed(log, file_name, score_image)
            records += rec["annotations"]
            seconds += float(rec["seconds"])
            reused += was_logged
            if bar:
                bar.advance(task)

    parts = gather((records, seconds, reused))  # every rank's scores, so every rank returns the result
    records, seconds, reused = [r for p in parts for r in p[0]], max(p[1] for p in parts), sum(p[2] for p in parts)
    order = {s: i for i, s in enumerate(splits)}
    per_annotation = sorted(records, key=lambda r: (order[r["split"]], r["id"]))
    result = result_record(
        "fgovd",
        config,
        metrics=fgovd_metrics(per_annotation, negatives, splits),
        timing={
            "wall_s": seconds,
            "annotations_per_s": len(per_annotation) / seconds if seconds > 0 else None,
            "resumed_images": reused,
        },
        per_annotation=per_annotation,
    )
    if out is not None and rank == 0:
        write_json_atomic(out, result)
    return result
