"""Proxy attention arithmetic (ProxyCLIP, CorrCLIP, Trident) against hand computations with plain loops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clipseg_sparse.proxy import (
    corrclip_attention,
    merge_regions,
    proxyclip_attention,
    reduced_block_output,
    region_support,
    region_vote,
    sam_filtered_attention,
    splice_windows,
    values_to_grid,
)


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _softmax(row):
    finite = [s for s in row if s != -math.inf]
    m = max(finite)
    e = [math.exp(s - m) if s != -math.inf else 0.0 for s in row]
    return [x / sum(e) for x in e]


def proxyclip_by_hand(feats: list[list[float]], beta=1.2, gamma=3.0):
    """ProxyCLIP custom_attn for one image: cosine, (S - beta mean) gamma, -inf below 0, softmax."""
    M = len(feats)
    S = [[_cos(feats[i], feats[j]) for j in range(M)] for i in range(M)]
    mean = sum(sum(r) for r in S) / (M * M)
    T = [[(S[i][j] - beta * mean) * gamma for j in range(M)] for i in range(M)]
    T = [[t if t >= 0 else -math.inf for t in r] for r in T]
    return [_softmax(r) for r in T]


def test_proxyclip_attention_equals_the_published_formula():
    torch.manual_seed(0)
    feats = torch.randn(1, 12, 5) + 0.5  # a positive offset so the mean is well above 0
    expected = torch.tensor(proxyclip_by_hand(feats[0].tolist()))
    got = proxyclip_attention(feats)[0]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert (got == 0).any(), "the positive support should cut some entries"


def test_entmax_to_one_with_positive_support_is_proxyclip():
    torch.manual_seed(1)
    feats = torch.randn(2, 20, 6) + 0.3
    soft = proxyclip_attention(feats)
    torch.testing.assert_close(proxyclip_attention(feats, normalizer="entmax:1"), soft)
    torch.testing.assert_close(proxyclip_attention(feats, normalizer="entmax:1.001"), soft, atol=2e-3, rtol=0)
    sparse = proxyclip_attention(feats, normalizer="entmax:1.5")
    assert ((sparse > 0) <= (soft > 0)).all(), "entmax keeps at most the positive support"
    torch.testing.assert_close(sparse.sum(-1), torch.ones(2, 20))


def test_uniform_image_keeps_the_diagonal_instead_of_nan():
    """Published code: every entry below beta * mean -> all -inf -> NaN; here identity rows."""
    feats = torch.ones(1, 5, 3) + 0.01 * torch.randn(1, 5, 3)
    torch.testing.assert_close(proxyclip_attention(feats)[0], torch.eye(5))


def test_window_batching_does_not_change_proxyclip():
    torch.manual_seed(2)
    feats = torch.randn(3, 16, 4) + torch.tensor([0.0, 0.5, 1.0]).view(3, 1, 1)
    batched = proxyclip_attention(feats)
    for i in range(3):
        torch.testing.assert_close(batched[i], proxyclip_attention(feats[i : i + 1])[0])
    # Trident's shared mean over all windows of an image is a different map
    assert not torch.allclose(proxyclip_attention(feats, mean_over="batch"), batched)


def _allowed_by_hand(S, regions):
    M = len(regions)
    mean = sum(sum(r) for r in S) / (M * M)
    return [
        [(regions[i] == regions[j] and regions[i] >= 0) or ((regions[i] < 0 or regions[j] < 0) and S[i][j] > mean) for j in range(M)]
        for i in range(M)
    ]


@pytest.mark.parametrize("normalizer", ["softmax", "entmax:1.5", "sparsemax"])
def test_region_restricted_attention_never_leaves_the_allowed_set(normalizer):
    torch.manual_seed(3)
    q, k = torch.randn(2, 30, 8), torch.randn(2, 30, 8)
    regions = torch.randint(-1, 4, (2, 30))
    attn = corrclip_attention(q, k, regions, normalizer=normalizer)
    for b in range(2):
        f = (q[b] + k[b]).tolist()
        S = [[_cos(f[i], f[j]) for j in range(30)] for i in range(30)]
        allowed = torch.tensor(_allowed_by_hand(S, regions[b].tolist()))
        assert torch.equal(region_support(torch.tensor(S)[None], regions[b : b + 1])[0], allowed)
        assert attn[b][~allowed].abs().max() == 0
        torch.testing.assert_close(attn[b].sum(-1), torch.ones(30))
        if normalizer == "softmax":  # softmax(4 S) on the allowed entries, by hand
            expected = [_softmax([4 * S[i][j] if allowed[i][j] else -math.inf for j in range(30)]) for i in range(30)]
            torch.testing.assert_close(attn[b], torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_reduced_block_output_by_hand():
    from open_clip.transformer import ResidualAttentionBlock

    torch.manual_seed(4)
    C, heads, clip_grid, proxy_grid = 16, 2, (2, 3), (4, 6)
    block = ResidualAttentionBlock(C, heads, batch_first=True).eval()
    x = torch.randn(1, 1 + 6, C)
    attn = torch.softmax(torch.randn(1, 24, 24), -1)
    # by hand: v = ln_1(x) W_v + b_v; patches only; bilinear to the proxy grid; A v; W_o
    y = F.layer_norm(x, (C,), block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
    v = y @ block.attn.in_proj_weight[2 * C :].T + block.attn.in_proj_bias[2 * C :]
    v = v[0, 1:].T.reshape(1, C, *clip_grid)
    v = F.interpolate(v, size=proxy_grid, mode="bilinear", align_corners=False).reshape(C, 24).T
    expected = (attn[0] @ v) @ block.attn.out_proj.weight.T + block.attn.out_proj.bias
    with torch.no_grad():
        got = reduced_block_output(block, x, attn, clip_grid, proxy_grid)
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=1e-5)


def test_values_to_grid_keeps_constants_and_identity():
    v = torch.full((1, 2, 6, 3), 2.5)
    torch.testing.assert_close(values_to_grid(v, (2, 3), (5, 7)), torch.full((1, 2, 35, 3), 2.5))
    assert values_to_grid(v, (2, 3), (2, 3)) is v


def test_sam_filtered_attention_by_hand():
    torch.manual_seed(5)
    B, H, N, d = 1, 2, 7, 4
    attn = torch.softmax(torch.randn(B, H, N, N), -1)
    v = torch.randn(B, H, N, d)
    for cos_fac, neg in [(1.2, True), (0.0, True), (3.0, False)]:
        cos = [[[_cos(v[0, h, i].tolist(), v[0, h, j].tolist()) for j in range(N)] for i in range(N)] for h in range(H)]
        expected = []
        for i in range(N):
            thr = min(0.9, cos_fac * sum(cos[h][i][j] for h in range(H) for j in range(N)) / (H * N))
            if not neg and thr < 0:
                thr = 0.6
            row = [sum(attn[0, h, i, j].item() * (cos[h][i][j] > thr) for h in range(H)) / H for j in range(N)]
            expected.append([r / sum(row) for r in row])
        got = sam_filtered_attention(attn, v, cos_fac, neg)[0]
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_splice_windows_averages_overlaps():
    feats = torch.stack([torch.full((2, 2, 1), 1.0), torch.full((2, 2, 1), 3.0)])
    out = splice_windows(feats, [(0, 0), (0, 1)], (2, 3))[..., 0]
    assert out.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    with pytest.raises(ValueError, match="cover"):
        splice_windows(feats, [(0, 0), (0, 0)], (2, 3))


def test_merge_regions_links_similar_regions():
    regions = torch.tensor([0, 0, 1, 1, 2, 2, -1, 5])
    base = torch.tensor([[1.0, 0.0], [1.0, 0.05], [0.0, 1.0], [9.0, 9.0]])
    feats = torch.stack([base[0], base[0], base[1], base[1], base[2], base[2], base[3], base[0]])
    merged = merge_regions(regions, feats, eps=0.2)
    # regions 0, 1 and 5 have (almost) the same mean feature: one cluster; 2 stays apart; -1 unchanged
    assert merged[0] == merged[2] == merged[7] and merged[4] != merged[0] and merged[6] == -1
    assert sorted(set(merged[merged >= 0].tolist())) == [0, 1]


def test_region_vote_takes_the_mode_inside_each_region():
    labels = torch.tensor([[1, 1, 2], [3, 2, 2], [0, 0, 4]])
    regions = torch.tensor([[0, 0, 0], [1, 1, 1], [-1, -1, 2]])
    assert region_vote(labels, regions).tolist() == [[1, 1, 1], [2, 2, 2], [0, 0, 4]]
