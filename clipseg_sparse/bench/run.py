"""Side-by-side timings: the entmax normalizer, the patched forward, and segmentation overhead.

Every suite times its variants in the same run on the same inputs and reports each as a ratio to the
suite's reference, so numbers from a noisy shared machine stay comparable:

    normalizer  fast entmax vs entmax.entmax_bisect vs entmax.entmax15 vs softmax on last-block attention
                scores (heads x N x N, N = prefix + (px / patch)^2) of ViT-B/16 and ViT-L/14, or `--model`
                (any supported family: EVA-02, SigLIP, PE-Core through the tower adapter)
    forward     encode_dense with qq/entmax:1.5 vs qq/softmax vs the unpatched model
    segment     Segmenter.predict on a folder of images vs the bare model forward over the same windows

Times are the best of `repeat` interleaved rounds after a warm-up round (see `best_ms`).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..errors import UserValueError
from ..runtime.accel import adasplash_installed, attention_backend
from ..segment.images import load_image
from ..segment.preprocess import window_boxes
from ..segment.segmenter import Segmenter
from ..segment.settings import InferenceSettings
from ..models.clip import DenseCLIP, load_clip
from ..attention.normalizers import entmax, normalize
from .roofline import achieved, count_gflop, matmul_rates, roofline_lines
from .timing import BenchRow, best_ms, rows_of, smooth_image, write_images

# the project's speed targets (DESIGN.md section 4, round 2), listed with their measurements in
# benchmarks/README.md: name -> (limit, ">=" or "<=")
TARGETS = {
    "fast entmax speed-up over entmax_bisect (ViT-B/16, 448 px)": (5.0, ">="),
    "fast entmax speed-up over the entmax package's fastest path (worst case)": (1.0, ">="),
    "qq/entmax:1.5 forward / qq/softmax forward": (1.15, "<="),
    "qq/entmax:1.25 forward / qq/softmax forward": (1.05, "<="),
    "segment time / bare model time": (1.10, "<="),
    "text speed-up over open_clip encode_text (per prompt)": (5.0, ">="),
    "text max abs difference to open_clip encode_text": (1e-6, "<="),
    "published window loop time / ours": (1.0, ">="),
    "bf16 forward speed-up over fp32 (worst model and spec)": (4.0, ">="),
    "bf16 forward, fraction of the bf16 matrix-product rate (worst model and spec)": (0.30, ">="),
}
SUITES = ("normalizer", "forward", "segment", "ttfm", "windows", "bf16")


# -- (a) normalizers --------------------------------------------------------------------------------
def last_block_scores(clip: DenseCLIP, px: int, source: str = "qq", seed: int = 0) -> torch.Tensor:
    """H x N x N scaled scores of the last block for one random image at px x px (N = prefix tokens +
    (px/patch)^2; the prefix is the CLS token, none in SigLIP).

    The tokens entering the last block come from the model's own blocks and its q/k from the engine's one
    block interface (`taps.block_qkv`: open_clip's fused in_proj, or a timm tower's q/k/v with its q/k norms
    and RoPE), so the scores have the model's real structure (with random weights: a strong diagonal over
    weak off-diagonal scores) on every supported family.
    """
    from ..attention.taps import block_qkv, run_block

    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        x, grid = clip._embed(torch.randn(1, 3, px, px, generator=g).to(clip.device))
        *plain, last = clip.visual.transformer.resblocks
        for block in plain:
            x = run_block(block, x, grid)
        q, k, _ = block_qkv(last, last.ln_1(x), grid)
        a, b = {"q": q, "k": k}[source[0]][0], {"q": q, "k": k}[source[1]][0]  # H x N x d
        return (a @ b.transpose(-2, -1)).float() * q.shape[-1] ** -0.5


def normalizer_variants(alpha: float, slow: bool = True) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> function of scores (.. x N, normalised over the last dim). `slow` adds the package's
    full-sort and bisection solvers, which take seconds at large N."""
    import entmax as pkg

    variants = {f"fast entmax:{alpha:g}": lambda s: entmax(s, alpha), "softmax": lambda s: normalize(s, "softmax")}
    if alpha == 1.5:
        variants["entmax.entmax15 k=64"] = lambda s: pkg.entmax15(s, dim=-1, k=64)
        if slow:
            variants["entmax.entmax15"] = lambda s: pkg.entmax15(s, dim=-1)
    if slow:
        variants[f"entmax.entmax_bisect:{alpha:g}"] = lambda s: pkg.entmax_bisect(s, alpha=alpha, dim=-1)
    return variants


