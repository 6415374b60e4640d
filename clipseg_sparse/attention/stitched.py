"""Image-wide attention over stitched windows, computed a block of rows at a time (OV-Stitcher's axis).

With the `stitch:M` option the windows of an image are no longer independent: their tokens (or q, k, v)
are placed on one image-wide grid, overlaps averaged (`methods/ovstitcher.py`), and some attentions run over
that whole grid. The image-wide N x N map is large (448 x 600 on DINO's 8-pixel grid: 4,200 tokens; a
Cityscapes 560 x 1120 image: 9,800), so `blocked_attention` normalises and applies it a block of rows at a
time: every normalizer here is row-wise (softmax, entmax, sparsemax), so each output row equals the same
row of the full computation and no N x N tensor is ever made. `global_attention` is the per-head
`normalize(scale q k^T) v` in that form. M: the multiple every window is zero-padded to (centred), 56 in
OV-Stitcher.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import UserValueError
from ..stages import Needs
from .normalizers import Normalizer, normalize
from .spec import AttentionSpec, register_option

#: elements of one block of attention rows (all heads): 2^24 fp32 = 64 MiB
BLOCK_ELEMENTS = 1 << 24


def block_rows(n_keys: int, heads: int = 1, budget: int = BLOCK_ELEMENTS) -> int:
    """Rows per block so that heads x rows x n_keys stays within `budget` (at least one row)."""
    return max(1, budget // max(heads * n_keys, 1))


def blocked_attention(
    scores: Callable[[int, int], torch.Tensor],
    v: torch.Tensor,
    normalizer: str | Normalizer = "softmax",
    rows: int | None = None,
) -> torch.Tensor:
    """normalize(S) @ v without the whole S: scores(r0, r1) gives rows r0..r1 of S (... x (r1 - r0) x N,
    -inf where excluded), v is ... x N x d; returns ... x N x d. Each block of rows is normalised along
    the keys and multiplied by v before the next is made, so peak memory is one block."""
    n = v.shape[-2]
    step = rows or block_rows(n, v[..., 0, 0].numel())
    out = v.new_empty(*v.shape[:-2], n, v.shape[-1])
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        out[..., r0:r1, :] = normalize(scores(r0, r1), normalizer).to(v.dtype) @ v
    return out


def global_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, normalizer: str | Normalizer = "softmax", rows: int | None = None
) -> torch.Tensor:
    """normalize(scale q k^T) v per head (q, k, v: ... x N x d), a block of rows at a time."""
    kt = k.transpose(-2, -1)
    return blocked_attention(lambda r0, r1: (q[..., r0:r1, :] @ kt) * scale, v, normalizer, rows)


def stitch_multiple(spec: AttentionSpec) -> int | None:
    """M of `stitch:M` (windows zero-padded, centred, to a multiple of M), or None: windows run alone."""
    arg = spec.extra("stitch")
    return None if arg is None else int(arg)


def _check_stitch(arg: str) -> str:
    if not arg.isdigit() or int(arg) < 1:
        raise UserValueError(f"stitch:{arg}: give the window padding multiple, a positive integer (OV-Stitcher: stitch:56)")
    return str(int(arg))


register_option(
    "stitch",
    _check_stitch,
    help="stitch:M (OV-Stitcher: windows zero-padded centred to a multiple of M, stitched onto the image grid; the "
    "proxy's last block, the in: blocks and the region-scoped last-block map run image-wide, a block of rows at a time)",
    needs=lambda arg: Needs(forward=(("stitched", f"stitch:{arg}"),)),
)
