"""Denoising Attention (DnA, Campos et al., ECCV 2026): the attention module with a trained negative branch.

Per head h, with S+ = Q+ K^T / sqrt(d_h) and S- = Q- K^T / sqrt(d_h) on shared keys:

    out_h = softmax(S+) V+  + sign * alpha_h * softmin(S-) V-        softmin(z) = softmax(-z)

then the heads are concatenated and go through the block's own output projection. Q+, K, V+ and the output
projection are the block's own (`nn.MultiheadAttention` weights, frozen when converted); Q-, V- (with biases)
and the per-head alpha are new. Published variants (research/dna.md section 1.1):

- `sign=+1`: rjccv/DnA `vit/dna_models.py`, the module `main.py` registers (`F.softmin`, "+").
- `sign=-1`: the duplicate `vit/dna.py` and VisCoP's cross-attention (`pos - alpha * neg`).
  The two are the same family (V- is free and absorbs the sign) but not the same function for equal weights.
- `shared_values=True`: the ablation `DenoisingAttentionSharedValues`, one V:
  (softmax(S+) - alpha * softmin(S-)) V, i.e. sign -1 by default and no V- projection.
- `negative="entmax:ALPHA"` (this project): the negative map is alpha-entmax over -S-, a sparse softmin that
  puts weight only on the least similar keys.

No normalisation is added after attention, as in the published code. Attention dropout is not used
(the published models are trained with attn_drop 0; dropout is a training-recipe choice left out here).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserValueError
from ..attention.normalizers import Normalizer, normalize

PUBLISHED_SIGN = {False: 1, True: -1}  # shared_values -> sign of the published variant (dna_models.py / dna.py)


class DenoisingAttention(nn.Module):
    """Drop-in for `nn.MultiheadAttention` (batch-first or not) with DnA's negative branch.

    positive: the attention whose q/k/v/out projections form the positive branch (an open_clip block's
        `attn`); a new `nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)` when None (plain ViT).
    sign: +1 or -1 (see the module docstring); None = the published sign of the variant.
    negative: normalizer of the negative map over -S-: `softmax` (softmin, published) or `entmax:ALPHA` /
        `sparsemax` (sparse softmin).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        positive: nn.MultiheadAttention | None = None,
        sign: int | None = None,
        negative: str = "softmax",
        shared_values: bool = False,
        alpha_init: float = 0.5,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        positive = positive if positive is not None else nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        if positive.embed_dim != embed_dim or positive.num_heads != num_heads or positive.in_proj_weight is None:
            raise ValueError("positive attention must be a packed nn.MultiheadAttention of the same width and heads")
        sign = PUBLISHED_SIGN[shared_values] if sign is None else sign
        if sign not in (1, -1):
            raise UserValueError(f"sign must be +1 or -1 (got {sign})")
        norm = Normalizer.parse(negative)
        if norm.kind == "randmask":
            raise UserValueError("the negative normalizer must be softmax, entmax:ALPHA or sparsemax")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.batch_first = positive.batch_first
        self.positive = positive
        self.sign = sign
        self.negative = str(norm)
        self.shared_values = shared_values
        factory = dict(device=positive.in_proj_weight.device, dtype=positive.in_proj_weight.dtype)
        self.q_neg = nn.Linear(embed_dim, embed_dim, **factory)
        self.v_neg = None if shared_values else nn.Linear(embed_dim, embed_dim, **factory)
        self.alpha = nn.Parameter(torch.full((num_heads,), float(alpha_init), **factory))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, sign={self.sign:+d}, negative={self.negative}, shared_values={self.shared_values}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, None]:
        """(output, None) like `nn.MultiheadAttention(..., need_weights=False)`.

        query/key/value: B x N x C (L x B x C when not batch-first); key and value default to query.
        attn_mask: N x N or (B*H) x N x N, additive float or boolean (True = not allowed), applied to both
        branches' logits after the negation, so masked keys get no weight in either map.
        """
        if need_weights:
            raise ValueError("DenoisingAttention does not return attention weights")
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        mask = _additive_mask(attn_mask, key_padding_mask, query.shape[0], self.num_heads, query)
        out = self.heads_output(query, key, value, mask)
        out = self.positive.out_proj(out)
        return (out if self.batch_first else out.transpose(0, 1)), None

    def heads_output(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated head outputs before the output projection, B x N x C (batch first); mask: additive,
        broadcastable to B x H x N x M."""
        B, N, C = query.shape
        W, b = self.positive.in_proj_weight, self.positive.in_proj_bias
        wq, wk, wv = W.chunk(3)
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)

        heads = self._heads
        q, k, v = heads(F.linear(query, wq, bq)), heads(F.linear(key, wk, bk)), heads(F.linear(value, wv, bv))
        pos = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = pos + self.negative_branch(query, k, v, value, mask)
        return out.transpose(1, 2).reshape(B, N, C)

    def negative_branch(
        self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, value: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """sign * alpha_h * normalize(-S-) V-, B x H x N x d, from the (normalised) query tokens B x N x C and
        the positive branch's keys and values k, v (B x H x M x d); value: the value tokens (default query).
        This is what an attention-spec block adds to its own positive attention (`dna:PATH`)."""
        v_neg = v if self.v_neg is None else self._heads(self.v_neg(query if value is None else value))
        return self.negative_output(self._heads(self.q_neg(query)), k, v_neg, mask)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """B x M x C -> B x H x M x d."""
        return t.view(t.shape[0], t.shape[1], self.num_heads, -1).transpose(1, 2)

    def negative_output(self, q_neg: torch.Tensor, k: torch.Tensor, v_neg: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """sign * alpha_h * normalize(-S-) V-, B x H x N x d; q_neg, k, v_neg: B x H x N x d (heads split)."""
        scores = -(q_neg @ k.transpose(-2, -1)) * q_neg.shape[-1] ** -0.5
        if mask is not None:
            scores = scores + mask
        weights = normalize(scores, self.negative)
        return (self.sign * self.alpha).view(1, -1, 1, 1).to(v_neg.dtype) * (weights @ v_neg)

    def negative_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters DnA adds to the positive attention (what training updates and an adapter holds)."""
        return {n: p for n, p in self.named_parameters() if not n.startswith("positive.")}


def _additive_mask(
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int, heads: int, like: torch.Tensor
) -> torch.Tensor | None:
    """nn.MultiheadAttention's masks (N x M or (B*H) x N x M; B x M padding) as one additive float mask that
    broadcasts against B x H x N x M logits; boolean True = not allowed."""

    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=like.dtype, device=like.device).masked_fill(m, float("-inf"))
        return m.to(like.dtype)

    mask = None
    if attn_mask is not None:
        mask = additive(attn_mask)
        mask = mask.view(batch, heads, *mask.shape[-2:]) if mask.dim() == 3 else mask
    if key_padding_mask is not None:
        pad = additive(key_padding_mask)[:, None, None, :]
        mask = pad if mask is None else mask + pad
    return mask
