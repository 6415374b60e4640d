"""PEARL (`pa`/`pakk` taps, presets `pearl`, `pearl-entmax`, post stage `tlp`) against transcriptions of
`PGSmall/PEARL@c26062b`: `pearl/attn.py` (`pa_attn`, `_polar_unitary_newton_schulz`), `clip/model.py`
(`custom_attn`, arch 'reduced') and `pearl/prop.py` (`TLP`), run on a tiny random CLIP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.methods import pearl
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.stages import parse_stage


# -- transcriptions -------------------------------------------------------------------------------------------
def ref_polar(M, iters=5, eps=1e-6):
    B, d, _ = M.shape
    I = torch.eye(d, dtype=M.dtype).unsqueeze(0).expand(B, -1, -1)
    A = M.transpose(1, 2) @ M
    Anorm = A.reshape(B, -1).norm(dim=1).clamp_min(eps).view(B, 1, 1)
    Y, Z = (A / Anorm) + eps * I, I.clone()
    for _ in range(iters):
        T = 0.5 * (3.0 * I - Z @ Y)
        Y = Y @ T
        Z = T @ Z
    return M @ (Z / torch.sqrt(Anorm))


def ref_pa_attn(q, k, v, alpha_kk=0.08):
    """`pa_attn(q, k, v, detach_cls=True, use_kk=True, alpha_kk, align_solver='polar', polar_iters=5)`, [B*H, T, d]."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    _, T, d = q32.shape
    scale = d**-0.5
    w = q32.norm(dim=2, keepdim=True)
    w[:, 0:1, :] = 0.0
    w = w / (w.sum(dim=1, keepdim=True) + 1e-6)
    q_c = q32 - (w * q32).sum(dim=1, keepdim=True)
    k_c = k32 - (w * k32).sum(dim=1, keepdim=True)
    R = ref_polar(torch.bmm(k_c.transpose(1, 2), q_c))
    logits = torch.bmm(q32 * scale, torch.bmm(k32, R).transpose(1, 2)) + alpha_kk * torch.bmm(k_c, k_c.transpose(1, 2)) * scale
    return torch.bmm(F.softmax(logits, dim=-1), v32)


