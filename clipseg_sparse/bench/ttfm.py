"""Time to first mask: a new vocabulary embedded from a cold cache, then one image segmented.

The text side dominates a first run (150 classes x 80 templates = 12,000 prompts), so it is also timed
against open_clip's plain `encode_text` (every prompt padded to the 77-token context) in the same run.
Plain open_clip takes about 60 ms a prompt for ViT-B/16 on 2 CPU cores, so by default it is timed on an
evenly spaced subset of the prompts (every k-th: all names and templates represented) and compared as a
per-prompt rate; both paths are also timed on that same subset, interleaved.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from .timing import BenchRow, best_ms, smooth_image
from ..segment.segmenter import Segmenter
from ..segment.settings import InferenceSettings
from ..models.clip import DenseCLIP
from ..segment.vocabulary import resolve_templates


def ade20k_names() -> list[str]:
    """The 150 ADE20K class names shipped with the package (first name of each class)."""
    from ..datasets.classnames import class_vocabulary

    vocabulary, _ = class_vocabulary("ade20k", "sclip")
    return [syn[0] for syn in vocabulary.names]


def plain_encode_text(clip: DenseCLIP, prompts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    """open_clip's own way: tokenize to the full context, `model.encode_text`, L2-normalise (T x D fp32)."""
    feats = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            tokens = clip.tokenizer(list(prompts[i : i + batch_size])).to(clip.device)
            feats.append(F.normalize(clip.model.encode_text(tokens).float(), dim=-1))
    return torch.cat(feats)


def bench_ttfm(
    clip: DenseCLIP,
    names: Sequence[str] | None = None,
    templates: str | Sequence[str] = "openai",
    image_size: tuple[int, int] = (480, 640),
    spec: str = "sclip",
    settings: InferenceSettings | None = None,
    plain_prompts: int = 240,
    repeat: int = 2,
) -> tuple[list[BenchRow], dict[str, float]]:
    """Rows for the report and a summary dict: text_s, image_s, total_s, prompts, subset size,
    fast_ms / plain_ms on the subset (best of `repeat`, interleaved), subset_speedup, rate_speedup
    (plain per-prompt time on the subset / ours on the whole vocabulary) and max_abs_diff.

    names: the vocabulary (default: the 150 ADE20K names); plain_prompts: subset size for the plain path
    (0 or >= the number of prompts: all of them).
    """
    names = list(names or ade20k_names())
    templates = resolve_templates(templates)
    settings = settings or InferenceSettings()
    rgb = smooth_image(image_size)
    with tempfile.TemporaryDirectory() as cold:  # an empty cache: the vocabulary is embedded
        start = time.perf_counter()
        seg = Segmenter(clip, names, spec=spec, settings=settings, templates=templates, cache_dir=cold)
        text_s = time.perf_counter() - start
    start = time.perf_counter()
    seg.predict_labels(rgb)
    image_s = time.perf_counter() - start

    prompts = [t.format(n) for n in names for t in templates]
    step = 1 if not plain_prompts or plain_prompts >= len(prompts) else math.ceil(len(prompts) / plain_prompts)
    subset = prompts[::step]
    diff = float((clip.encode_text(subset) - plain_encode_text(clip, subset)).abs().max())
    times = best_ms(
        {"fast": lambda: clip.encode_text(subset), "plain": lambda: plain_encode_text(clip, subset)}, repeat, clip.device
    )
    summary = {
        "prompts": len(prompts),
        "subset": len(subset),
        "text_s": text_s,
        "image_s": image_s,
        "total_s": text_s + image_s,
        "fast_ms": times["fast"],
        "plain_ms": times["plain"],
        "subset_speedup": times["plain"] / times["fast"],
        "rate_speedup": (times["plain"] / len(subset)) / (text_s * 1e3 / len(prompts)),
        "max_abs_diff": diff,
    }
    label = f"{clip.model_name} {len(names)} classes x {len(templates)} templates, {image_size[0]}x{image_size[1]}"
    first = [
        BenchRow("first mask", label, f"text ({len(prompts)} prompts, cold cache)", text_s * 1e3, text_s / summary["total_s"], "total"),
        BenchRow("first mask", label, "image (one predict)", image_s * 1e3, image_s / summary["total_s"], "total"),
        BenchRow("first mask", label, "total", summary["total_s"] * 1e3, 1.0, "total"),
    ]
    case = f"{clip.model_name} {len(subset)} of {len(prompts)} prompts (every {step}), max |diff| {diff:.1e}"
    exact = clip.dtype == torch.float32  # the 1e-6 target is fp32's: in bf16 both paths round differently
    if not exact:
        case += f" (both in {clip.precision}; the 1e-6 target is for fp32)"
    fast, plain = "fast encode_text", "open_clip encode_text (77 tokens)"
    per_prompt = f"per prompt: fast on all {len(prompts)}, open_clip on the {len(subset)} above"
    text = [
        BenchRow("text", case, fast, times["fast"], 1.0, fast),
        BenchRow("text", case, plain, times["plain"], summary["subset_speedup"], fast, max_abs_diff=diff if exact else None),
        BenchRow("text", per_prompt, fast, text_s * 1e3 / len(prompts), 1.0, fast),
        BenchRow("text", per_prompt, plain, times["plain"] / len(subset), summary["rate_speedup"], fast),
    ]
    return first + text, summary
