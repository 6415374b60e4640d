"""ResCLIP's semantic feedback (SFR): a first pass labels the patches, the final pass attends along them.

The `feedback:THD` tap gives a pre-normalisation score term (one map for all heads), read from
`BlockContext.extra["feedback"]`, which `encode_tokens` fills before the edited block runs for real:

1. first pass: the edited block(s) with `first_pass_spec(spec)` (the feedback terms dropped, the other
   terms of their group divided by their summed weight), ln_post, proj, cosine with every name of the
   vocabulary (`context["text"]`, synonyms not merged);
2. `first_pass_labels`: the cosine upsampled bilinearly to the window, PAMR(10, (8, 16)) guided by the
   window itself, softmax(logit_scale x cosine) over the names, argmax; pixels whose top probability is
   below THD get name 0; each patch takes the mode of its pixels;
3. `sfr_map`: 1 where two patches share a label, decayed where the line between them leaves the label,
   blurred along the flattened raster index, rows normalised; divided by its maximum and rounded to fp16.

Arithmetic of `yvhangyang/ResCLIP@6b082d9:clip/model.py` (`create_logit_temp`, `create_patch_matrix`,
`check_path`, `generate_attention_sfr`, `custom_attn`), quirks listed in the `resclip` preset's notes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from .spec import AttentionSpec
from .terms import Group, Term, parse_number
from .taps import TAPS, BlockContext, Tap

#: the first pass's PAMR, hard-coded in the published `create_logit_temp`
FEEDBACK_PAMR = (10, (8, 16))


def _check_threshold(arg: str) -> None:
    if not arg:
        raise UserValueError("feedback:THD needs the first pass's probability threshold THD in [0, 1], e.g. feedback:0.25")
    if not 0.0 <= parse_number(arg, "feedback threshold") <= 1.0:
        raise UserValueError(f"feedback:THD needs 0 <= THD <= 1 (got {arg})")


def _feedback_scores(ctx: BlockContext, arg: str) -> torch.Tensor:
    if "feedback" not in ctx.extra:
        raise ValueError(
            "the feedback tap needs a first pass with the vocabulary's text embeddings: run it through "
            "Segmenter / dense_cosine, or encode_dense(..., context={'text': T x D, 'logit_scale': S})"
        )
    fb = ctx.extra["feedback"]  # B x 1 x (1 + N) x (1 + N), a CLS row and column first
    drop = 1 if ctx.offset or ctx.q.shape[-2] == ctx.grid[0] * ctx.grid[1] else 0  # patches alone (cls:C, SigLIP)
    return fb[..., drop:, drop:]


TAPS.register(
    "feedback",
    Tap(scores=_feedback_scores, check=_check_threshold),
    help="feedback:THD (ResCLIP's label-agreement map from a first pass; scores mixed before the normalizer)",
)


def feedback_terms(spec: AttentionSpec) -> list[Term]:
    """The spec's `feedback:THD` terms (ResCLIP has one)."""
    return [t for t in spec.terms if t.kind == "feedback"]