def ref_pearl_features(clip, crop, alpha_kk=0.08):
    """PEARL's VisionTransformer.forward(return_all=True) with arch 'reduced': the last block = out_proj(pa_attn) on
    ln_1(x), no residual or FFN; ln_post, proj; patch tokens L2-normalised (forward_feature). h x w x D."""
    v = clip.visual
    gh, gw = crop.shape[-2] // 16, crop.shape[-1] // 16
    x = v.conv1(crop).flatten(2).transpose(1, 2)
    x = torch.cat([v.class_embedding.view(1, 1, -1), x], dim=1) + clip.positional_embedding((gh, gw))
    x = v.ln_pre(x)
    for blk in v.transformer.resblocks[:-1]:
        x = blk(x)
    blk = v.transformer.resblocks[-1]
    C, H = x.shape[-1], blk.attn.num_heads
    q, k, val = F.linear(blk.ln_1(x)[0], blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, dim=-1)
    split = lambda t: t.view(-1, H, C // H).transpose(0, 1)  # noqa: E731  [H, T, d]
    out = ref_pa_attn(split(q), split(k), split(val), alpha_kk).transpose(0, 1).reshape(-1, C)
    out = v.ln_post(blk.attn.out_proj(out)) @ v.proj
    return F.normalize(out[1:], dim=-1).view(gh, gw, -1)


class RefTLP:
    """`pearl/prop.py` TLP, its forward with B = 1 (the repeated-index einsum kept as published)."""

    def __init__(self, text, grid=80, eps=1e-6):
        self.eps, self.grid = eps, grid
        T = F.normalize(text.float(), dim=-1)
        S = torch.softmax(T @ T.t() / 0.5, dim=1)
        S = S + 10.0 * torch.eye(S.size(0))
        self.S = S / (S.sum(dim=1, keepdim=True) + eps)

    def __call__(self, image, logits):
        S, eps = self.S, self.eps
        B, C, H, W = logits.shape
        sh, sw = int(max(1, round(H / float(self.grid)))), int(max(1, round(W / float(self.grid))))
        if sh > 1 or sw > 1:
            img_s = F.avg_pool2d(image.float(), (sh, sw), (sh, sw), ceil_mode=False, count_include_pad=False)
            log_s = F.avg_pool2d(logits.float(), (sh, sw), (sh, sw), ceil_mode=False, count_include_pad=False)
        else:
            img_s, log_s = image.float(), logits.float()
        probs = torch.softmax(log_s, dim=1)
        conf = probs.max(dim=1, keepdim=True)[0]
        agree = (probs * torch.einsum("cc,bcij->bcij", S, probs)).sum(dim=1, keepdim=True).clamp(0.0, 1.0)
        Cw = (conf.clamp_min(0.05) ** 2) * (1.0 + agree)
        gray = 0.299 * img_s[:, 0:1] + 0.587 * img_s[:, 1:2] + 0.114 * img_s[:, 2:3]
        gx = torch.abs(gray[:, :, :, 1:] - gray[:, :, :, :-1])
        gy = torch.abs(gray[:, :, 1:, :] - gray[:, :, :-1, :])
        gx, gy = gx / (gx.mean() + eps), gy / (gy.mean() + eps)
        g_h = (probs[:, :, :, 1:] * torch.einsum("cc,bcij->bcij", S, probs[:, :, :, :-1])).sum(dim=1, keepdim=True)
        g_v = (probs[:, :, 1:, :] * torch.einsum("cc,bcij->bcij", S, probs[:, :, :-1, :])).sum(dim=1, keepdim=True)
        w_h = (torch.exp(-5.0 * gx) * (1.0 + g_h.clamp(0.0, 1.0))).clamp_(0.0, 1.0)
        w_v = (torch.exp(-5.0 * gy) * (1.0 + g_v.clamp(0.0, 1.0))).clamp_(0.0, 1.0)
        w_h = torch.cat([torch.ones_like(w_h[:, :, :, :1]), w_h], dim=3)
        w_v = torch.cat([torch.ones_like(w_v[:, :, :1, :]), w_v], dim=2)

        def lap(Fx):
            diff_h = Fx[:, :, :, 1:] - Fx[:, :, :, :-1]
            out = torch.zeros_like(Fx)
            out[:, :, :, 1:] += w_h[:, :, :, 1:] * diff_h
            out[:, :, :, :-1] -= w_h[:, :, :, 1:] * diff_h
            diff_v = Fx[:, :, 1:, :] - Fx[:, :, :-1, :]
            out[:, :, 1:, :] += w_v[:, :, 1:, :] * diff_v
            out[:, :, :-1, :] -= w_v[:, :, 1:, :] * diff_v
            return out

        A = lambda X: Cw * X + lap(X)  # noqa: E731
        Bt = Cw * log_s
        X = log_s.clone()
        R = Bt - A(X)
        P = R.clone()
        rsold = (R * R).sum(dim=(1, 2, 3), keepdim=True)
        for _ in range(25):
            AP = A(P)
            alpha = rsold / ((P * AP).sum(dim=(1, 2, 3), keepdim=True) + 1e-12)
            X = X + alpha * P
            R = R - alpha * AP
            rsnew = (R * R).sum(dim=(1, 2, 3), keepdim=True)
            P = R + rsnew / (rsold + 1e-12) * P
            rsold = rsnew
        if sh > 1 or sw > 1:
            X = F.interpolate(X, size=(H, W), mode="bilinear", align_corners=False)
        return X


def crop(seed=0, size=(48, 64)):
    return torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(seed))


# -- the tests -------------------------------------------------------------------------------------------------
def test_polar_factor_is_orthogonal_and_matches():
    M = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(1))
    R = pearl.polar_newton_schulz(M)
    torch.testing.assert_close(R, ref_polar(M))
    U, _, Vh = torch.linalg.svd(M)
    assert (R - U @ Vh).abs().max() < 0.5  # 5 steps approximate the exact factor (PEARL's 'svd' option)


@pytest.mark.parametrize("kk", [0.08, 0.3])
def test_pa_attention_matches_pa_attn(tiny_clip, kk):
    x = crop()
    ours = tiny_clip.encode_dense(x, AttentionSpec.parse(f"pa&pakk[scale:{kk}]/softmax/nores/noffn"))[0]
    torch.testing.assert_close(ours, ref_pearl_features(tiny_clip, x, kk), atol=2e-5, rtol=1e-4)
    other = tiny_clip.encode_dense(x, AttentionSpec.parse("qk/softmax/nores/noffn"))[0]
    assert (ours - other).abs().max() > 1e-3  # the rotation and the k-k term change the map


