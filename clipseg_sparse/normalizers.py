"""Row normalizers for attention scores: softmax, alpha-entmax, sparsemax and a random-mask control.

Pure tensor functions in the spirit of the `entmax` package. The normalizer is named by a short string
that is also what the command line, sweep grids and result files use:

    softmax            exp(s) / sum exp(s)
    entmax:ALPHA       Tsallis alpha-entmax, 1 < ALPHA <= 2 (entmax:1 is softmax, entmax:2 is sparsemax)
    sparsemax          Euclidean projection onto the simplex (= entmax:2)
    randmask:ALPHA     control: softmax restricted to a random subset of each row with the same number
                       of non-zeros that entmax:ALPHA would keep

alpha-entmax is  p_i = [1 + (alpha - 1)(s_i - c)]_+ ^ (1 / (alpha - 1))  with the row shift c chosen so
that sum_i p_i = 1. As alpha -> 1 this tends to softmax (since (1 + eps*y)^(1/eps) -> exp(y)); low scores
get exactly zero. We find c exactly from each row's top-k scores (attention supports are small) and
verify it against the (k+1)-th score; rows whose support is larger are solved again on the full row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NORMALIZER_KINDS = ("softmax", "entmax", "sparsemax", "randmask")


@dataclass(frozen=True)
class Normalizer:
    """A parsed normalizer name. `alpha` is 1 for softmax and 2 for sparsemax."""

    kind: str
    alpha: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "Normalizer":
        name, _, arg = text.strip().partition(":")
        name = name.lower()
        if name not in NORMALIZER_KINDS:
            raise ValueError(
                f"unknown normalizer {text!r}; choose softmax, entmax:ALPHA (1 < ALPHA <= 2), sparsemax "
                f"or randmask:ALPHA"
            )
        if name in ("softmax", "sparsemax"):
            if arg:
                raise ValueError(f"normalizer {name!r} takes no argument (got {text!r})")
            return cls(name, 1.0 if name == "softmax" else 2.0)
        if not arg:
            raise ValueError(f"normalizer {name!r} needs an alpha, e.g. {name}:1.5 (got {text!r})")
        try:
            alpha = float(arg)
        except ValueError:
            raise ValueError(f"alpha in {text!r} is not a number") from None
        if not (1.0 <= alpha <= 2.0) or math.isnan(alpha):
            raise ValueError(f"alpha must be in (1, 2] for {name} (got {arg}); alpha = 1 is softmax")
        if name == "entmax" and alpha == 1.0:
            return cls("softmax", 1.0)
        if name == "entmax" and alpha == 2.0:
            return cls("sparsemax", 2.0)
        if name == "randmask" and alpha == 1.0:
            raise ValueError("randmask needs alpha in (1, 2]: at alpha = 1 nothing would be masked")
        return cls(name, alpha)

    def __str__(self) -> str:
        if self.kind in ("softmax", "sparsemax"):
            return self.kind
        return f"{self.kind}:{self.alpha:g}"

    @property
    def is_sparse(self) -> bool:
        return self.kind != "softmax"


def normalize(scores: torch.Tensor, normalizer: str | Normalizer, dim: int = -1) -> torch.Tensor:
    """Normalise `scores` along `dim` into rows that sum to 1.

    Works for fp32, fp16 and bf16 inputs (the threshold is solved in fp32 and the result cast back).
    `-inf` entries get probability 0; a row that is entirely `-inf` gives NaN, as softmax does.
    """
    norm = normalizer if isinstance(normalizer, Normalizer) else Normalizer.parse(normalizer)
    if norm.kind == "softmax":
        return torch.softmax(scores.float(), dim=dim).to(scores.dtype)
    if norm.kind == "randmask":
        return random_mask_softmax(scores, norm.alpha, dim=dim)
    return entmax(scores, norm.alpha, dim=dim)


def entmax(scores: torch.Tensor, alpha: float, dim: int = -1, k: int = 64) -> torch.Tensor:
    """Exact alpha-entmax along `dim` for 1 < alpha <= 2.

    The row shift is found on the top-`k` scores and checked against the (k+1)-th; rows whose support
    does not fit are solved again on the whole row, so the result never depends on `k`. When autograd
    needs a gradient we defer to `entmax.entmax_bisect`, whose backward is implemented.
    """
    if not 1.0 < alpha <= 2.0:
        raise ValueError(f"entmax alpha must be in (1, 2], got {alpha}")
    if torch.is_grad_enabled() and scores.requires_grad:
        from entmax import entmax_bisect

        return entmax_bisect(scores, alpha=alpha, dim=dim)
    x = scores.float().movedim(dim, -1)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    shift = entmax_shift(x, alpha, k=k)
    p = _entmax_from_shift(x, shift, alpha)
    return p.reshape(shape).movedim(-1, dim).to(scores.dtype)


def entmax_shift(x: torch.Tensor, alpha: float, k: int = 64) -> torch.Tensor:
    """The shift c of each row of `x` (R x N, fp32) so that sum_i [1 + (a-1)(x_i - c)]_+^(1/(a-1)) = 1."""
    n = x.shape[-1]
    if k >= n:
        return _solve_shift(x, alpha)
    top = torch.topk(x, k=k + 1, dim=-1).values
    shift = _solve_shift(top[:, :k], alpha)
    # The top-k solution is the true one iff the (k+1)-th score is outside the support.
    outside = (1.0 + (alpha - 1.0) * (top[:, k : k + 1] - shift) <= 0).squeeze(-1)
    if not bool(outside.all()):
        redo = ~outside
        shift[redo] = entmax_shift(x[redo], alpha, k=min(n, 4 * k))
    return shift


def _solve_shift(z: torch.Tensor, alpha: float, max_iter: int = 100) -> torch.Tensor:
    """Row shift for scores `z` (R x K) by Newton's method started at the row max.

    f(c) = sum_i [1 + (a-1)(z_i - c)]_+^p - 1 with p = 1/(a-1) >= 1 is convex and decreasing in c, and
    f(max z) >= 0, so Newton iterates from the left increase monotonically to the root and never
    overshoot. For sparsemax (p = 1) each step is exact on its support and it ends in a few steps.
    Once the support is fixed, alpha = 2 and 1.5 have closed forms, used to polish the result.
    """
    am1 = alpha - 1.0
    p = 1.0 / am1
    zmax = z.amax(-1, keepdim=True)
    finite = torch.isfinite(zmax)
    z = torch.where(finite, z - torch.where(finite, zmax, 0.0), z)  # shift-invariance: work relative to max
    c = torch.zeros_like(zmax)
    for _ in range(max_iter):
        u = torch.clamp(1.0 + am1 * (z - c), min=0.0)
        up = u.pow(p - 1.0) if p != 1.0 else (u > 0).to(u.dtype)
        f = (up * u).sum(-1, keepdim=True) - 1.0
        df = up.sum(-1, keepdim=True)
        step = f / df
        c = c + step
        if bool((step.abs() <= 1e-6 * (1.0 + c.abs())).all()):
            break
    support = (1.0 + am1 * (z - c)) > 0
    if alpha == 2.0:  # p = 1: sum_S (1 + z_i - c) = 1, so c = 1 + (sum_S z - 1) / |S|
        size = support.sum(-1, keepdim=True).clamp(min=1)
        c = 1.0 + (torch.where(support, z, 0.0).sum(-1, keepdim=True) - 1.0) / size
    elif alpha == 1.5:  # p = 2: sum_S (1 + (z_i - c)/2)^2 = 1 is a quadratic in c
        size = support.sum(-1, keepdim=True).clamp(min=1).to(z.dtype)
        w = torch.where(support, 1.0 + 0.5 * z, 0.0)
        s1, s2 = w.sum(-1, keepdim=True), (w * w).sum(-1, keepdim=True)
        disc = torch.clamp(s1 * s1 - size * (s2 - 1.0), min=0.0)
        c = 2.0 * (s1 - disc.sqrt()) / size
    return c + torch.where(finite, zmax, 0.0)


def _entmax_from_shift(x: torch.Tensor, shift: torch.Tensor, alpha: float) -> torch.Tensor:
    am1 = alpha - 1.0
    u = torch.clamp(1.0 + am1 * (x - shift), min=0.0)
    p = u if alpha == 2.0 else (u * u if alpha == 1.5 else u.pow(1.0 / am1))
    return p / p.sum(-1, keepdim=True)


def random_mask_softmax(
    scores: torch.Tensor, alpha: float, dim: int = -1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Softmax over a random subset of each row, as many entries as entmax:`alpha` keeps non-zero.

    The control for "is it the sparsity or which entries are kept?". The row maximum is always kept so
    a row is never empty.
    """
    x = scores.float().movedim(dim, -1)
    keep = (entmax(x, alpha, dim=-1) > 0).sum(-1, keepdim=True)
    noise = torch.rand(x.shape, generator=generator, device=x.device)
    noise.scatter_(-1, x.argmax(-1, keepdim=True), 2.0)  # the max ranks first
    rank = noise.argsort(-1, descending=True).argsort(-1)
    masked = x.masked_fill(rank >= keep, float("-inf"))
    return torch.softmax(masked, dim=-1).movedim(-1, dim).to(scores.dtype)