def bench_normalizers(
    cases: Iterable[tuple[str, torch.Tensor]], alphas: Sequence[float] = (1.5, 1.25), repeat: int = 3, slow: bool = True
) -> list[BenchRow]:
    """Time every variant on every (case name, scores) pair; reference = our fast entmax."""
    rows: list[BenchRow] = []
    for case, scores in cases:
        for alpha in alphas:
            variants = normalizer_variants(alpha, slow)
            times = best_ms({name: (lambda f=f: f(scores)) for name, f in variants.items()}, repeat, scores.device)
            rows += rows_of("normalizer", f"{case} alpha {alpha:g}", times, f"fast entmax:{alpha:g}")
    return rows


def score_cases(
    models: Sequence[str], sizes: Sequence[int], device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Iterable[tuple[str, torch.Tensor]]:
    """q-q scores of random-init models at each size, and a peaked variant (4x the scale: supports of a
    few tokens, as trained CLIP attention is sharper than random weights)."""
    for name in models:
        torch.manual_seed(0)
        clip = load_clip(name, pretrained=None, device=device)
        label = Path(name).stem if name.endswith(".json") else name
        for px in sizes:
            px = px // clip.patch_size * clip.patch_size
            scores = last_block_scores(clip, px)
            n = scores.shape[-1]
            yield f"{label} {px}px qq H{scores.shape[0]} N{n}", scores.to(device=device, dtype=dtype)
            yield f"{label} {px}px peaked H{scores.shape[0]} N{n}", (4 * scores).to(device=device, dtype=dtype)
        del clip


# -- (b) patched forward -----------------------------------------------------------------------------
def bench_forward(
    clip: DenseCLIP, px: int, specs: Sequence[str] = ("qq/entmax:1.5", "qq/entmax:1.25"), repeat: int = 3, batch: int = 1
) -> list[BenchRow]:
    """encode_dense at px x px: unpatched CLIP, qq/softmax (reference) and each spec in `specs`; on CUDA
    with AdaSplash installed, also the fused kernel for each entmax spec."""
    px = px // clip.patch_size * clip.patch_size
    pixels = torch.randn(batch, 3, px, px, generator=torch.Generator().manual_seed(0)).to(clip.device)
    runs: dict[str, Callable[[], object]] = {
        "unpatched CLIP": lambda: clip.encode_dense(pixels, None),
        "qq/softmax": lambda: clip.encode_dense(pixels, "qq/softmax"),
    }
    for spec in specs:
        runs[spec] = lambda s=spec: clip.encode_dense(pixels, s)
        if clip.device.type == "cuda" and adasplash_installed():
            runs[f"{spec} adasplash"] = lambda s=spec: _with_adasplash(clip, pixels, s)
    times = best_ms(runs, repeat, clip.device)
    rows = rows_of("forward", f"{clip.model_name} {px}px batch {batch} {clip.precision}", times, "qq/softmax")
    return [dataclasses.replace(r, gflop=count_gflop(runs[r.variant])) for r in rows]


def _with_adasplash(clip: DenseCLIP, pixels: torch.Tensor, spec: str) -> torch.Tensor:
    with attention_backend("adasplash"):
        return clip.encode_dense(pixels, spec)


def bench_segment(
    clip: DenseCLIP,
    image_paths: Sequence[Path],
    classes: int = 150,
    spec: str = "sclip",
    settings: InferenceSettings | None = None,
    repeat: int = 1,
) -> list[BenchRow]:
    """Segmenter.predict over the images (loading included) vs encode_dense on the same window batches."""
    settings = settings or InferenceSettings()
    seg = Segmenter(clip, [f"class {i}" for i in range(classes)], spec=spec, settings=settings, templates="single")
    batches = []
    for path in image_paths:
        pixels = seg.pixels(load_image(path))
        boxes = window_boxes(*pixels.shape[-2:], settings.window, settings.stride)
        for i in range(0, len(boxes), settings.batch_size):
            batches.append(torch.cat([pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in boxes[i : i + settings.batch_size]]))
    runs = {
        "bare model": lambda: [clip.encode_dense(b, seg.spec) for b in batches],
        "segment": lambda: [seg.predict(p) for p in image_paths],
    }
    times = best_ms(runs, repeat, clip.device)
    n = len(image_paths)
    case = f"{clip.model_name} {n} images {classes} classes {settings.resolution}px {spec} ({n / times['segment'] * 1e3:.2f} img/s)"
    return rows_of("segment", case, times, "bare model")


# -- everything ----------------------------------------------------------------------------------------
def run_all(
    quick: bool = False, device: str = "cpu", precision: str = "fp32", model: str | None = None, suites: Sequence[str] = SUITES
) -> list[BenchRow]:
    """The suites named in `suites` (see SUITES). quick: ViT-B/16 at 224 px only, no slow package
    solvers, tiny workloads (10 classes for the first mask, one small image)."""
    from .published import bench_published_windows
    from .ttfm import ade20k_names, bench_ttfm

    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise UserValueError(f"unknown benchmark suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    models = [model] if model else (["ViT-B-16"] if quick else ["ViT-B-16", "ViT-L-14"])
    sizes = [224] if quick else [224, 336, 448]
    repeat = 2 if quick else 3
    rows: list[BenchRow] = []
    if "normalizer" in suites:
        rows += bench_normalizers(score_cases(models, sizes, device, dtype), repeat=repeat, slow=not quick)
    if {"forward", "bf16"} & set(suites):  # the machine's matrix-product rates, for the roofline lines
        rows += matmul_rates(device, repeat)
    torch.manual_seed(0)
    clip = load_clip(models[0], pretrained=None, device=device, precision=precision)
    if "forward" in suites:
        rows += bench_forward(clip, 224 if quick else 448, repeat=repeat)
    size = (240, 320) if quick else (480, 640)
    settings = InferenceSettings(resolution=224) if quick else InferenceSettings()
    classes = 10 if quick else 150
    if "segment" in suites:
        with tempfile.TemporaryDirectory() as tmp:
            paths = write_images(Path(tmp), 1 if quick else 4, size)
            rows += bench_segment(clip, paths, classes=classes, settings=settings, repeat=repeat)
    if "ttfm" in suites:
        names = ade20k_names()[:classes]
        rows += bench_ttfm(clip, names, image_size=(480, 640), settings=settings, plain_prompts=40 if quick else 240, repeat=repeat - 1)[0]
    images = [smooth_image(size, np.random.default_rng(i)) for i in range(1 if quick else 4)]
    vocabulary = [f"class {i}" for i in range(classes)]
    if "windows" in suites:
        seg = Segmenter(clip, vocabulary, spec="sclip", settings=settings, templates="single")
        rows += bench_published_windows(seg, images, repeat=repeat - 1)[0]
    if "bf16" in suites:
        rows += bench_precision(models, 224 if quick else 448, images, vocabulary, settings, device, repeat, 40 if quick else 240)
    return rows


def bench_precision(
    models: Sequence[str], px: int, images: Sequence[np.ndarray], vocabulary: Sequence[str], settings: InferenceSettings,
    device: str = "cpu", repeat: int = 3, prompts: int = 240, low: str = "bf16",
) -> list[BenchRow]:
    """The bf16 suite (precision.py) on random weights loaded in fp32 and in `low` (bf16, or fp16 on a
    GPU): the forward of each model at `px` (unpatched, SCLIP, SCLIP with entmax), the text tower on
    `prompts` of the 12,000 ADE20K prompts, and `predict_labels` of the first model on `images` (none
    with 0 prompts / no images)."""
    from .precision import bench_precision_forward, bench_precision_text, bench_segment_precision
    from .ttfm import ade20k_names

    rows: list[BenchRow] = []
    for i, name in enumerate(models):
        torch.manual_seed(0)
        pair = [load_clip(name, pretrained=None, device=device, precision=p) for p in ("fp32", low)]
        rows += bench_precision_forward(*pair, px, repeat=repeat)[0]
        if i == 0 and prompts:  # 0 prompts / no images: forwards only (e.g. towers whose tokenizer is not cached)
            rows += bench_precision_text(*pair, ade20k_names(), prompts, repeat=max(1, repeat - 1))
        if i == 0 and len(images):
            segmenters = [Segmenter(c, vocabulary, spec="sclip", settings=settings, templates="single") for c in pair]
            rows += bench_segment_precision(*segmenters, images, repeat=max(1, repeat - 1))[0]
        del pair
    return rows


def target_checks(rows: Sequence[BenchRow]) -> list[tuple[str, float, float, bool]]:
    """(target, measured, limit, met) for the speed targets (benchmarks/README.md) the rows can speak to."""
    found: dict[str, float] = {}
    speedups = [  # normalizer ratios are relative to our fast entmax: bisect's ratio is our speed-up
        r.ratio
        for r in rows
        if r.suite == "normalizer" and r.variant.startswith("entmax.entmax_bisect") and "448px" in r.case and "ViT-B-16" in r.case
    ]
    if speedups:
        found["fast entmax speed-up over entmax_bisect (ViT-B/16, 448 px)"] = min(speedups)
    package_best: dict[str, float] = {}  # per case: the package's fastest variant relative to ours
    for r in rows:
        if r.suite == "normalizer" and r.variant.startswith("entmax."):
            package_best[r.case] = min(package_best.get(r.case, math.inf), r.ratio)
    if package_best:
        found["fast entmax speed-up over the entmax package's fastest path (worst case)"] = min(package_best.values())
    for suite, variant, name in (
        ("forward", "qq/entmax:1.5", "qq/entmax:1.5 forward / qq/softmax forward"),
        ("forward", "qq/entmax:1.25", "qq/entmax:1.25 forward / qq/softmax forward"),
        ("segment", "segment", "segment time / bare model time"),
    ):
        ratios = [r.ratio for r in rows if r.suite == suite and r.variant == variant]
        if ratios:
            found[name] = max(ratios)
    rate = [r.ratio for r in rows if r.suite == "text" and r.case.startswith("per prompt") and r.variant != r.reference]
    if rate:
        found["text speed-up over open_clip encode_text (per prompt)"] = min(rate)
    diffs = [r.max_abs_diff for r in rows if r.suite == "text" and r.max_abs_diff is not None]
    if diffs:
        found["text max abs difference to open_clip encode_text"] = max(diffs)
    windows = [r.ratio for r in rows if r.suite == "windows" and r.variant != r.reference]
    if windows:
        found["published window loop time / ours"] = min(windows)
    low = [r for r in rows if r.suite == "precision forward" and r.variant == "bf16"]
    if low:
        found["bf16 forward speed-up over fp32 (worst model and spec)"] = min(1 / r.ratio for r in low)
    rate = [achieved(r) for r in rows if r.suite == "matmul" and r.variant == "bf16"]
    if low and rate:
        found["bf16 forward, fraction of the bf16 matrix-product rate (worst model and spec)"] = min(achieved(r) for r in low) / rate[0]
    checks = []
    for name, value in found.items():
        limit, bound = TARGETS[name]
        checks.append((name, value, limit, value >= limit if bound == ">=" else value <= limit))
    return checks


def rich_tables(rows: Sequence[BenchRow]) -> list:
    """A rich Table of all rows, one of the target checks, and the roofline lines (when the rows have a
    matrix-product probe and FLOP counts)."""
    from rich.table import Table

    table = Table("suite", "case", "variant", "ms", "ratio", title="timings (ratio = ms / reference ms, same run)")
    last = None
    for r in rows:
        case = r.case if (r.suite, r.case) != last else ""
        last = (r.suite, r.case)
        ref = " (reference)" if r.variant == r.reference else ""
        table.add_row(r.suite if case else "", case, r.variant + ref, f"{r.ms:.1f}", f"{r.ratio:.2f}")
    targets = Table("target", "measured", "limit", "met", title="targets (benchmarks/README.md)")
    for name, value, limit, met in target_checks(rows):
        shown = f"{value:.1e}" if value < 1e-3 else f"{value:.2f}"
        targets.add_row(name, shown, f"{TARGETS[name][1]} {limit:g}", "yes" if met else "NO")
    lines = roofline_lines(list(rows))
    return [table, targets] + (["\n".join(lines)] if lines else [])


# -- memory ---------------------------------------------------------------------------------------------
def segment_peak_rss(
    model: str = "ViT-L-14",
    classes: int = 150,
    image_size: tuple[int, int] = (480, 640),
    settings: InferenceSettings | None = None,
    spec: str = "sclip-entmax",
    device: str = "cpu",
) -> dict[str, float]:
    """Peak resident memory (MiB) of segmenting one image with a random-init model, in this process.

    ru_maxrss only grows, so call this once in a fresh process (benchmarks/memory.py does). Returns the
    peak after loading the model and embedding the vocabulary, and the peak after `predict`.
    """
    import resource

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    settings = settings or InferenceSettings(resolution=448)
    torch.manual_seed(0)
    clip = load_clip(model, pretrained=None, device=device)
    seg = Segmenter(clip, [f"class {i}" for i in range(classes)], spec=spec, settings=settings, templates="single")
    loaded = peak()
    rgb = np.random.default_rng(0).integers(0, 255, (*image_size, 3), dtype=np.uint8)
    start = time.perf_counter()
    seg.predict(rgb)
    return {"after_load_mib": loaded, "peak_mib": peak(), "predict_s": time.perf_counter() - start}


# -- shared by the scripts in benchmarks/ -----------------------------------------------------------
def add_run_arguments(parser, model: str | None = "ViT-B-16") -> None:
    """--model (unless None), --repeat, --device and --precision of an argparse parser."""
    if model is not None:
        parser.add_argument("--model", default=model, help="open_clip model name or config JSON")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (best one kept)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")


def random_clip(args) -> DenseCLIP:
    """The random-init model named by parsed `add_run_arguments` options."""
    torch.manual_seed(0)
    return load_clip(args.model, pretrained=None, device=args.device, precision=args.precision)
