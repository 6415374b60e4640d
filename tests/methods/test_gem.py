"""GEM (preset `gem`) against a transcription of WalBouss/GEM@5fa677c on random-init ViT-B/16."""

import torch
import torch.nn.functional as F

from conftest import structured_pixels


def _gem_reference(clip, pixels, depth=6, iters=1):
    """WalBouss/GEM@5fa677c gem_utils.py SelfSelfAttention + GEMResidualBlock, per head in a plain loop."""
    v = clip.visual
    x, _ = clip._embed(pixels)
    blocks = v.transformer.resblocks
    for blk in blocks[: len(blocks) - depth]:
        x = blk(x)
    x_gem = x
    for blk in blocks[len(blocks) - depth :]:
        u = blk.ln_1(x)
        B, N, C = u.shape
        H = blk.attn.num_heads
        d = C // H
        qkv = F.linear(u, blk.attn.in_proj_weight, blk.attn.in_proj_bias).reshape(B, N, 3, H, d)
        inv_temp = torch.norm(u, dim=-1).mean(dim=-1) * d**-0.5  # B
        heads = []
        for b in range(B):
            for hd in range(H):
                q, k, val = qkv[b, :, 0, hd], qkv[b, :, 1, hd], qkv[b, :, 2, hd]
                acc = 0
                for z in (val, k, q):
                    for _ in range(iters):
                        z = F.normalize(z, dim=-1)
                        z = torch.softmax(z @ z.T * inv_temp[b], -1) @ z
                    z = F.normalize(z, dim=-1)
                    acc = acc + torch.softmax(z @ z.T * inv_temp[b], -1) @ val
                heads.append(acc / 3)
        out = torch.stack(heads).reshape(B, H, N, d).transpose(1, 2).reshape(B, N, C)
        x_gem = x_gem + blk.attn.out_proj(out)
        x = blk(x)
    return F.normalize(v.ln_post(x_gem[:, 1:]) @ v.proj, dim=-1)


def test_gem_matches_published_forward(vit_b16):
    torch.manual_seed(7)
    pixels = structured_pixels(1, (160, 192))
    with torch.no_grad():
        ours = vit_b16.encode_dense(pixels, "gem").reshape(1, -1, 512)
        assert torch.allclose(ours, _gem_reference(vit_b16, pixels), atol=2e-5)
