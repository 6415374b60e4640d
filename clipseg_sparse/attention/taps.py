"""Taps: what a score term compares, and the block context they read.

A tap is registered by kind (`TAPS`, name -> `Tap`) and written `KIND`, `KIND@ARG` or `KIND:ARG` in a
term. A tap gives either features (a, b), compared by the term's metric into N x N scores, or an
already normalised N x N map (mixed after normalisation), or N x N scores mixed before the normalizer as
they are (`feedback`, ResCLIP's first-pass map, in feedback.py). This is the extension point for scores from
outside CLIP: register a kind (e.g. `ext`) whose `features` reads `BlockContext.pixels` or
`BlockContext.extra`.

Built in: `qk qq kk vv` (the edited block's projections, per head; `qq@L`: block L's own, from the hidden
state entering it, ITACLIP's intermediate self-self maps), `x@L` (CLIP's residual stream after
block L, 1-based, one map for all heads), `attn@A-B` (mean over blocks A..B of CLIP's own
softmax(q k^T / sqrt(d)) maps, per head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..registry import ENTRY_POINT_GROUP, Registry
from ..stages import Needs
from .contract import Block, grid_block, positive_attention
from .precision import reduced_block


Features = Callable[["BlockContext", str], "tuple[torch.Tensor, torch.Tensor]"]
Maps = Callable[["BlockContext", str], torch.Tensor]


@dataclass
class BlockContext:
    """What score terms may read while one edited block runs (tensors batch first).

    q, k, v: B x H x N x d of the edited block, N = the tokens attended (CLS + h*w patches, or the h*w
    patches alone when `offset` is 1, i.e. with `cls:C`). u: B x N x C, the ln_1 state q/k/v come from.
    hidden: block index (1-based) -> B x (1 + h*w) x C residual stream after that block (as the token
    hooks left it). maps: block index -> B x H x (1 + h*w) x (1 + h*w) CLIP's own attention there.
    pixels: the B x 3 x H x W input, for taps that run another backbone; extra: free for such taps.
    blocks: the tower's blocks (0-based), for a tap that reruns part of one on a kept hidden state (DiH-CLIP's
    `sha@L`).
    """

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    u: torch.Tensor | None = None
    grid: tuple[int, int] = (0, 0)
    offset: int = 0
    hidden: Mapping[int, torch.Tensor] = field(default_factory=dict)
    maps: Mapping[int, torch.Tensor] = field(default_factory=dict)
    pixels: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    blocks: Sequence[Block] = ()

    def hidden_state(self, layer: int) -> torch.Tensor:
        """B x N x C tokens after block `layer`, restricted to the attended tokens."""
        if layer not in self.hidden:
            raise UserValueError(f"x@{layer}: the hidden state after block {layer} was not kept (is block {layer} edited?)")
        return self.hidden[layer][:, self.offset :]


@dataclass(frozen=True)
class Tap:
    """features(ctx, arg) -> (a, b), each B x H' x N x d (H' = 1 or heads); or maps(ctx, arg) -> B x H' x N x N
    already normalised; or scores(ctx, arg) -> B x H' x N x N scores mixed before the normalizer as they are
    (no metric; ResCLIP's `feedback`). check(arg) raises UserValueError for a bad argument. hidden(arg) / blocks(arg): the
    hidden states / CLIP attention maps (1-based block indices) the tap reads, kept while CLIP runs. grid(arg,
    pixels, clip_grid): the token grid the tap's features live on for a crop of `pixels` (H, W) whose CLIP
    patch grid is `clip_grid` (None: CLIP's). needs(arg): what running it takes besides CLIP (`stages.Needs`:
    the external backbones it runs, whole-image features it reads), which a plan reads once per run.
    projections: True for the taps of the edited block's own q/k/v, which only its attention has (not the
    aggregations before and after it)."""

    features: Features | None = None
    maps: Maps | None = None
    scores: Maps | None = None
    check: Callable[[str], None] = lambda arg: None
    hidden: Callable[[str], set[int]] = lambda arg: set()
    blocks: Callable[[str], set[int]] = lambda arg: set()
    grid: Callable[[str, tuple[int, int], tuple[int, int]], tuple[int, int]] | None = None
    needs: Callable[[str], Needs] = lambda arg: Needs()
    projections: bool = False


class TapRef(NamedTuple):
    """A term's tap, parsed once: its registry kind and argument (`x@9` -> ("x", "9"))."""

    kind: str
    arg: str

    @property
    def tap(self) -> Tap:
        return TAPS.get(self.kind)


# Built here: the q/k/v pairs, x@L, attn@A-B; elsewhere: ResCLIP's feedback (an engine axis) and `ext:` (models).
TAPS: Registry[Tap] = Registry(
    "score tap", locations=("clipseg_sparse.attention.feedback", "clipseg_sparse.models.proxies"), group=ENTRY_POINT_GROUP
)


def tap_kind(tap: str) -> TapRef:
    """`x@9` -> ("x", "9"); `ext:dino` -> ("ext", "dino"); `kk` -> ("kk", "")."""
    for sep in "@:":
        if sep in tap:
            kind, _, arg = tap.partition(sep)
            return TapRef(kind, arg)
    return TapRef(tap, "")


