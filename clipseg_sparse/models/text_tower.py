"""Exact fast text encoding: run open_clip's text tower only as far as the prompts reach.

CLIP's text tower is causal: token i attends to tokens 0..i only, and the pooled feature is read at the
end-of-text token. The padding after it can therefore never change the pooled feature, and running the
tower on the first L tokens, with L the longest real prompt of the batch, gives open_clip's
`encode_text` exactly (the same arithmetic on fewer rows; differences are float rounding, ~1e-7).
Prompts are sorted by length so that each batch is tight; "a photo of a cat." is 7 tokens of 77.

The cut is taken only where it is exact (`cut_plan` says why not otherwise): a causal mask, pooling at
a position that depends on the prompt alone (`argmax` = CLIP's end-of-text token, `eos`, `first`), no
appended class token and no padding mask. Other towers (bidirectional, `last` pooling, CoCa's class
token, Hugging Face encoders) run at full length through open_clip's own `encode_text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..attention.precision import reduced_text_transformer

CUT_POOLS = ("argmax", "eos", "first")


@dataclass(frozen=True)
class CutPlan:
    """The parts of a text tower that the truncated forward needs (open_clip names)."""

    token_embedding: nn.Module
    positional_embedding: torch.Tensor  # context x width
    transformer: nn.Module
    attn_mask: torch.Tensor  # context x context additive causal mask
    ln_final: nn.Module
    text_projection: nn.Module | torch.Tensor | None
    pool_type: str
    eos_id: int | None


def _causal(mask: torch.Tensor | None, context: int) -> bool:
    """Whether `mask` is the additive causal mask (-inf above the diagonal, 0 elsewhere) of `context`."""
    if mask is None or tuple(mask.shape) != (context, context):
        return False
    expected = torch.full((context, context), float("-inf"), device=mask.device).triu_(1)
    return torch.equal(mask.float(), expected)


def cut_plan(model: nn.Module) -> CutPlan | None:
    """How to run `model`'s text tower truncated, or None where truncation would not be exact.

    model: an open_clip CLIP (text tower parts on the model) or CustomTextCLIP / TextTransformer
    (`model.text` or the tower itself).
    """
    from open_clip.transformer import TextTransformer

    tower = getattr(model, "text", model)
    if isinstance(tower, TextTransformer):
        if tower.cls_emb is not None or tower.use_pad_mask:
            return None
        parts = tower, tower.pool_type, tower.eos_id
    elif hasattr(model, "token_embedding") and hasattr(model, "text_pool_type"):  # open_clip.CLIP
        parts = model, model.text_pool_type, getattr(model, "text_eos_id", None)
    else:  # e.g. a Hugging Face text encoder
        return None
    owner, pool, eos = parts
    pos = owner.positional_embedding
    if pool not in CUT_POOLS or (pool == "eos" and eos is None) or not _causal(owner.attn_mask, pos.shape[0]):
        return None
    return CutPlan(owner.token_embedding, pos, owner.transformer, owner.attn_mask, owner.ln_final, owner.text_projection, pool, eos)


def pool_index(tokens: torch.Tensor, plan: CutPlan) -> torch.Tensor:
    """Position (B,) of each prompt's pooled token, by open_clip's `text_global_pool` rule."""
    if plan.pool_type == "argmax":
        return tokens.argmax(-1)
    if plan.pool_type == "eos":
        return (tokens == plan.eos_id).int().argmax(-1)
    return torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)


def encode_cut(plan: CutPlan, tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """open_clip's `encode_text` (unnormalised, B x D) on the first max(index) + 1 tokens only.

    tokens: B x context token ids; index: B pooled positions (`pool_index`). The positional embedding
    and the causal mask are cut to the same length as the tokens.
    """
    length = int(index.max()) + 1
    cast = plan.transformer.get_cast_dtype()
    x = plan.token_embedding(tokens[:, :length]).to(cast)
    x = x + plan.positional_embedding[:length].to(cast)
    fast = reduced_text_transformer(plan.transformer, x)  # bf16 / fp16 only; `plan` checked the mask is causal
    x = plan.transformer(x, attn_mask=plan.attn_mask[:length, :length]) if fast is None else fast
    x = plan.ln_final(x[torch.arange(x.shape[0], device=x.device), index])  # LayerNorm is per token
    proj = plan.text_projection
    if proj is None:
        return x
    return proj(x) if isinstance(proj, nn.Module) else x @ proj


@torch.inference_mode()
def encode_tokens(
    model: nn.Module, tokens: torch.Tensor, batch_size: int = 256, advance: Callable[[int], None] | None = None
) -> torch.Tensor:
    """Unnormalised text features (T x D, the model's dtype) of `tokens` (T x context), equal to
    `model.encode_text(tokens)`; truncated per batch where exact (see `cut_plan`), else full length.

    Prompts are grouped by the position of their pooled token, so each batch is cut to its own longest
    prompt. advance(n) is called after each batch of n prompts (progress bars).
    """
    plan = cut_plan(model)
    full = getattr(model, "encode_text", model)  # a CLIP model, or a bare text tower
    if plan is None:
        order = torch.arange(tokens.shape[0])
        index = None
    else:
        index = pool_index(tokens, plan)
        order = torch.argsort(index.cpu(), stable=True)
    feats = []
    for start in range(0, tokens.shape[0], batch_size):
        rows = order[start : start + batch_size].to(tokens.device)
        batch = tokens[rows]
        feats.append(full(batch) if plan is None else encode_cut(plan, batch, index[rows]))
        if advance is not None:
            advance(len(rows))
    if not feats:
        return torch.zeros(0, 0)
    out = torch.empty(tokens.shape[0], feats[0].shape[-1], dtype=feats[0].dtype, device=feats[0].device)
    out[order.to(out.device)] = torch.cat(feats)
    return out
