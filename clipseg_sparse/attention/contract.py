"""The block contract: what the engine reads of a transformer block, written once as types.

Every family's image tower (`models/families/`) hands the engine blocks that meet `Block`: open_clip's
`ResidualAttentionBlock` as it is, a timm block through its family's adapter. The engine imports no
family; it asks the block through the helpers here (`grid_block`, `positive_attention`), so a new family
is checked against this module, not against `getattr` calls spread over the engine.

Members are read through `hasattr` / `getattr` rather than `isinstance(block, Block)`: from Python 3.12
a runtime protocol check reads members statically, and an `nn.Module` keeps its submodules (`ln_1`,
`mlp`, ...) out of the instance dictionary. `GridBlock` declares methods only, so a class check works on it.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol, runtime_checkable

import torch

Tensor = torch.Tensor


class Block(Protocol):
    """A pre-norm transformer block the engine can edit, read as open_clip's `ResidualAttentionBlock`:
    `x + ls_1(attn.out_proj(attention(ln_1(x))))`, then `+ ls_2(mlp(ln_2(.)))`, tokens B x N x C batch first.

    attn: `num_heads` and `out_proj` (the heads concatenated, B x N x C -> B x N x C); its q/k/v come from
    the packed `in_proj_weight` / `in_proj_bias` of an `nn.MultiheadAttention` (or of the one a
    `WrappedAttention` holds), unless the block is a `GridBlock`, which projects them itself.
    """

    ln_1: Callable[[Tensor], Tensor]
    attn: torch.nn.Module
    ls_1: Callable[[Tensor], Tensor]
    ln_2: Callable[[Tensor], Tensor]
    mlp: Callable[[Tensor], Tensor]
    ls_2: Callable[[Tensor], Tensor]


@runtime_checkable
class GridBlock(Protocol):
    """A `Block` that needs the patch grid (h, w) of its tokens, as rotary position embeddings do (timm
    towers, `models/families/timm_tower.py`): it projects its own q/k/v and runs its own forward.

    project_qkv(u, grid): q, k, v (B x H x N x d) of an ln_1 state u (B x N x C) whose last h*w tokens are
    the patches; any tokens before them are prefix tokens (the CLS, or CorrCLIP's copies of it: no RoPE).
    forward_grid(x, grid): the untouched block on tokens x (B x N x C).
    """

    def project_qkv(self, u: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]: ...

    def forward_grid(self, x: Tensor, grid: tuple[int, int]) -> Tensor: ...


@runtime_checkable
class WrappedAttention(Protocol):
    """What the engine needs of an attention module that wraps a block's own one (DnA's
    `DenoisingAttention`): the wrapped `nn.MultiheadAttention` and the branch it adds to an edited
    block's attention output. The engine asks for these attributes; it imports no wrapper."""

    positive: torch.nn.MultiheadAttention

    def negative_branch(self, query: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def is_block(module: object) -> bool:
    """Whether `module` has every member of `Block` (its attention's kind is not checked)."""
    return all(hasattr(module, name) for name in Block.__annotations__)


def grid_block(block: Block) -> GridBlock | None:
    """`block` when it projects its own q/k/v and runs given the patch grid (`GridBlock`); None for
    open_clip's blocks, whose q/k/v the engine projects from the packed `in_proj` weights."""
    return block if _is_grid_block(type(block)) else None


@functools.cache
def _is_grid_block(kind: type) -> bool:
    """Asked of the class, once: a GridBlock's methods are its class's, and the engine asks for every block
    it runs (a protocol `isinstance` costs about 8x a `getattr`)."""
    return issubclass(kind, GridBlock)


def positive_attention(attn: torch.nn.Module) -> torch.nn.Module:
    """The nn.MultiheadAttention holding a block's own q/k/v/out weights, whether or not a wrapper holds it."""
    return getattr(attn, "positive", attn)


def negative_branch(attn: torch.nn.Module) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    """The branch a `WrappedAttention` adds to an edited block's attention output (DnA), None without one."""
    return getattr(attn, "negative_branch", None)