def first_pass_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec without its feedback terms; the other terms of a group that had one keep their share:
    weights divided by their sum (ResCLIP: tau (1 - lambda) kk -> kk, as without a feedback map)."""
    if spec.parallel or len(feedback_terms(spec)) != 1:
        raise UserValueError(f"spec {spec}: feedback needs exactly one feedback term and replace mode (no parallel)")
    groups = []
    for group in spec.groups:
        kept = tuple(t for t in group.terms if t.kind != "feedback")
        if len(kept) < len(group.terms):
            total = sum(t.weight for t in kept)
            kept = tuple(dataclasses.replace(t, weight=t.weight / total) for t in kept)
        if kept:
            groups.append(str(Group(kept, group.weight)))
    if not groups:
        raise UserValueError(f"spec {spec}: a feedback term needs other terms for the first pass")
    return spec.replace(source=tuple(groups))


def first_pass_labels(
    cosine: torch.Tensor, window: torch.Tensor, logit_scale: float, threshold: float, patch: int = 16
) -> torch.Tensor:
    """h x w name index per patch (`create_logit_temp` + `create_patch_matrix`).

    cosine: T x h x w raw cosine of the first pass; window: 3 x H x W the CLIP-normalised window (PAMR's
    guide; H = h x patch, or up to a patch more where the patch convolution dropped the remainder, whose
    pixels then join PAMR but no patch); patch: the patch size in pixels. Ties of the per-patch mode:
    torch.mode's (the smallest name on CPU).
    """
    from ..stages import pamr

    T, h, w = cosine.shape
    H, W = window.shape[-2:]
    up = F.interpolate(cosine[None].float(), size=(H, W), mode="bilinear", align_corners=False)[0]
    up = pamr(up, window.to(up.device), *FEEDBACK_PAMR)
    probs = torch.softmax(up * logit_scale, dim=0)
    labels = probs.argmax(0)
    labels[probs.max(0)[0] < threshold] = 0
    patches = labels[: h * patch, : w * patch].unfold(0, patch, patch).unfold(1, patch, patch).reshape(h, w, -1)
    return torch.mode(patches, dim=-1)[0]


def line_stays_on_label(labels: torch.Tensor, budget: int = 1 << 22) -> tuple[torch.Tensor, torch.Tensor]:
    """(N x N bool: the path check passes, N x N Chebyshev distances) for the raster-ordered patches of
    an h x w label grid, as `check_path`: the points start (1 - t) + end t, t = k / K for k = 0..steps,
    K = the largest distance on the grid (not the pair's own), rounded half to even in float32; the path
    passes when every point has the start's label. So only the first steps / K of the segment is walked.
    Start patches run in chunks of about `budget` points (memory stays bounded on whole images)."""
    h, w = labels.shape
    flat = labels.flatten()
    index = torch.arange(h * w, device=labels.device)
    coords = torch.stack([index // w, index % w], dim=-1)  # N x 2 (row, column)
    steps = (coords[:, None] - coords[None]).abs().amax(-1)  # N x N
    K = int(steps.max())
    t = torch.linspace(0, 1, steps=K + 1, device=labels.device).view(1, 1, -1, 1)
    walked = torch.arange(K + 1, device=labels.device)
    valid = torch.empty_like(steps, dtype=torch.bool)
    chunk = max(1, budget // (h * w * (K + 1)))
    for i in range(0, h * w, chunk):
        start = coords[i : i + chunk, None, None, :]
        points = (start * (1 - t) + coords[None, :, None, :] * t).round().long()  # c x N x (K+1) x 2
        on = labels[points[..., 0], points[..., 1]] == flat[i : i + chunk, None, None]
        valid[i : i + chunk] = (on | (walked > steps[i : i + chunk, :, None])).all(-1)
    return valid, steps


def sfr_map(labels: torch.Tensor, sigma: float) -> torch.Tensor:
    """(1 + N) x (1 + N) feedback map of an h x w label grid (`generate_attention_sfr` with
    delete_same_entity=True, as every published config sets it), CLS row and column 0: A[i, j] = 1 if
    labels agree, times exp(-cheb(i, j) / K) where the path check fails; each row blurred by a 1-D Gaussian (sigma, size
    min(N, 6 sigma + 1) made odd, zero padding) along the raster index, ReLU, divided by sum + 1e-8."""
    h, w = labels.shape
    N = h * w
    flat = labels.flatten()
    attn = (flat[:, None] == flat[None]).float()
    valid, steps = line_stays_on_label(labels)
    attn = torch.where(valid, attn, attn * torch.exp(-steps / int(steps.max())))
    size = min(N, int(6 * sigma + 1))
    size += 1 - size % 2
    x = torch.arange(size, device=labels.device) - size // 2
    kernel = torch.exp(-(x**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    blurred = F.relu(F.conv1d(attn[:, None], kernel.view(1, 1, -1), padding=size // 2)[:, 0])
    out = torch.zeros(N + 1, N + 1, device=labels.device)
    out[1:, 1:] = blurred / (blurred.sum(dim=1, keepdim=True) + 1e-8)
    return out


def feedback_scores(
    visual: torch.nn.Module,
    tokens: torch.Tensor,
    grid: tuple[int, int],
    windows: torch.Tensor,
    spec: AttentionSpec,
    context: Mapping[str, Any] | None,
) -> torch.Tensor:
    """B x 1 x (1 + N) x (1 + N): each window's feedback map over its maximum, rounded to fp16.

    tokens: B x (1 + h*w) x C first-pass output on the (h, w) grid; windows: B x 3 x H x W the encoded windows; context:
    `text` (T x D L2-normalised name embeddings), `logit_scale` (default 40, ResCLIP's) and `windows`, the
    windows before `remainder=drop` cut them to whole patches (the published first pass upsamples to them)."""
    if not context or context.get("text") is None:
        raise ValueError(
            f"spec {spec}: the feedback tap needs the vocabulary's text embeddings (context['text']); "
            "Segmenter and dense_cosine pass them"
        )
    if not spec.gauss_sigma:
        raise UserValueError(f"spec {spec}: feedback blurs its map with the prior's sigma; add gauss:SIGMA (ResCLIP: 5)")
    threshold = float(feedback_terms(spec)[0].ref.arg)
    text = context["text"].to(tokens.device).float()
    normed = visual.ln_post(tokens[:, -grid[0] * grid[1] :])  # the patch tokens
    head = getattr(visual, "dense_head", None)  # a timm tower's per-token head (models/families/timm_tower.py)
    feats = F.normalize((normed @ visual.proj if head is None else head(normed)).float(), dim=-1)  # B x N x D
    patch = windows.shape[-2] // grid[0]  # the encoded windows are whole patches
    windows = context.get("windows", windows)
    maps = []
    for b in range(feats.shape[0]):
        cosine = (feats[b] @ text.T).T.reshape(-1, *grid)
        labels = first_pass_labels(cosine, windows[b], float(context.get("logit_scale", 40.0)), threshold, patch)
        m = sfr_map(labels, spec.gauss_sigma)
        maps.append((m / m.max()).half())
    return torch.stack(maps)[:, None].to(tokens.dtype)