def test_pearl_entmax_tends_to_pearl(tiny_clip):
    x = crop(2)
    soft = tiny_clip.encode_dense(x, AttentionSpec.parse("pa&pakk[scale:0.08]/softmax/nores/noffn"))
    near = tiny_clip.encode_dense(x, AttentionSpec.parse("pa&pakk[scale:0.08]/entmax:1.0001/nores/noffn"))
    torch.testing.assert_close(near, soft, atol=2e-3, rtol=1e-3)
    sparse = tiny_clip.encode_dense(x, AttentionSpec.parse(str(AttentionSpec.parse("pearl-entmax")).replace("/hook:tlp:80", "")))
    assert (sparse - soft).abs().max() > 1e-3


@pytest.mark.parametrize("grid", [80, 8, 20])
def test_tlp_matches_published(grid):
    g = torch.Generator().manual_seed(3)
    text = torch.randn(5, 16, generator=g)
    cos = torch.randn(5, 37, 45, generator=g) * 0.1
    guide = torch.randn(3, 37, 45, generator=g)
    ours = pearl.tlp(cos, guide, text, grid)
    ref = RefTLP(text, grid)(guide[None], cos[None])[0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert (ours - cos).abs().max() > 1e-4


def test_tlp_reads_a_map_in_h_w_n_memory_as_a_contiguous_one():
    # the windows forward hands post stages N x H x W maps laid out H x W x N; pooling reads them in place
    g = torch.Generator().manual_seed(4)
    text = torch.randn(6, 16, generator=g)
    hwn = torch.randn(50, 70, 6, generator=g).permute(2, 0, 1)
    guide = torch.randn(3, 50, 70, generator=g)
    assert not hwn.is_contiguous()
    assert torch.equal(pearl.tlp(hwn, guide, text, 10), pearl.tlp(hwn.contiguous(), guide, text, 10))


def test_tlp_agreement_uses_the_diagonal_as_published():
    s = torch.tensor([[0.5, 0.5], [0.1, 0.9]])
    p = torch.tensor([0.3, 0.7]).view(1, 2, 1, 1)
    assert abs(float(pearl._diagonal_agree(s, p, p)) - (0.5 * 0.09 + 0.9 * 0.49)) < 1e-6
    assert torch.allclose(torch.einsum("cc,bcij->bcij", s, p), torch.diagonal(s).view(1, 2, 1, 1) * p)


def test_pearl_preset_runs_tlp_after_the_attention(tiny_clip):
    img = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    settings = InferenceSettings(resolution=0, window=32, stride=16)
    seg = Segmenter(tiny_clip, "cat,dog,grass", spec="pearl", settings=settings)
    plain = Segmenter(tiny_clip, "cat,dog,grass", spec="pa&pakk[scale:0.08]/softmax/nores/noffn", settings=settings)
    ours = seg.cosine(img).rows(0, 40)
    before = plain.cosine(img).rows(0, 40)
    from clipseg_sparse.segment.preprocess import to_pixels

    guide = to_pixels(img, tiny_clip, (40, 56))[0]
    torch.testing.assert_close(ours, RefTLP(seg.text, 80)(guide[None], before[None])[0], atol=1e-5, rtol=1e-4)
    again = Segmenter(tiny_clip, "cat,dog,grass", spec="pa&pakk[scale:0.08]/softmax/nores/noffn", settings=settings.replace(stages=("tlp",)))
    torch.testing.assert_close(again.cosine(img).rows(0, 40), ours)  # --stage tlp after any preset


def test_stage_and_protocol():
    assert parse_stage("tlp").name == "tlp:80" and parse_stage("tlp:224").kind == "post"
    for bad in ("tlp:0", "tlp:x"):
        with pytest.raises(ValueError, match="tlp"):
            parse_stage(bad)
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    p = PROTOCOLS.get("pearl")
    assert str(p.spec_for("cityscapes")).endswith("hook:tlp:224") and "scale:0.3" in str(p.spec_for("ade20k"))
    assert "entmax:1.5" in str(p.spec_for("ade20k", "pearl-entmax"))
    s = p.settings("voc21")
    assert (s.window, s.bg_threshold, s.resolution) == (0, 0.1, 336)
