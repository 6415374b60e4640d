"""bf16 (or fp16) against fp32 on the same weights: forward, text and segment time, and accuracy measures
that do not hang on near-tied random logits. Rows are named by precision ("fp32", the reference, and
"bf16" / "fp16"); suites "precision forward", "precision text", "precision segment".

forward   encode_dense per model and spec, fp32 (reference) and bf16 interleaved; each row carries the
          forward's FLOPs (counted on the fp32 run, the same arithmetic) for the roofline line. The case
          names the accuracy of that spec: the per-patch cosine of bf16 to fp32 features (mean, min),
          label agreement with class prototypes (`prototype_labels`) and, for sparse normalizers, how
          many entries of the edited block's attention are in or out of the support in both.
text      the fast text tower on an evenly spaced subset of the 150 ADE20K names x 80 templates, fp32 vs
          bf16; per-prompt rates, the cosine of the embeddings and the projected time for all 12,000.
segment   Segmenter.predict_labels fp32 vs bf16 on the same images; labels agree on what fraction of pixels
          (random weights: the class maps lie close together, so this fraction is not an accuracy measure).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.normalizers import Normalizer
from ..attention.presets import resolve_spec
from ..models.clip import DenseCLIP
from ..segment.segmenter import Segmenter
from ..segment.vocabulary import resolve_templates
from .roofline import count_gflop
from .timing import BenchRow, best_ms

PROTOTYPE_CELLS = 3  # class prototypes: mean features of a 3 x 3 partition of the image's patch grid


def prototype_labels(feats: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """B x h x w labels: the nearest prototype (K x D, L2-normalised) of each patch feature (B x h x w x D)."""
    return torch.einsum("bhwd,kd->bhwk", feats.float(), prototypes).argmax(-1)


def region_prototypes(feats: torch.Tensor, cells: int = PROTOTYPE_CELLS) -> torch.Tensor:
    """(cells^2 * B) x D L2-normalised mean features of each cell of a cells x cells partition of every
    image's patch grid: classes made of the image's own regions, so every class wins clearly on its own
    region (unlike random-weight text embeddings, whose class maps are near ties everywhere)."""
    B, h, w, _ = feats.shape
    rows = torch.arange(h) * cells // h
    cols = torch.arange(w) * cells // w
    cell = (rows[:, None] * cells + cols[None]).flatten()
    flat = feats.reshape(B, h * w, -1).float()
    means = [flat[b, cell == c].mean(0) for b in range(B) for c in range(cells * cells)]
    return F.normalize(torch.stack(means), dim=-1)


@torch.inference_mode()
def accuracy(full: DenseCLIP, low: DenseCLIP, pixels: torch.Tensor, spec: str | None) -> dict[str, float]:
    """bf16 or fp16 (`low`) against fp32 (`full`, the same weights) on `pixels` with `spec`: per-patch feature
    cosine (mean, min), prototype label agreement (`region_prototypes` of the fp32 features), and for
    sparse normalizers the support agreement of the edited block's attention (fraction of all N x N
    entries zero in both or non-zero in both; Jaccard of the two supports)."""
    a, b = full.encode_dense(pixels, spec), low.encode_dense(pixels, spec)
    cosine = (a * b).sum(-1)
    prototypes = region_prototypes(a)
    out = {
        "cosine_mean": float(cosine.mean()),
        "cosine_min": float(cosine.min()),
        "labels": float((prototype_labels(a, prototypes) == prototype_labels(b, prototypes)).float().mean()),
    }
    resolved = resolve_spec(spec)
    if not resolved.is_identity and Normalizer.parse(resolved.normalizer).is_sparse:
        s, t = full.attention_maps(pixels, spec) > 0, low.attention_maps(pixels, spec) > 0
        out["support"] = float((s == t).float().mean())
        out["jaccard"] = float((s & t).sum() / (s | t).sum())
    return out


def describe(acc: dict[str, float]) -> str:
    text = f"feature cosine mean {acc['cosine_mean']:.5f}, min {acc['cosine_min']:.5f}; prototype labels agree {100 * acc['labels']:.2f} %"
    if "support" in acc:
        text += f"; entmax support agrees on {100 * acc['support']:.2f} % of entries (Jaccard {acc['jaccard']:.3f})"
    return text


def bench_precision_forward(
    full: DenseCLIP, low: DenseCLIP, px: int, specs: Sequence[str | None] = (None, "sclip", "sclip-entmax"), repeat: int = 3, batch: int = 1
) -> tuple[list[BenchRow], dict[str, dict[str, float]]]:
    """encode_dense at px x px, fp32 (reference) and `low` interleaved, per spec (None = unpatched CLIP);
    rows carry the fp32 FLOP count; also returns the accuracy (`accuracy`) per spec."""
    px = px // full.patch_size * full.patch_size
    pixels = torch.randn(batch, 3, px, px, generator=torch.Generator().manual_seed(0)).to(full.device)
    rows, found = [], {}
    for spec in specs:
        runs = {"fp32": lambda s=spec: full.encode_dense(pixels, s), low.precision: lambda s=spec: low.encode_dense(pixels, s)}
        times = best_ms(runs, repeat, full.device)
        gflop = count_gflop(runs["fp32"])
        name = spec or "unpatched CLIP"
        found[name] = accuracy(full, low, pixels, spec)
        case = f"{full.model_name} {px}px batch {batch} {name} ({describe(found[name])})"
        rows += [BenchRow("precision forward", case, v, ms, ms / times["fp32"], "fp32", gflop=gflop) for v, ms in times.items()]
    return rows, found


def bench_precision_text(full: DenseCLIP, low: DenseCLIP, names: Sequence[str], prompts: int = 240, repeat: int = 2) -> list[BenchRow]:
    """The fast text tower, fp32 vs `low` interleaved, on an evenly spaced subset of `names` x the 80
    OpenAI templates; the case gives the embeddings' minimum cosine and the projected time for all."""
    every = [t.format(n) for n in names for t in resolve_templates("openai")]
    subset = every[:: max(1, len(every) // max(prompts, 1))]
    times = best_ms({"fp32": lambda: full.encode_text(subset), low.precision: lambda: low.encode_text(subset)}, repeat, full.device)
    cosine = float((full.encode_text(subset) * low.encode_text(subset)).sum(-1).min())
    projected = ", ".join(f"{v} {ms / len(subset) * len(every) / 1e3:.0f} s" for v, ms in times.items())
    case = f"{full.model_name} {len(subset)} of {len(every)} prompts (min cosine {cosine:.5f}; all {len(every)} projected: {projected})"
    return [BenchRow("precision text", case, v, ms, ms / times["fp32"], "fp32") for v, ms in times.items()]


def bench_segment_precision(full: Segmenter, low: Segmenter, images: Sequence[np.ndarray], repeat: int = 2) -> tuple[list[BenchRow], float]:
    """fp32 (reference) vs bf16 / fp16 `predict_labels` on the same images, and the fraction of pixels whose
    labels agree. Both segmenters must hold the same weights, vocabulary, spec and settings."""
    runs = {"fp32": lambda: [full.predict_labels(im) for im in images], low.clip.precision: lambda: [low.predict_labels(im) for im in images]}
    times = best_ms(runs, repeat, full.clip.device)
    agree = float(np.mean([np.mean(full.predict_labels(im) == low.predict_labels(im)) for im in images]))
    case = f"{full.clip.model_name} {len(images)} images, {len(full.vocabulary)} classes, {full.spec} (labels agree {100 * agree:.3f}%)"
    return [BenchRow("precision segment", case, name, ms, ms / times["fp32"], "fp32") for name, ms in times.items()], agree
