"""CLIP Surgery (preset `clipsurgery`, stage `surgery`) against a transcription of
xmed-lab/CLIP_Surgery@d4696d4 on random-init ViT-B/16: the v-v path and the feature surgery."""

import torch
import torch.nn.functional as F

from conftest import structured_pixels, window_run
from clipseg_sparse.attention import AttentionSpec


def _surgery_reference(clip, pixels, depth=6):
    """xmed-lab/CLIP_Surgery@d4696d4 clip_surgery_model.py: Attention.forward (v-v) and the dual-path
    ResidualAttentionBlock.forward, written per head; output x with its CLS row from x_ori."""
    v = clip.visual
    x, _ = clip._embed(pixels)
    blocks = v.transformer.resblocks
    for blk in blocks[: len(blocks) - depth]:
        x = blk(x)
    x_new, x_ori = x.clone(), x
    for blk in blocks[len(blocks) - depth :]:
        u = blk.ln_1(x_ori)
        B, N, C = u.shape
        H = blk.attn.num_heads
        qkv = F.linear(u, blk.attn.in_proj_weight, blk.attn.in_proj_bias).reshape(B, N, 3, H, C // H)
        heads = []
        for b in range(B):
            for hd in range(H):
                val = qkv[b, :, 2, hd]
                heads.append(torch.softmax(val @ val.T * (C // H) ** -0.5, -1) @ val)
        out = torch.stack(heads).reshape(B, H, N, C // H).transpose(1, 2).reshape(B, N, C)
        x_new = x_new + blk.attn.out_proj(out)  # skip ffn for the new path
        x_ori = blk(x_ori)
    x_new[:, 0] = x_ori[:, 0]
    return F.normalize(v.ln_post(x_new) @ v.proj, dim=-1)


def _feature_surgery_reference(image_features, text_features):
    """clip.py clip_feature_surgery (redundant_feats None), batch 1: B x (1 + N) x D, T x D -> B x (1 + N) x T."""
    prob = (image_features[:, :1, :] @ text_features.t() * 2).softmax(-1)
    w = prob / prob.mean(-1, keepdim=True)
    b, n_t, n_i, c = image_features.shape[0], text_features.shape[0], image_features.shape[1], image_features.shape[2]
    feats = image_features.reshape(b, n_i, 1, c) * text_features.reshape(1, 1, n_t, c)
    feats *= w.reshape(1, 1, n_t, 1)
    feats = feats - feats.mean(2, keepdim=True)
    return feats.sum(-1)


def test_clipsurgery_matches_published_forward_and_feature_surgery(vit_b16):
    from clipseg_sparse.segment.windows import dense_cosine

    torch.manual_seed(9)
    pixels = structured_pixels(1, (160, 160))
    text = F.normalize(torch.randn(5, 512), dim=-1)
    with torch.no_grad():
        ref = _surgery_reference(vit_b16, pixels)  # 1 x (1 + N) x D, CLS first
        feats, cls = vit_b16.encode_dense(pixels, "clipsurgery", with_cls=True)
        assert torch.allclose(feats.reshape(1, -1, 512), ref[:, 1:], atol=2e-5)
        assert torch.allclose(cls, ref[:, 0], atol=2e-5)  # the original path's CLS: CLIP's image embedding
        surgery = _feature_surgery_reference(ref, text)[0, 1:].T.reshape(5, 10, 10)
        # one window covering the image, kept at the patch grid: the matcher applies the surgery there
        ours = dense_cosine(window_run(vit_b16, pixels, "clipsurgery", text, window=0), (160, 160)).rows(0, 160)
        plain = dense_cosine(window_run(vit_b16, pixels, AttentionSpec.parse("clipsurgery").replace(hooks=()), text, window=0), (160, 160)).rows(0, 160)
        up = F.interpolate(surgery[None], size=(160, 160), mode="bilinear", align_corners=False)[0]
    assert torch.allclose(ours, up, atol=5e-5)
    assert (plain - ours).abs().max() > 1e-2  # the surgery changes the map
