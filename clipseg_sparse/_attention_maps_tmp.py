"""TEMPORARY (not to land): stand-in for engine's attention_maps until it lands on main."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import edited_block_forward, gaussian_prior, resolve_spec
from .normalizers import Normalizer, normalize


@torch.inference_mode()
def attention_maps(clip, pixels: torch.Tensor, spec) -> torch.Tensor:
    spec = resolve_spec(spec)
    v = clip.visual
    ps = clip.patch_size
    B, _, H, W = pixels.shape
    grid = (H // ps, W // ps)
    blocks = v.transformer.resblocks
    x = v.conv1(pixels.to(device=clip.device, dtype=clip.dtype)).flatten(2).transpose(1, 2)
    cls = v.class_embedding.to(x.dtype).view(1, 1, -1).expand(B, -1, -1)
    x = torch.cat([cls, x], dim=1) + clip.positional_embedding(grid).to(x.dtype)
    x = v.ln_pre(x)
    n_plain = len(blocks) - spec.layers
    for blk in blocks[:n_plain]:
        x = blk(x)
    for blk in blocks[n_plain:-1]:
        x = edited_block_forward(blk, x, spec, grid)
    blk = blocks[-1]
    attn = blk.attn
    Bn, N, C = x.shape
    Hh = attn.num_heads
    d = C // Hh
    y = blk.ln_1(x)
    q, k, vv = F.linear(y, attn.in_proj_weight, attn.in_proj_bias).view(B, N, 3, Hh, d).permute(2, 0, 3, 1, 4)
    if spec.source == ("id",):
        return torch.eye(N).expand(B, Hh, N, N)
    scale = spec.temperature if spec.temperature is not None else d**-0.5
    prior = gaussian_prior(grid, spec.gauss_sigma, q.device, q.dtype) if spec.gauss_sigma else None
    proj = {"q": q, "k": k, "v": vv}
    out = 0
    for term in spec.source:
        s = proj[term[0]] @ proj[term[1]].transpose(-2, -1) * scale
        out = out + normalize(s if prior is None else s + prior, Normalizer.parse(spec.normalizer))
    return out
