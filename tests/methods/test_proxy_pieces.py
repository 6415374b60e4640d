"""CorrCLIP and Trident attention pieces against hand computations with plain loops (ProxyCLIP runs
through the engine: tests/methods/test_proxyclip.py)."""

from __future__ import annotations

import math

import pytest
import torch

from clipseg_sparse.attention.grid import merge_regions, region_support, values_to_grid
from clipseg_sparse.methods.corrclip import corrclip_attention, region_vote
from clipseg_sparse.methods.trident import sam_filtered_attention
from clipseg_sparse.methods.trident import splice_windows


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _softmax(row):
    finite = [s for s in row if s != -math.inf]
    m = max(finite)
    e = [math.exp(s - m) if s != -math.inf else 0.0 for s in row]
    return [x / sum(e) for x in e]


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
