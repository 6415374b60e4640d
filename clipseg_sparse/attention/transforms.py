"""From a term to its N x N scores: metric, GEM's iterations and temperature, shift/scale, support.

All functions take and return B x H' x N x N (H' = 1 for taps shared by all heads). Support masks set
entries that may not be attended to -inf, so every normalizer gives them probability 0 (and the sum
normalizer of feature aggregation gives them weight 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from .normalizers import Normalizer, normalize
from .grid import region_support
from .terms import Term
from .taps import BlockContext


def gaussian_prior(grid: tuple[int, int], sigma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """NACLIP's neighbourhood window: (1+hw) x (1+hw) logits bias, exp(-d^2 / 2 sigma^2) between patches.

    d is the distance on the patch grid; the CLS row and column get 0 (the prior is for patch tokens only).
    """
    h, w = grid
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    pos = torch.stack([ys.flatten(), xs.flatten()], -1).float()
    window = torch.exp(-torch.cdist(pos, pos).pow(2) / (2 * sigma**2))
    return F.pad(window, (1, 0, 1, 0)).to(dtype)


def pair_scores(a: torch.Tensor, b: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """(a @ b^T) * scale, the one place the N x N product is formed (scaled in place: one N x N tensor).
    Always fp32: reduced-precision operands are upcast, so the normalizer sees unrounded scores."""
    return torch.matmul(a.float(), b.float().transpose(-2, -1)).mul_(scale)


def adaptive_temperature(ctx: BlockContext) -> torch.Tensor:
    """GEM's inverse temperature: mean over tokens of ||ln_1(x)||_2 times d^-1/2, per image (B x 1 x 1 x 1)."""
    return ctx.u.float().norm(dim=-1).mean(dim=-1).view(-1, 1, 1, 1) * ctx.q.shape[-1] ** -0.5


def term_scores(term: Term, ctx: BlockContext, normalizer: Normalizer, default_scale: float | None) -> torch.Tensor:
    """B x H' x N x N scores of one term, support applied (see `Term` for the order of the steps).

    default_scale: the spec's temperature (None = d^-1/2) for the dot metric.
    """
    tap, arg = term.ref.tap, term.ref.arg
    if tap.scores is not None:  # scores given as they are (ResCLIP's feedback map)
        return apply_support(transform(tap.scores(ctx, arg), term), term)
    a, b = (f.float() for f in tap.features(ctx, arg))  # scores in fp32, also for reduced-precision models
    if term.temp == "auto":
        t = adaptive_temperature(ctx)
    elif term.temp is not None:
        t = term.temp
    elif term.metric == "cos":
        t = 1.0
    else:
        t = default_scale if default_scale is not None else a.shape[-1] ** -0.5
    if term.metric == "cos":
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    for _ in range(term.iterate):  # GEM's clustering step on a self-similarity (a is b)
        a = normalize(pair_scores(a, a, t), normalizer) @ a
        a = b = F.normalize(a, dim=-1) if term.metric == "cos" else a
    scores = pair_scores(a, b, t)
    return apply_support(transform(scores, term), term, ctx)


def transform(scores: torch.Tensor, term: Term) -> torch.Tensor:
    """scale * (S - shift * mean(S)); the mean is over each image's (and head's) N x N map."""
    if term.shift:
        scores = scores - term.shift * scores.mean(dim=(-2, -1), keepdim=True)
    if term.scale != 1.0:
        scores = scores * term.scale
    return scores


def apply_support(scores: torch.Tensor, term: Term, ctx: BlockContext | None = None) -> torch.Tensor:
    """-inf outside the support: pos (S < 0 dropped), thresh:T (S < T dropped), topk:K (the K largest
    of each row kept, ties included), topp:P (the largest entries whose softmax mass first reaches P),
    region:EPS (CorrCLIP's scope on the B x M region ids `ctx.extra["regions"]`, see `proxy.region_support`)."""
    kind, arg = term.support, term.support_arg
    if kind == "all":
        return scores
    if kind == "region":
        regions = (ctx.extra if ctx is not None else {}).get("regions")
        if regions is None or regions.shape[-1] != scores.shape[-1]:
            raise UserValueError(f"term {term}: the region support needs region maps on its {scores.shape[-1]}-token grid (give regions)")
        B, H = scores.shape[:2]
        allowed = region_support(scores.reshape(B * H, *scores.shape[2:]), regions.repeat_interleave(H, 0))
        return scores.masked_fill(~allowed.view_as(scores), float("-inf"))
    if kind == "pos":
        drop = scores < 0
    elif kind == "thresh":
        drop = scores < arg
    elif kind == "topk":
        k = min(int(arg), scores.shape[-1])
        drop = scores < scores.topk(k, dim=-1).values[..., -1:]
    else:  # topp
        probs, order = torch.softmax(scores.float(), dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the larger entries
        drop = torch.empty_like(before, dtype=torch.bool).scatter_(-1, order, before >= arg)
    return scores.masked_fill(drop, float("-inf"))
