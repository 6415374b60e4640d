"""Converting the attention of chosen ViT blocks to DnA, warm-started so the function is (almost) unchanged.

Warm start (rjccv/DnA TimeSformer `_convert_vit_qkv_to_dna` and VisCoP's `--warm_init_value_im`, research/dna.md
section 1.2): Q- = eps Q+ and V- = -eps V+, weights and biases alike, alpha = 0.5 per head. Then S- is eps times
S+, the softmin is nearly uniform, and the negative branch adds about sign * alpha * (-eps) * mean_j V+_j: the
output moves by O(eps). The shared-value ablation has no V- to scale, so here (this project's rule, not a
published one) eps goes into alpha instead (alpha = 0.5 eps), which makes that branch O(eps) as well.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from ..errors import UserValueError
from .module import DenoisingAttention

WARM_START_EPS = 1e-4
ALPHA_INIT = 0.5


def vision_blocks(model: object) -> nn.ModuleList:
    """The residual blocks of a CLIP image tower: accepts a DenseCLIP, an open_clip CLIP or its `visual`."""
    for path in ("model.visual.transformer.resblocks", "visual.transformer.resblocks", "transformer.resblocks"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise TypeError(f"{type(model).__name__} has no ViT image tower (visual.transformer.resblocks)")


def block_indices(num_blocks: int, blocks: int | Sequence[int]) -> list[int]:
    """An int N = the last N blocks; a sequence = those indices (negative ones count from the end). Sorted, unique."""
    if isinstance(blocks, int):
        if not 1 <= blocks <= num_blocks:
            raise UserValueError(f"cannot convert the last {blocks} blocks: the model has {num_blocks}")
        return list(range(num_blocks - blocks, num_blocks))
    out = sorted({b + num_blocks if b < 0 else b for b in blocks})
    if not out or out[0] < 0 or out[-1] >= num_blocks:
        raise UserValueError(f"block indices {list(blocks)} out of range for a model with {num_blocks} blocks")
    return out


@torch.no_grad()
def warm_start(dna: DenoisingAttention, eps: float = WARM_START_EPS, alpha: float = ALPHA_INIT) -> None:
    """Q- = eps Q+, V- = -eps V+ (biases too), alpha = `alpha` (times eps for the shared-value ablation)."""
    C = dna.embed_dim
    W, b = dna.positive.in_proj_weight, dna.positive.in_proj_bias
    dna.q_neg.weight.copy_(eps * W[:C])
    dna.q_neg.bias.copy_(eps * b[:C] if b is not None else torch.zeros_like(dna.q_neg.bias))
    if dna.v_neg is not None:
        dna.v_neg.weight.copy_(-eps * W[2 * C :])
        dna.v_neg.bias.copy_(-eps * b[2 * C :] if b is not None else torch.zeros_like(dna.v_neg.bias))
        dna.alpha.fill_(alpha)
    else:
        dna.alpha.fill_(alpha * eps)


def convert_to_dna(
    clip: object,
    blocks: int | Sequence[int] = 1,
    eps: float = WARM_START_EPS,
    *,
    negative: str = "softmax",
    sign: int | None = None,
    shared_values: bool = False,
) -> dict[int, DenoisingAttention]:
    """Replace `blocks.attn` of the chosen image-tower blocks by warm-started DenoisingAttention, in place.

    clip: a DenseCLIP, an open_clip CLIP or its VisionTransformer. blocks: last N, or indices.
    Freezes every parameter of the model, then makes only the new ones (Q-, V-, alpha) trainable.
    Returns {block index: module}. Blocks must hold open_clip's nn.MultiheadAttention (not yet converted).
    """
    resblocks = vision_blocks(clip)
    chosen = block_indices(len(resblocks), blocks)
    root = getattr(clip, "model", clip)
    root.requires_grad_(False)
    converted = {}
    for i in chosen:
        attn = resblocks[i].attn
        if not isinstance(attn, nn.MultiheadAttention):
            raise TypeError(f"block {i}: attention is {type(attn).__name__}, expected nn.MultiheadAttention (already converted?)")
        dna = DenoisingAttention(attn.embed_dim, attn.num_heads, positive=attn, negative=negative, sign=sign, shared_values=shared_values)
        warm_start(dna, eps)
        resblocks[i].attn = dna
        for p in dna.negative_parameters().values():
            p.requires_grad_(True)
        converted[i] = dna
    return converted


def dna_modules(clip: object) -> dict[int, DenoisingAttention]:
    """{block index: DenoisingAttention} of a converted image tower."""
    return {i: b.attn for i, b in enumerate(vision_blocks(clip)) if isinstance(b.attn, DenoisingAttention)}
