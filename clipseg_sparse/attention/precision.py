"""Reduced precision (bf16 / fp16): which parts run in the low dtype and which stay in fp32.

With `load_clip(..., precision="bf16")` the weights are cast and every matrix product of the trunk runs
in bf16 (oneDNN's AMX or AVX512-BF16 kernels on CPUs; tensor cores on GPUs). What accuracy needs stays
in fp32: the edited block's attention scores, their normalizer (softmax or the entmax threshold and
probabilities), the final LayerNorm and projection, the cosine with the text and the logits. The
probabilities are rounded to the values' dtype only for their product with the values.

fp32 models never take these paths: every function here is the identity (or the model's own module)
on fp32 tensors, so fp32 results stay bit for bit what they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import is_block

REDUCED = (torch.bfloat16, torch.float16)


def is_reduced(t: torch.Tensor) -> bool:
    return t.dtype in REDUCED


def like(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention weights (fp32 in reduced precision) in the dtype of the values they multiply."""
    return weights if weights.dtype == values.dtype else weights.to(values.dtype)


def _fast_block(block: torch.nn.Module) -> bool:
    """Whether `block` is open_clip's plain ResidualAttentionBlock (a `contract.Block` whose self-attention
    is an nn.MultiheadAttention with fused q/k/v weights, batch first), which `sdpa_block` reproduces."""
    if type(block).__name__ != "ResidualAttentionBlock" or not is_block(block) or hasattr(block, "ln_1_kv"):
        return False
    attn = block.attn
    return type(attn) is torch.nn.MultiheadAttention and attn.batch_first and attn.in_proj_weight is not None


def explicit_attention_is_faster(device: torch.device) -> bool:
    """Whether `attend` writes reduced-precision attention out (product, softmax, product) rather than
    calling the fused kernel: on CPUs without AMX tiles. There torch's fused CPU kernel runs its
    small blocked products no faster in bf16 than in fp32 (ViT-B/16 at 448 px, 12 heads x 785 tokens:
    12.2 ms a block in bf16, 12.9 ms in fp32, on AVX512-BF16), while two large bf16 products and a
    softmax take 5.7 ms; with AMX tiles the fused kernel's AMX path was the faster one
    (benchmarks/README.md)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return device.type == "cpu" and not amx()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for reduced-precision q, k, v (B x H x N x d), by the faster path on
    this machine (`explicit_attention_is_faster`); `causal`: token i attends to tokens 0..i only (CLIP's
    text tower). The explicit path scales q first (exact for head widths 4^k: 1/sqrt(64) = 1/8), so the
    scores are rounded to bf16 once; its softmax computes in fp32 before rounding the probabilities,
    which the fused kernel also rounds for their product with v. (baddbmm's alpha would scale inside the
    product, but ran 3.6x slower than bmm here.)"""
    if not explicit_attention_is_faster(q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    B, H, N, d = q.shape
    q3, k3 = q.reshape(B * H, N, d), k.reshape(B * H, -1, d)
    scores = torch.bmm(q3 * d**-0.5, k3.transpose(1, 2))
    if causal:
        scores.masked_fill_(torch.ones(N, k3.shape[1], dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    return (torch.softmax(scores, -1) @ v.reshape(B * H, -1, d)).view(B, H, N, d)


def sdpa_block(block: torch.nn.Module, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """open_clip's ResidualAttentionBlock.forward on x (B x N x C) with the attention written as one
    `attend` call (the same arithmetic: ln_1, in_proj, softmax(q k^T / sqrt(d)) v, out_proj, residual,
    ln_2, MLP, residual); `causal`: with CLIP's causal text mask. nn.MultiheadAttention computes its scores
    in a layout that was slower in bf16 on both CPUs measured, and with a mask it transposes its inputs
    and copies them for every projection (benchmarks/README.md)."""
    attn = block.attn
    B, N, C = x.shape
    H = attn.num_heads
    q, k, v = F.linear(block.ln_1(x), attn.in_proj_weight, attn.in_proj_bias).view(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    out = attend(q, k, v, causal)
    x = x + block.ls_1(attn.out_proj(out.transpose(1, 2).reshape(B, N, C)))
    return x + block.ls_2(block.mlp(block.ln_2(x)))


def reduced_text_transformer(transformer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """open_clip's text Transformer on reduced-precision tokens x (B x L x C) with its causal mask, block by
    block through `sdpa_block`; None where that does not apply (fp32, other blocks, sequence-first
    towers: the caller runs the tower itself, so fp32 text stays open_clip's own arithmetic)."""
    blocks = getattr(transformer, "resblocks", ())
    if not (is_reduced(x) and getattr(transformer, "batch_first", False) and blocks and all(_fast_block(b) for b in blocks)):
        return None
    for block in blocks:
        x = sdpa_block(block, x, causal=True)
    return x


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
