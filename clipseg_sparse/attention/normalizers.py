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
get exactly zero. We find c exactly and fast: entries more than 1/(alpha-1) below the row max are never
in the support, so the few candidates of each row are gathered into a small block and c is solved there
by Newton's method on ||u||_p - 1 (see `_solve_shift`); rows with many candidates are solved whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserValueError
from ..registry import Registry

#: kind -> its written form (`ls normalizers`, the spec grammar's help and the parse errors read this one list)
NORMALIZERS: Registry[str] = Registry("normalizer", help_column="meaning")
NORMALIZERS.register("softmax", "softmax", help="standard attention (alpha = 1)")
NORMALIZERS.register("entmax", "entmax:ALPHA", help="alpha-entmax, 1 < ALPHA <= 2: exact zeros below a data-dependent threshold")
NORMALIZERS.register("sparsemax", "sparsemax", help="entmax:2, Euclidean projection onto the simplex")
NORMALIZERS.register("randmask", "randmask:ALPHA", help="control: softmax on a random subset as large as entmax:ALPHA's support")
NORMALIZER_KINDS = tuple(NORMALIZERS.names())


def normalizer_forms() -> str:
    """'softmax, entmax:ALPHA, sparsemax, randmask:ALPHA': the written forms, for help and errors."""
    return ", ".join(NORMALIZERS.get(kind) for kind in NORMALIZERS)
