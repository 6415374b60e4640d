"""Attention statistics on labelled data: how diffuse is the edited block's attention?

The entmax paper's first claim is that sparse attention helps where the baseline attention is diffuse,
i.e. where a patch spreads its attention over patches of *other* ground-truth classes. This module
measures that. For every query patch whose ground-truth class is known (labels reduced to the patch grid
by majority, see `patch_labels`), on the attention rows of the last edited block, per head:

    entropy      -sum_j p_ij log p_ij (nats; 0 log 0 = 0)
    support      exp(entropy), the effective number of attended tokens
    nonzero      the exact number of non-zero entries (entmax's support; N for softmax)
    own_mass     attention on patches of the query's own class
    stuff_mass   attention on patches of background / stuff classes (`stuff_classes`)
    cls_mass     attention on the CLS token
    diffusivity  1 - own_mass

Rows are divided by their sum first (a summed source such as `qq+kk` adds two normalised maps). The
"mean over heads" of a statistic is the mean of the per-head values; for the masses this equals the
mass of the head-averaged map. Statistics are summed per image (and per query class) into an item log,
so a run resumes like `eval`, and averaged over query patches per image, per class and per dataset.

    clip = load_clip("ViT-B-16")
    record = analyze(clip, "ade20k", "/data", "sclip", out=Path("runs/ade-sclip.analysis.json"))
    record["metrics"]["diffusivity"]
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec
from ..datasets import DATASETS, Benchmark, Sample
from ..datasets.classnames import DATA_DIR
from ..datasets.labels import IGNORE_INDEX, patch_labels
from ..errors import UserValueError
from ..models.clip import DenseCLIP
from ..segment.pipelines import QueryAttention, find_pipeline
from ..segment.plan import AttentionWindow, ImageRun, Plan
from ..segment.resources import Resources

STATS = ("entropy", "support", "nonzero", "own_mass", "stuff_mass", "cls_mass", "diffusivity")
ANALYSIS_SETTINGS = ("resolution", "max_long_side", "window", "stride", "batch_size")
PREPROCESS_SETTINGS = ("resize", "pos_interp", "remainder", "size_multiple", "size_rule")  # from the protocol, as eval


# -- stuff classes (data) ----------------------------------------------------------------------------
def stuff_classes(dataset: str) -> tuple[int, ...] | None:
    """Indices of the background / stuff classes of a dataset (after decoding); None when unknown.

    Class 0 where it is a scored background (VOC21, Context60, COCO-Object); COCO-Stuff's trainIds
    80..170 (its first 80 classes are COCO's things); Cityscapes trainIds 0..10 (road .. sky; 11..18
    are the classes with instances); ADE20K the 50 panoptic stuff classes (data/stuff/ade20k.txt).
    """
    if dataset == "ade20k":
        text = (DATA_DIR / "stuff" / "ade20k.txt").read_text(encoding="utf-8")
        return tuple(int(t) for line in text.splitlines() if not line.startswith("#") for t in line.split())
    if dataset == "coco-stuff":
        return tuple(range(80, 171))
    if dataset == "cityscapes":
        return tuple(range(11))
    if dataset in DATASETS and DATASETS.get(dataset).background:
        return (0,)
    return None


# -- pure tensor functions ---------------------------------------------------------------------------
def row_entropy(rows: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dim (nats), with 0 log 0 = 0 so entmax's exact zeros add nothing."""
    return -torch.special.xlogy(rows, rows).sum(-1)


def normalize_rows(maps: torch.Tensor) -> torch.Tensor:
    """Rows divided by their sum, in float64 (a summed source such as qq+kk has rows summing to 2)."""
    maps = maps.double()
    return maps / maps.sum(-1, keepdim=True).clamp_min(1e-300)


