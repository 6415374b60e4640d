"""Combining score groups into the attention that multiplies the values.

out = sum_g w_g A_g V (divided by the number of groups with `avg`), where A_g = normalizer(sum_t w_t S_t
+ prior) for a group of score terms, or the tap's own normalised map (`attn@A-B`). `_attend` computes
`out` (plain groups through fused kernels, no N x N matrix kept); `attention_weights` computes
sum_g w_g A_g itself from the same score and normalize functions, for analysis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..runtime.accel import adasplash_entmax_attention, can_use_adasplash
from .normalizers import Normalizer, normalize
from .precision import like
from .spec import AttentionSpec
from .terms import Group, Term
from .grid import values_to_grid
from .taps import BlockContext, attention_grid
from .transforms import apply_support, gaussian_prior, pair_scores, term_scores


def _prior(spec: AttentionSpec, ctx: BlockContext, like: torch.Tensor) -> torch.Tensor | None:
    if not spec.gauss_sigma:
        return None
    prior = gaussian_prior(ctx.grid, spec.gauss_sigma, like.device, like.dtype)
    # patch tokens alone (like: B x H x N x ...): with cls:C, or on a tower without a CLS token (SigLIP)
    drop = 1 if ctx.offset or like.shape[-2] == ctx.grid[0] * ctx.grid[1] else 0
    return prior[drop:, drop:]


def _plain_operands(group: Group, ctx: BlockContext) -> tuple[torch.Tensor, torch.Tensor]:
    term = group.terms[0].tap
    return getattr(ctx, term[0]), getattr(ctx, term[1])


def _is_plain(group: Group) -> bool:
    return len(group.terms) == 1 and group.weight == 1.0 and group.terms[0].is_plain


def group_scores(group: Group, spec: AttentionSpec, ctx: BlockContext, norm: Normalizer) -> torch.Tensor:
    """sum_t w_t S_t + prior: the B x H' x N x N logits of one group before its normalizer."""
    scores = None
    for term in group.terms:
        s = term_scores(term, ctx, norm, spec.temperature)
        s = s if term.weight == 1.0 else s * term.weight
        scores = s if scores is None else scores + s
    prior = _prior(spec, ctx, scores)
    return scores if prior is None else scores + prior


def group_map(group: Group, spec: AttentionSpec, ctx: BlockContext, norm: Normalizer) -> torch.Tensor:
    """A_g, B x H' x N x N, rows summing to 1."""
    if group.is_map:
        (term,) = group.terms
        return term.ref.tap.maps(ctx, term.ref.arg)
    return normalize(group_scores(group, spec, ctx, norm), norm)


def _negative(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmin over the scores, the DnA-style negative map."""
    return torch.softmax(-scores.float(), dim=-1).to(v.dtype)


def attended_values(spec: AttentionSpec, ctx: BlockContext) -> torch.Tensor:
    """ctx.v on the grid the attention lives on: CLIP's, or resized bilinearly (align_corners False) to
    an external backbone's grid (ProxyCLIP), which needs `cls:C` (patch tokens only, no residual)."""
    if ctx.pixels is None:
        return ctx.v
    target = attention_grid(spec, tuple(ctx.pixels.shape[-2:]), ctx.grid)
    if target == tuple(ctx.grid):
        return ctx.v
    if ctx.offset != 1:
        raise UserValueError(f"spec {spec}: terms on an external backbone's grid need cls:C (attention over patch tokens only)")
    return values_to_grid(ctx.v, ctx.grid, target)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, grid: tuple[int, int], ctx: BlockContext | None = None
) -> torch.Tensor:
    """sum over groups of w_g normalize(scores + prior) @ v;  q, k, v: B x H x N x d -> B x H x N x d."""
    ctx = ctx or BlockContext(q=q, k=k, v=v, grid=grid)
    scale = spec.temperature if spec.temperature is not None else q.shape[-1] ** -0.5
    norm = spec.norm
    v = attended_values(spec, ctx)
    out = torch.zeros_like(v)
    for group in spec.groups:
        if not _is_plain(group):
            a = group_map(group, spec, ctx, norm)
            a = like(a, v)  # fp32 scores and normalizer; the product in the values' dtype
            out = out + (a @ v if group.weight == 1.0 else group.weight * (a @ v))
            if spec.negative:
                out = out + spec.negative * (_negative(group_scores(group, spec, ctx, norm), v) @ v)
            continue
        a, b = _plain_operands(group, ctx)
        prior = _prior(spec, ctx, q)
        scores = None  # the N x N matrix, built only where a path needs it, and then once
        if norm.kind == "softmax":  # fused kernel, no N x N matrix kept around
            out = out + F.scaled_dot_product_attention(a, b, v, attn_mask=prior, scale=scale)
        elif norm.kind in ("entmax", "sparsemax") and can_use_adasplash(a, prior is not None):
            out = out + adasplash_entmax_attention(a, b, v, norm.alpha, scale)
        else:
            scores = pair_scores(a, b, scale)  # fp32 (see precision.py)
            if prior is not None and prior.dtype != scores.dtype:
                prior = _prior(spec, ctx, scores)
            out = out + like(normalize(scores if prior is None else scores + prior, norm), v) @ v
        if spec.negative:
            if scores is None:
                scores = pair_scores(a, b, scale)
            out = out + spec.negative * (_negative(scores, v) @ v)
    return out / len(spec.groups) if spec.average else out


def attention_weights(spec: AttentionSpec, ctx: BlockContext) -> torch.Tensor:
    """The B x H x N x N matrix that multiplies the values in `_attend` (identity for source `id`),
    built from the same score and normalize functions (no fused kernel)."""
    q = ctx.q
    B, H, _, _ = q.shape
    N = attended_values(spec, ctx).shape[-2]
    if spec.source == ("id",):
        return torch.eye(N, dtype=q.dtype, device=q.device).expand(B, H, N, N)
    norm = spec.norm
    total = torch.zeros(B, H, N, N, dtype=torch.float32, device=q.device)  # as the normalizers give them
    for group in spec.groups:
        total = total + group.weight * group_map(group, spec, ctx, norm)
        if spec.negative:
            total = total + spec.negative * _negative(group_scores(group, spec, ctx, norm), total)
    return total / len(spec.groups) if spec.average else total


def aggregate(tokens: torch.Tensor, term: Term, ctx: BlockContext) -> torch.Tensor:
    """Feature aggregation with identity values (SC-CLIP): tokens <- R(support(S)) tokens, where R divides
    each row by its sum + 1e-6 and entries outside the support count 0. tokens: B x N x C; the term must
    give one map for all heads (e.g. `x@L[cos,thresh:0.4]`)."""
    scores = term_scores(term, ctx, Normalizer("softmax"), None)
    if scores.shape[1] != 1:
        raise UserValueError(f"aggregation term {term} gives one map per head; use a tap shared by all heads, e.g. x@L")
    weights = scores[:, 0].masked_fill(scores[:, 0] == float("-inf"), 0.0)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return like(weights, tokens) @ tokens


__all__ = ["_attend", "aggregate", "apply_support", "attention_weights", "group_map", "group_scores"]