BLOCK_ELEMENTS = 1 << 19  # rows per block x row length: 2 MiB of fp32 per buffer, a core's L2 here
RANDMASK_SEED = 0


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
            raise UserValueError(f"unknown normalizer {text!r}; choose {normalizer_forms()} (1 < ALPHA <= 2)")
        if name in ("softmax", "sparsemax"):
            if arg:
                raise UserValueError(f"normalizer {name!r} takes no argument (got {text!r})")
            return cls(name, 1.0 if name == "softmax" else 2.0)
        if not arg:
            raise UserValueError(f"normalizer {name!r} needs an alpha, e.g. {name}:1.5 (got {text!r})")
        try:
            alpha = float(arg)
        except ValueError:
            raise UserValueError(f"alpha in {text!r} is not a number") from None
        if not (1.0 <= alpha <= 2.0) or math.isnan(alpha):
            raise UserValueError(f"alpha must be in (1, 2] for {name} (got {arg}); alpha = 1 is softmax")
        if name == "entmax" and alpha == 1.0:
            return cls("softmax", 1.0)
        if name == "entmax" and alpha == 2.0:
            return cls("sparsemax", 2.0)
        if name == "randmask" and alpha == 1.0:
            raise UserValueError("randmask needs alpha in (1, 2]: at alpha = 1 nothing would be masked")
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

    Every entry of the support lies within 1/(alpha-1) of its row's maximum, so that cheap test gives a
    superset of the support without sorting. The shift of a row with at most `k` such candidates is
    solved on a small dense R x K block of them; rows with more candidates (alpha near 1, flat rows) are
    solved whole; then the probabilities follow from the shifts in one pass. Rows go through in blocks
    that fit in cache (`_entmax_rows`). The result never depends on `k` or the blocks, only the speed.
    When autograd needs a gradient we defer to `entmax.entmax_bisect`, whose backward is implemented.
    """
    if not 1.0 < alpha <= 2.0:
        raise ValueError(f"entmax alpha must be in (1, 2], got {alpha}")
    if torch.is_grad_enabled() and scores.requires_grad:
        from entmax import entmax_bisect

        return entmax_bisect(scores, alpha=alpha, dim=dim)
    x = scores.float().movedim(dim, -1)
    shape = x.shape
    p = _entmax_rows(x.reshape(-1, shape[-1]), alpha, k)
    return p.reshape(shape).movedim(-1, dim).to(scores.dtype)


def entmax_shift(x: torch.Tensor, alpha: float, k: int = 64) -> torch.Tensor:
    """The shift c (R x 1) of each row of `x` (R x N, fp32): sum_i [1 + (a-1)(x_i - c)]_+^(1/(a-1)) = 1."""
    return _entmax_rows(x, alpha, k, shift_only=True)


def _entmax_rows(x: torch.Tensor, alpha: float, k: int, shift_only: bool = False) -> torch.Tensor:
    """entmax (or its shift) of each row of `x`, R x N fp32, solved in blocks of rows.

    Each block's few row-sized buffers fit in a core's cache, so the Newton passes of `_solve_shift` read
    and write cache instead of memory: on 12 x 785 x 785 scores (ViT-B/16, 448 px) a pass over a block is
    3-4x faster than the same pass over the whole tensor, and each block stops iterating as soon as its
    own rows have converged. The output and three block-sized work buffers are allocated once per call:
    allocating and freeing megabytes per block made the C allocator hand memory back to the system and
    fault it in again, which slowed the model's own matrix products after it by a fifth.
    """
    R, n = x.shape
    rows = max(1, min(R, BLOCK_ELEMENTS // max(n, 1)))
    out = torch.empty((R, 1) if shift_only else (R, n), dtype=x.dtype, device=x.device)
    work = torch.empty(3, rows * n, dtype=x.dtype, device=x.device)
    for start in range(0, R, rows):
        _entmax_block(x[start : start + rows], alpha, k, out[start : start + rows], work, shift_only)
    return out


def _entmax_block(x: torch.Tensor, alpha: float, k: int, out: torch.Tensor, work: torch.Tensor, shift_only: bool) -> None:
    """entmax (or its shift) of each row of one block `x` (R x N fp32) written into `out` (R x N, or R x 1);
    `work`: 3 x (at least R * N) scratch for `_solve_shift`. See `entmax` for the strategy.

    A block that is mostly wide rows is solved whole: in cache a pass over every row costs less than
    splitting the block into wide and narrow rows and scattering the results back. Otherwise narrow rows
    are solved on their gathered candidates and the few wide rows apart.
    """
    R, n = x.shape
    am1 = alpha - 1.0
    top = x.amax(-1, keepdim=True)
    # c >= max (the top entry's probability is at most 1), so x_i <= max - 1/(a-1) is never in the support
    cand = x > top - 1.0 / am1
    counts = cand.sum(-1, dtype=torch.int32)  # much faster than a bool sum
    wide = counts > k
    n_wide = int(wide.sum())
    if 4 * n_wide > R:
        c = _solve_shift(x, alpha, work)
        out.copy_(c) if shift_only else _probs(x, c, alpha, out=out)
        return
    if n_wide:
        cand[wide] = False
        counts = counts.masked_fill(wide, 0)
    rows, cols = cand.nonzero(as_tuple=True)
    start = counts.cumsum(0) - counts
    pos = torch.arange(rows.numel(), device=x.device) - start[rows]
    # at least one column: rows without a finite score have no candidate (they are set to NaN below)
    z = torch.full((R, max(int(counts.max()), 1)), float("-inf"), dtype=x.dtype, device=x.device)
    z[rows, pos] = x[rows, cols]
    c = _solve_shift(z, alpha, work)
    if n_wide:
        rows_w = wide.nonzero().squeeze(-1)
        full = x[rows_w]
        c_wide = _solve_shift(full, alpha, work)
        c[rows_w] = c_wide
    if shift_only:
        out.copy_(c)
        return
    out.zero_()
    out[rows, cols] = _probs(z, c, alpha)[rows, pos]
    if n_wide:
        out[rows_w] = _probs(full, c_wide, alpha)
    out[~torch.isfinite(top).squeeze(-1)] = float("nan")  # no finite score: undefined, as in softmax


def _solve_shift(z: torch.Tensor, alpha: float, work: torch.Tensor | None = None, max_iter: int = 50, tol: float = 1e-4) -> torch.Tensor:
    """Row shift c (R x 1) for scores `z` (R x K, entries may be -inf) by Newton's method on the norm.

    With u_i = [1 + (a-1)(z_i - c)]_+ and p = 1/(a-1), solve h(c) = ||u||_p - 1 = 0 rather than
    sum u^p = 1: h is convex and decreasing in c (a p-norm of convex non-negative functions) and close
    to linear, so Newton started at the row max (where h >= 0) climbs monotonically to the root in 3-5
    steps even for alpha near 1, where Newton on sum u^p would crawl. Convergence is quadratic, so once
    every step is below `tol` (relative to 1 + |c|, in score units) the error left is below fp32
    resolution and we stop (measured against 100-step float64 bisection on ViT-B/16 and ViT-L/14 rows,
    alpha 1.1-1.75: 2-5e-7 with tol 1e-4, as with 1e-5, which took one more pass). Once the support is
    fixed, alpha = 2 and 1.5 have closed forms, used to polish the result. Three R x K buffers (views of
    `work`, 3 x at least R * K, when given) serve every iteration: no per-step allocation.
    """
    am1 = alpha - 1.0
    p = 1.0 / am1
    numel = z.numel()
    za, u, up = (work[i, :numel].view(z.shape) for i in range(3)) if work is not None else (torch.empty_like(z) for _ in range(3))
    zmax = z.amax(-1, keepdim=True)
    finite = torch.isfinite(zmax)
    # shift-invariance: work relative to the max; u = [za + 1 - (a-1) c]_+ : one add and one clamp per step
    torch.sub(z, torch.where(finite, zmax, 0.0), out=za).mul_(am1)
    c = torch.zeros_like(zmax)
    for _ in range(max_iter):
        torch.add(za, 1.0 - am1 * c, out=u).clamp_(min=0.0)
        upow = _power(u, p - 1.0, out=up)
        s = torch.linalg.vecdot(upow, u).unsqueeze(-1)  # sum u^p
        t = upow.sum(-1, keepdim=True)  # -d/dc sum u^p
        step = torch.where(t > 0, (s - s.pow(1.0 - am1)) / (am1 * t), 0.0)
        c = c + step
        if bool((step.abs() <= tol * (1.0 + c.abs())).all()):
            break
    if alpha in (1.5, 2.0):  # support fixed: closed forms on it, from u alone (0 off the support, no -inf)
        torch.add(za, 1.0 - am1 * c, out=u).clamp_(min=0.0)
        size = (u > 0).sum(-1, keepdim=True, dtype=torch.int32).clamp(min=1).to(z.dtype)
        s1 = u.sum(-1, keepdim=True)
        if alpha == 2.0:  # sum_S (u_i - (c' - c)) = 1
            c = c + (s1 - 1.0) / size
        else:  # sum_S (u_i - d)^2 = 1 with d = (c' - c) / 2: the smaller root of a quadratic in d
            s2 = torch.linalg.vecdot(u, u).unsqueeze(-1)
            c = c + 2.0 * (s1 - torch.clamp(s1 * s1 - size * (s2 - 1.0), min=0.0).sqrt()) / size
    return c + torch.where(finite, zmax, 0.0)


def _power(u: torch.Tensor, e: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """u ** e for u >= 0, with 0 ** 0 = 0 (so that an entry outside the support counts for nothing).

    Written into `out` when given, except for e = 1, where `u` itself is returned.
    """
    if e == 1.0:
        return u
    out = torch.empty_like(u) if out is None else out
    if e == 0.0:
        return out.copy_(u > 0)
    if e in (2.0, 4.0):  # by multiplication: torch.pow has fast paths for 2 and 3 but not 4 (alpha 1.25)
        torch.mul(u, u, out=out)
        return out.mul_(out) if e == 4.0 else out
    return torch.pow(u, e, out=out)


def _probs(x: torch.Tensor, shift: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row-normalised [1 + (a-1)(x - shift)]_+^(1/(a-1)) for x R x K, shift R x 1 (written into `out`
    when given)."""
    am1 = alpha - 1.0
    u = torch.sub(x, shift, out=out).mul_(am1).add_(1.0).clamp_(min=0.0)
    p = u if alpha == 2.0 else _power(u, 1.0 / am1, out=u)
    return p.div_(p.sum(-1, keepdim=True))


def random_mask_softmax(
    scores: torch.Tensor, alpha: float, dim: int = -1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Softmax over a random subset of each row, as many entries as entmax:`alpha` keeps non-zero.

    The control for "is it the sparsity or which entries are kept?". The row maximum is always kept so
    a row is never empty. generator None draws from a fixed seed (RANDMASK_SEED) rather than the global
    RNG, so the same scores always get the same mask: a run is reproducible from its configuration and
    a resumed run gives the numbers of an uninterrupted one.
    """
    x = scores.float().movedim(dim, -1)
    keep = (entmax(x, alpha, dim=-1) > 0).sum(-1, keepdim=True)
    if generator is None:
        generator = torch.Generator(device=x.device).manual_seed(RANDMASK_SEED)
    noise = torch.rand(x.shape, generator=generator, device=x.device)
    noise.scatter_(-1, x.argmax(-1, keepdim=True), 2.0)  # the max ranks first
    rank = noise.argsort(-1, descending=True).argsort(-1)
    masked = x.masked_fill(rank >= keep, float("-inf"))
    return torch.softmax(masked, dim=-1).movedim(-1, dim).to(scores.dtype)