def attention_statistics(
    maps: torch.Tensor, labels: torch.Tensor, stuff: torch.Tensor | None = None, has_cls: bool = True
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Row statistics (see module doc) of the labelled query patches.

    maps: H x N x N attention of one image (heads, queries, keys); N = 1 + P with the CLS token first
    when `has_cls`, else N = P. labels: P patch classes (-1 = unknown, see `patch_labels`).
    stuff: bool mask over class indices (True = background / stuff); None gives stuff_mass NaN.
    Returns ({stat: H x Q float64}, Q query classes) for the Q patches with a known class.
    """
    offset = 1 if has_cls else 0
    labels = labels.to(maps.device)
    query = (labels >= 0).nonzero().squeeze(1)
    q_labels = labels[query]
    return row_statistics(maps[:, query + offset], q_labels, labels, stuff, has_cls), q_labels


def row_statistics(rows: torch.Tensor, q_labels: torch.Tensor, labels: torch.Tensor, stuff: torch.Tensor | None, has_cls: bool) -> dict[str, torch.Tensor]:
    """{stat: H x Q float64} of H x Q x N attention rows whose queries have the classes `q_labels`, over keys
    with the classes `labels` (P; -1 = unknown) after the CLS key when `has_cls`."""
    rows = normalize_rows(rows)
    offset = 1 if has_cls else 0
    labels = labels.to(rows.device)
    q_labels = q_labels.to(rows.device)
    patches = rows[..., offset:]  # H x Q x P
    entropy = row_entropy(rows)
    own = (patches * (labels[None, :] == q_labels[:, None])).sum(-1)
    if stuff is None:
        stuff_mass = torch.full_like(own, float("nan"))
    else:
        key_stuff = torch.zeros_like(labels, dtype=torch.bool)
        known = labels >= 0
        key_stuff[known] = stuff.to(labels.device)[labels[known]]
        stuff_mass = (patches * key_stuff).sum(-1)
    return {
        "entropy": entropy,
        "support": entropy.exp(),
        "nonzero": (rows > 0).sum(-1).double(),
        "own_mass": own,
        "stuff_mass": stuff_mass,
        "cls_mass": rows[..., 0] if has_cls else torch.zeros_like(own),
        "diffusivity": 1.0 - own,
    }


def stuff_mask(indices: Sequence[int] | None, num_classes: int) -> torch.Tensor | None:
    if indices is None:
        return None
    mask = torch.zeros(num_classes, dtype=torch.bool)
    mask[list(indices)] = True
    return mask


# -- sums of one image and their aggregation ---------------------------------------------------------
def image_sums(stats: Mapping[str, torch.Tensor], classes: torch.Tensor, per_head: bool = False) -> dict:
    """The item-log record of statistics over query patches: patch count, sums of the head means,
    per query class [count, sums], and per head sums when asked. Adding two records adds their patches."""
    means = {k: v.mean(0) for k, v in stats.items()}  # over heads: Q
    record: dict[str, Any] = {"patches": int(classes.numel()), "sums": {k: float(v.sum()) for k, v in means.items()}}
    per_class = {}
    for c in classes.unique().tolist():
        sel = classes == c
        per_class[str(c)] = [int(sel.sum()), {k: float(v[sel].sum()) for k, v in means.items()}]
    record["classes"] = per_class
    if per_head:
        record["head_sums"] = {k: v.sum(1).tolist() for k, v in stats.items()}
    return record


def add_sums(a: dict | None, b: dict) -> dict:
    """The record of the patches of `a` and `b` together (a None: b)."""
    if a is None:
        return copy.deepcopy(b)
    out = {"patches": a["patches"] + b["patches"], "sums": {k: a["sums"][k] + b["sums"][k] for k in a["sums"]}}
    classes = {c: [n, dict(s)] for c, (n, s) in a["classes"].items()}
    for c, (n, s) in b["classes"].items():
        if c in classes:
            classes[c] = [classes[c][0] + n, {k: classes[c][1][k] + s[k] for k in s}]
        else:
            classes[c] = [n, dict(s)]
    out["classes"] = classes
    if "head_sums" in a and "head_sums" in b:
        out["head_sums"] = {k: [x + y for x, y in zip(a["head_sums"][k], b["head_sums"][k])] for k in a["head_sums"]}
    return out


def _means(sums: Mapping[str, float], count: int) -> dict[str, float | None]:
    """Sums over `count` patches -> means; None (JSON null) for no patches or an undefined statistic."""
    return {k: (v / count if count and not np.isnan(v) else None) for k, v in sums.items()}


def summarize(images: Mapping[str, dict], class_names: Sequence[str]) -> dict:
    """Dataset, per-class and per-image means (over query patches) from per-image records."""
    total = None
    per_image = {}
    for image_id, rec in images.items():
        total = add_sums(total, rec)
        per_image[image_id] = {"patches": rec["patches"], **_means(rec["sums"], rec["patches"])}
    if total is None:
        return {"metrics": {k: None for k in STATS}, "patches": 0, "per_class": {}, "per_image": {}}
    per_class = {}
    for c in sorted(total["classes"], key=int):
        n, sums = total["classes"][c]
        per_class[class_names[int(c)]] = {"patches": n, **_means(sums, n)}
    out = {"metrics": _means(total["sums"], total["patches"]), "patches": total["patches"], "per_class": per_class, "per_image": per_image}
    if "head_sums" in total:
        out["per_head"] = {k: list(_means(dict(enumerate(v)), total["patches"]).values()) for k, v in total["head_sums"].items()}
    return out


# -- one image ---------------------------------------------------------------------------------------
def nearest_labels(labels: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """H x W labels resized to `size` by nearest neighbour (the resized image's pixel grid)."""
    t = torch.as_tensor(labels, dtype=torch.int64)
    if tuple(t.shape) == tuple(size):
        return t
    return F.interpolate(t[None, None].float(), size=size, mode="nearest")[0, 0].long()


def check_tokens(tokens: int, patches: int, spec: AttentionSpec) -> None:
    """The statistics need attention over CLIP's own patch grid (plus CLS): refuse any other token set."""
    if tokens not in (patches, patches + 1):
        raise UserValueError(f"spec {spec} attends over {tokens} tokens, not CLIP's {patches} patches (+ CLS); analyze and explain need CLIP's grid")


def cell_size(window: AttentionWindow, spec: AttentionSpec) -> int:
    """Pixels per side of the cells a window's attention lives on (CLIP's patch, or the finer cell of an
    external backbone's grid: CorrCLIP's DINO B/8, CorrCLIPv2's 2 x CLIP's grid, OV-Stitcher's image-wide DINO
    grid), so the labels are reduced to the grid the rows live on; refused when cells are not whole square pixels."""
    (h, w), (gh, gw) = window.crop, window.grid
    if h % gh or w % gw or h // gh != w // gw:
        raise UserValueError(f"spec {spec} attends over a {gh} x {gw} grid on a {h} x {w} px window: analyze needs square cells of whole pixels")
    return h // gh


def image_statistics(run: ImageRun, labels: np.ndarray, stuff: torch.Tensor | None, per_head: bool = False) -> dict:
    """The summed statistics of one labelled image over all the attention its forward computes (each
    window's rows are those the model computes for that window; overlapping windows count a patch once per
    window; OV-Stitcher's one image-wide map). The run is the one `eval` scores under the same settings
    (`Segmenter.image_run`: the forward's pixels, windows, positional embeddings, region map and whole-image
    features); the labels are resized and cut with them (pixels a window drops count for no patch)."""
    resized = nearest_labels(labels, run.size)
    total = None
    for window in run.plan.forward.attention(run):
        y1, y2, x1, x2 = window.box
        crop = F.pad(resized[y1:y2, x1:x2], window.pad, value=IGNORE_INDEX)
        grid = patch_labels(crop, cell_size(window, run.spec))
        check_tokens(window.maps.shape[-1], grid.numel(), run.spec)
        stats, classes = attention_statistics(window.maps, grid, stuff, has_cls=window.maps.shape[-1] == grid.numel() + 1)
        total = add_sums(total, image_sums(stats, classes, per_head))
    return total


EMPTY_SUMS = {"patches": 0, "sums": {k: 0.0 for k in STATS}, "classes": {}}  # an image with nothing to measure
QUERY_CELL = 4  # label pixels per detector token side when the labels are reduced to its grid


def query_statistics(attention: QueryAttention, labels: np.ndarray, stuff: torch.Tensor | None, per_head: bool = False) -> dict | None:
    """The summed statistics of one labelled image over a detector's query rows (a pipeline's
    `query_attention`): for every prompt name whose class is in the image, the rows of the instances the
    pipeline keeps (its best query when it keeps none), the query's class being the name's; the keys are the
    image tokens, labelled by majority (the labels resized to the detector's square input, as the image is).
    None when no prompted class is in the image."""
    gh, gw = attention.grid
    keys = patch_labels(nearest_labels(labels, (gh * QUERY_CELL, gw * QUERY_CELL)), QUERY_CELL)
    present = set(keys[keys >= 0].tolist())
    total = None
    for i, c in enumerate(attention.name_class):
        if c not in present:
            continue
        kept = attention.kept[i].nonzero().squeeze(1)
        queries = kept if kept.numel() else attention.scores[i].argmax().reshape(1)
        q_labels = torch.full((queries.numel(),), c, dtype=torch.int64)
        stats = row_statistics(attention.rows[i][:, queries], q_labels, keys, stuff, has_cls=False)
        total = add_sums(total, image_sums(stats, q_labels, per_head))
    return total


# -- a dataset ---------------------------------------------------------------------------------------
def analysis_plan(spec: AttentionSpec | str | None, protocol: str, dataset: str, overrides: Mapping[str, Any] | None = None, clip=None) -> Plan:
    """The plan whose attention `analyze` measures: the protocol's settings for the dataset with `overrides`
    (ANALYSIS_SETTINGS only) and no settings stage (none changes the attention; the spec's own stages pick
    its forward)."""
    from ..evaluation.protocols import PROTOCOLS

    unknown = sorted(set(overrides or {}) - set(ANALYSIS_SETTINGS))
    if unknown:
        raise UserValueError(f"analyze takes only the settings {', '.join(ANALYSIS_SETTINGS)} (got {', '.join(unknown)})")
    settings = PROTOCOLS.get(protocol).settings(dataset, overrides)
    return Plan.of(spec, settings.replace(stages=(), pamr=False), clip)


def analyze(
    clip: DenseCLIP | Any,
    dataset_name: str,
    root: str | Path,
    spec: AttentionSpec | str | None = "sclip",
    protocol: str = "sclip",
    overrides: Mapping[str, Any] | None = None,
    limit: int | None = None,
    out: Path | None = None,
    per_head: bool = False,
    stuff: Sequence[int] | None = None,
    progress: bool = True,
    *,
    overwrite: bool = False,
    resume: bool = True,
    regions: Callable[[np.ndarray, str], np.ndarray] | None = None,
    resources: Resources | None = None,
) -> dict:
    """Attention statistics of `spec` on a labelled benchmark; returns the result record (kind "analysis").

    The protocol gives resolution and windows (`overrides`: resolution, window, stride, max_long_side,
    batch_size) and the preprocessing `eval` uses (`resize`, `pos_interp`, `remainder`, `size_multiple`, `size_rule`):
    analyze measures the pixels eval scores. Before, it ignored those four, so under the protocols that set
    them (every protocol but proxyclip and corrclip) its numbers differ from older runs.
    stuff: class indices counted as background / stuff (default `stuff_classes(dataset)`).
    The spec's windows, post and retrieval stages (`hook:lp:patch`, `hook:tlp`, CorrCLIPv2's `hook:retrieve`)
    act on the cosine maps after the attention: they cannot change these statistics and are not run
    (tests/analysis/test_attention_loops.py), so no image bank is needed. regions: the region source (as `Segmenter`'s,
    called with the sample id) of specs whose attention reads region maps (CorrCLIP, CorrCLIPv2; required by
    them, ignored otherwise); the rows of specs on an external backbone's finer grid are measured on that grid.
    resources: the run's inputs (`segment.Resources`: region source, backbones' weights) in place of `regions`.
    A pipeline (`sam3[:CONFIDENCE][/NORMALIZER]`, segment/pipelines.py), `clip` being its loaded model, is
    measured on its detector's query rows instead (`query_statistics`: the rows of the instances it keeps for
    each prompted class in the image, over the image tokens), under the protocol's constants for the dataset.
    out: result JSON, resumable through `<out>.progress.jsonl` exactly as `evaluate` (see results.py);
    a finished result of the same configuration is returned, not recomputed, unless `overwrite`.
    Raises DatasetError, ConfigMismatchError or UserValueError as `evaluate` does.
    """
    from ..segment.images import load_image

    bench = DATASETS.get(dataset_name)
    if limit is not None and limit < 1:
        raise UserValueError(f"limit must be >= 1 (got {limit})")
    stuff = tuple(sorted(set(stuff))) if stuff is not None else stuff_classes(bench.name)
    if stuff is not None and any(not 0 <= c < bench.num_classes for c in stuff):
        raise UserValueError(f"stuff class indices must be in 0..{bench.num_classes - 1} for {bench.name}")
    every_sample = bench.samples(root)
    samples = every_sample[:limit]
    mask = stuff_mask(stuff, bench.num_classes)
    common = {
        "dataset": bench.name, "root": str(Path(root).resolve()),
        "data": bench.fingerprint(every_sample),  # edited or added files make a stored result stale, as in eval
        "protocol": protocol, "per_head": per_head, "stuff_classes": list(stuff) if stuff is not None else None,
    }  # fmt: skip
    if find_pipeline(spec) is not None:
        segmenter, config = _pipeline_segmenter(clip, bench, spec, protocol)
        config = {**config, **common, "query_rows": "last decoder layer's image cross-attention; kept instances (else the best query) of each prompted class in the image", "limit": limit}
        compute = lambda sample: _sample_query_statistics(segmenter, bench, sample, mask, per_head, load_image)  # noqa: E731
        return _collect(config, bench, samples, compute, out, overwrite, resume, progress)
    spec = resolve_spec(spec)
    plan = analysis_plan(spec, protocol, bench.name, overrides, clip)
    settings = plan.settings
    if resources is not None and regions is not None:
        raise UserValueError("give regions either as a keyword or in resources=, not both")
    resources = (resources or Resources.open(plan, regions=regions, attention=True)).bind(plan, clip, attention=True)
    config = {
        **clip.config(),
        "attention": str(spec),
        **resources.record(plan),  # the external backbones the attention reads, their weights; the region source
        **{k: v for k, v in common.items() if k not in ("per_head", "stuff_classes")},
        **{k: getattr(settings, k) for k in ANALYSIS_SETTINGS},
        # the preprocessing eval uses (recorded since analyze follows it: older results, made without it,
        # are refused as of another configuration instead of being shown as finished)
        "preprocess": {k: getattr(settings, k) for k in PREPROCESS_SETTINGS},
        "per_head": per_head,
        "stuff_classes": common["stuff_classes"],
        "patch_labels": "majority over each patch's pixels (nearest-resized labels); void-majority patches skipped",
        "limit": limit,
    }
    compute = lambda sample: _sample_statistics(clip, bench, sample, plan, resources, mask, per_head, load_image)  # noqa: E731
    return _collect(config, bench, samples, compute, out, overwrite, resume, progress)


def _collect(config: dict, bench: Benchmark, samples: Sequence[Sample], compute: Callable[[Sample], dict], out: Path | None,
             overwrite: bool, resume: bool, progress: bool) -> dict:  # fmt: skip
    """Per-image statistics of `samples` (`compute`), resumable through the item log of `out`, summed into the
    result record (kind "analysis"); a finished result of the same `config` is returned as it is."""
    from ..files.results import logged_or_computed, open_run, result_record
    from ..runtime.atomic import write_json_atomic
    from ..runtime.progress import progress_bar

    finished, log = open_run(out, config, overwrite=overwrite, resume=resume)
    if finished is not None:
        return finished
    images, seconds, reused = {}, 0.0, 0
    with progress_bar("images") if progress else nullcontext() as bar:
        task = bar.add_task(f"analyze {bench.name}", total=len(samples)) if bar else None
        for sample in samples:
            rec, was_logged = logged_or_computed(log, sample.id, lambda s=sample: compute(s))
            images[sample.id] = {k: v for k, v in rec.items() if k not in ("id", "seconds")}
            seconds += float(rec["seconds"])
            reused += was_logged
            if bar:
                bar.advance(task)
    summary = summarize(images, bench.classes)
    record = result_record(
        "analysis",
        config,
        metrics=summary.pop("metrics"),
        timing={"wall_s": seconds, "images_per_s": len(samples) / seconds if seconds > 0 else None, "resumed_images": reused},
        num_images=len(samples),
        **summary,
    )
    if out is not None:
        write_json_atomic(out, record)
    return record


def _pipeline_segmenter(model, bench: Benchmark, spec: str, protocol: str):
    """The segmenter a pipeline builds on its loaded `model` for the dataset, as `eval` builds it (the protocol's
    settings, name set and per-dataset constants), and the config of the analysis of it."""
    from ..datasets import class_vocabulary
    from ..evaluation.protocols import PROTOCOLS

    proto = PROTOCOLS.get(protocol)
    pipeline = find_pipeline(proto.pipeline_text(bench.name, spec))
    vocabulary, version = class_vocabulary(bench.name, proto.class_names)
    segmenter = pipeline.build(model, vocabulary, proto.settings(bench.name))
    if not hasattr(segmenter, "query_attention"):
        raise UserValueError(f"{pipeline.name}: this pipeline shows no attention to analyze")
    config = {k: v for k, v in segmenter.config().items() if k != "classes"}
    return segmenter, {**config, "class_names": proto.class_names, "class_names_version": version}


def _sample_query_statistics(segmenter, bench: Benchmark, sample: Sample, mask, per_head: bool, load_image: Callable) -> dict:
    from ..datasets import DatasetError

    labels = bench.load_label(sample.label)
    rgb = load_image(sample.image)
    if rgb.shape[:2] != labels.shape:
        raise DatasetError(f"{bench.name}: image {sample.image} is {rgb.shape[:2]} but label {sample.label} is {labels.shape}")
    return query_statistics(segmenter.query_attention(rgb), labels, mask, per_head) or EMPTY_SUMS


def _sample_statistics(clip, bench: Benchmark, sample: Sample, plan: Plan, resources: Resources, mask, per_head: bool, load_image: Callable) -> dict:
    from ..datasets import DatasetError

    labels = bench.load_label(sample.label)
    rgb = load_image(sample.image)
    if rgb.shape[:2] != labels.shape:
        raise DatasetError(f"{bench.name}: image {sample.image} is {rgb.shape[:2]} but label {sample.label} is {labels.shape}")
    region_map = None if resources.regions is None else resources.regions(rgb, sample.id)
    return image_statistics(ImageRun.of(plan, clip, None, rgb, region_map, resources), labels, mask, per_head)
