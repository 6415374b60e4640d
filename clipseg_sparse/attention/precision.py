"""Reduced precision (bf16 / fp16): which parts run in the low dtype and which stay in fp32.

With `load_clip(..., precision="bf16")` the weights are cast and every matrix product of the trunk runs
in bf16 (on CPUs with AMX-BF16, oneDNN's AMX kernels; on GPUs, tensor cores). What accuracy needs stays
in fp32: the edited block's attention scores, their normalizer (softmax or the entmax threshold and
probabilities), the final LayerNorm and projection, the cosine with the text and the logits. The
probabilities are rounded to the values' dtype only for their product with the values.

fp32 models never take these paths: every function here is the identity (or the model's own module)
on fp32 tensors, so fp32 results stay bit for bit what they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCED = (torch.bfloat16, torch.float16)


def is_reduced(t: torch.Tensor) -> bool:
    return t.dtype in REDUCED


def like(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention weights (fp32 in reduced precision) in the dtype of the values they multiply."""
    return weights if weights.dtype == values.dtype else weights.to(values.dtype)


def _fast_block(block: torch.nn.Module) -> bool:
    """Whether `block` is open_clip's plain ResidualAttentionBlock (self-attention through an
    nn.MultiheadAttention with fused q/k/v weights, batch first), which `sdpa_block` reproduces."""
    attn = getattr(block, "attn", None)
    return (
        type(block).__name__ == "ResidualAttentionBlock"
        and type(attn) is torch.nn.MultiheadAttention
        and attn.batch_first
        and attn.in_proj_weight is not None
        and not hasattr(block, "ln_1_kv")
        and all(hasattr(block, name) for name in ("ln_1", "ln_2", "mlp", "ls_1", "ls_2"))
    )


def sdpa_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """open_clip's ResidualAttentionBlock.forward on x (B x N x C) with the attention written out as
    one fused `scaled_dot_product_attention` call (the same arithmetic: ln_1, in_proj, softmax(q k^T /
    sqrt(d)) v, out_proj, residual, ln_2, MLP, residual). nn.MultiheadAttention's inference fast path
    runs an explicit product, softmax and product in bf16 on CPU; SDPA's fused kernel is faster there."""
    attn = block.attn
    B, N, C = x.shape
    H = attn.num_heads
    q, k, v = F.linear(block.ln_1(x), attn.in_proj_weight, attn.in_proj_bias).view(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v)
    x = x + block.ls_1(attn.out_proj(out.transpose(1, 2).reshape(B, N, C)))
    return x + block.ls_2(block.mlp(block.ln_2(x)))


def reduced_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`sdpa_block(block, x)` for reduced-precision tokens on a plain open_clip block; None otherwise
    (fp32, timm towers, DnA wrappers: the caller runs the block itself)."""
    if is_reduced(x) and _fast_block(block):
        return sdpa_block(block, x)
    return None


def fp32_layer_norm(module: torch.nn.Module):
    """A function applying LayerNorm `module` in fp32 (its parameters upcast), output fp32: the final
    LayerNorm of a reduced-precision model. Other modules run as they are, output upcast."""
    if isinstance(module, torch.nn.LayerNorm):
        weight = None if module.weight is None else module.weight.float()
        bias = None if module.bias is None else module.bias.float()
        return lambda x: F.layer_norm(x.float(), module.normalized_shape, weight, bias, module.eps)
    return lambda x: module(x).float()