def check_tap(tap: str) -> None:
    kind, arg = tap_kind(tap)
    if kind not in TAPS:
        raise UserValueError(f"unknown tap {tap!r}; taps: {', '.join(TAPS.help(n) for n in TAPS.names())}")
    TAPS.get(kind).check(arg)


def attention_grid(spec, pixels: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int]:
    """The token grid the edited attention lives on for an input of `pixels` (H, W): CLIP's patch grid
    `grid`, or the grid its taps bring (external backbones, `Tap.grid`); they must all agree."""
    grids = set()
    for term in spec.terms:
        tap, arg = term.ref.tap, term.ref.arg
        grids.add(tuple(tap.grid(arg, tuple(pixels), tuple(grid))) if tap.grid else tuple(grid))
    if len(grids) > 1:
        raise UserValueError(f"spec {spec} mixes terms on different token grids {sorted(grids)}; use taps of one grid")
    return grids.pop() if grids else tuple(grid)


def _no_arg(kind: str) -> Callable[[str], None]:
    def check(arg: str) -> None:
        if arg:
            raise UserValueError(f"tap {kind!r} takes no argument")

    return check


def _layer(arg: str) -> int:
    if not arg.isdigit() or int(arg) < 1:
        raise UserValueError(f"x@L needs a block number L >= 1 (got {arg!r})")
    return int(arg)


def _span(arg: str) -> range:
    first, dash, last = arg.partition("-")
    if not (dash and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise UserValueError(f"attn@A-B needs blocks 1 <= A <= B (got {arg!r})")
    return range(int(first), int(last) + 1)


def _own_block(arg: str) -> int:
    if not arg.isdigit() or int(arg) < 2:
        raise UserValueError(f"qq@L (and qk, kk, vv) needs a block number L >= 2, the block whose own projections of its input it reads (got {arg!r})")
    return int(arg)


def block_projections(ctx: "BlockContext", layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B x H x N x d) of block `layer` (1-based) on its own input, the hidden state after block
    `layer` - 1 over the attended tokens: what that block attends with. Computed once per block and batch."""
    key = ("qkv", layer)
    if key not in ctx.extra:
        block = ctx.blocks[layer - 1]
        ctx.extra[key] = block_qkv(block, block.ln_1(ctx.hidden_state(layer - 1)), ctx.grid)
    return ctx.extra[key]


def _pair_features(pair: str) -> Features:
    first, second = ("qkv".index(c) for c in pair)

    def features(ctx: BlockContext, arg: str) -> tuple[torch.Tensor, torch.Tensor]:
        qkv = (ctx.q, ctx.k, ctx.v) if not arg else block_projections(ctx, int(arg))
        return qkv[first], qkv[second]

    return features


for _pair in ("qk", "qq", "kk", "vv"):
    TAPS.register(
        _pair,
        Tap(
            features=_pair_features(_pair),
            check=lambda arg: _own_block(arg) and None if arg else None,
            hidden=lambda arg: {_own_block(arg) - 1} if arg else set(),
            projections=True,
        ),
        help=f"{_pair} (the edited block's; {_pair}@L: block L's own, from its input)",
    )
TAPS.register(
    "x",
    Tap(
        features=lambda ctx, arg: (ctx.hidden_state(int(arg))[:, None],) * 2,
        check=_layer,
        hidden=lambda arg: {int(arg)},
    ),
    help="x@L (hidden state after block L)",
)
TAPS.register(
    "attn",
    Tap(
        maps=lambda ctx, arg: torch.stack([ctx.maps[i] for i in _span(arg)]).mean(0)[..., ctx.offset :, ctx.offset :],
        check=lambda arg: _span(arg) and None,
        blocks=lambda arg: set(_span(arg)),
    ),
    help="attn@A-B (mean CLIP attention of blocks A..B)",
)


def block_qkv(block: Block, u: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B x H x N x d) of a block's ln_1 state u (B x N x C) on the patch grid `grid`.

    The one place the engine projects q/k/v: a `contract.GridBlock` (a timm tower's adapted block,
    `models/families/timm_tower.py`: separate or fused weights, q/k norms, RoPE where the model applies it)
    is asked for them; otherwise the fused `in_proj` of open_clip's nn.MultiheadAttention (of its positive
    branch when the block runs DnA). N may be the prefix tokens + h*w patches, or the h*w patches alone.
    """
    own = grid_block(block)
    if own is not None:
        return own.project_qkv(u, grid)
    attn = positive_attention(block.attn)
    B, N, C = u.shape
    H = attn.num_heads
    q, k, v = F.linear(u, attn.in_proj_weight, attn.in_proj_bias).view(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    return q, k, v


def run_block(block: Block, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """An unedited block on tokens x (B x N x C); a `contract.GridBlock` takes the grid (`forward_grid`, for RoPE).
    In reduced precision open_clip's blocks run through one fused attention call (`precision.sdpa_block`)."""
    own = grid_block(block)
    if own is not None:
        return own.forward_grid(x, grid)
    fast = reduced_block(block, x)
    return block(x) if fast is None else fast


def clip_attention(block: Block, x: torch.Tensor, grid: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """B x H x N x N softmax(q k^T / sqrt(d)) of an unmodified block on tokens x (B x N x C) on `grid`
    (of its positive branch when the block runs DnA)."""
    q, k, _ = block_qkv(block, block.ln_1(x), grid)
    return torch.softmax((q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5, dim=-1).to(x.dtype)
