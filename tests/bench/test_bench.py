"""The benchmark module on tiny shapes: well-formed rows, every variant present (no timing assertions)."""

import pytest
from typer.testing import CliRunner

from clipseg_sparse.bench.run import bench_forward, bench_normalizers, bench_segment, last_block_scores, score_cases, target_checks

from clipseg_sparse.bench.timing import BenchRow, write_images
from clipseg_sparse.cli.app import app
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.attention.normalizers import entmax
from conftest import TINY_CONFIG


def _well_formed(rows, reference):
    assert rows and all(r.ms > 0 and r.ratio > 0 for r in rows)
    for r in rows:
        if r.variant == reference:
            assert r.ratio == 1.0


def test_last_block_scores_shape_and_structure(tiny_clip):
    s = last_block_scores(tiny_clip, 64)
    heads = tiny_clip.visual.transformer.resblocks[-1].attn.num_heads
    assert s.shape == (heads, 17, 17)  # 1 + (64 / 16)^2 tokens
    assert torch_allclose_sym(s)  # q-q scores are symmetric


def torch_allclose_sym(s):
    return bool((s - s.transpose(-2, -1)).abs().max() < 1e-4)


def test_bench_normalizers_rows():
    cases = list(score_cases([TINY_CONFIG], [64]))
    assert [c.split(" ")[2] for c, _ in cases] == ["qq", "peaked"]
    rows = bench_normalizers(cases, alphas=(1.5, 1.25), repeat=1)
    _well_formed([r for r in rows if r.case.endswith("1.5")], "fast entmax:1.5")
    variants = {r.variant for r in rows}
    assert {"fast entmax:1.5", "fast entmax:1.25", "softmax", "entmax.entmax15", "entmax.entmax15 k=64",
            "entmax.entmax_bisect:1.5", "entmax.entmax_bisect:1.25"} <= variants
    assert len(rows) == 2 * (5 + 3)
    # the peaked case really is sparser than the raw q-q scores
    (_, qq), (_, peaked) = cases
    assert (entmax(peaked, 1.5) > 0).sum() < (entmax(qq, 1.5) > 0).sum()


def test_bench_forward_rows(tiny_clip):
    rows = bench_forward(tiny_clip, 64, repeat=1)
    assert [r.variant for r in rows] == ["unpatched CLIP", "qq/softmax", "qq/entmax:1.5", "qq/entmax:1.25"]
    _well_formed(rows, "qq/softmax")


def test_bench_segment_rows(tiny_clip, tmp_path):
    paths = write_images(tmp_path, 2, (40, 60))
    assert all(p.is_file() for p in paths)
    rows = bench_segment(tiny_clip, paths, classes=3, settings=InferenceSettings(resolution=64, window=64, stride=32), repeat=1)
    assert [r.variant for r in rows] == ["bare model", "segment"]
    _well_formed(rows, "bare model")
    assert "img/s" in rows[0].case


def test_target_checks_read_the_right_rows():
    rows = [
        BenchRow("normalizer", "ViT-B-16 448px qq H12 N785 alpha 1.5", "entmax.entmax_bisect:1.5", 100.0, 20.0, "fast entmax:1.5"),
        BenchRow("normalizer", "ViT-B-16 448px peaked H12 N785 alpha 1.5", "entmax.entmax_bisect:1.5", 40.0, 4.0, "fast entmax:1.5"),
        BenchRow("forward", "x", "qq/entmax:1.5", 110.0, 1.1, "qq/softmax"),
        BenchRow("normalizer", "ViT-L-14 448px qq H16 N1025 alpha 1.5", "entmax.entmax15 k=64", 9.0, 0.9, "fast entmax:1.5"),
        BenchRow("normalizer", "ViT-L-14 448px qq H16 N1025 alpha 1.5", "entmax.entmax15", 30.0, 3.0, "fast entmax:1.5"),
        BenchRow("forward", "x", "qq/entmax:1.5", 110.0, 1.1, "qq/softmax"),
        BenchRow("forward", "x", "qq/entmax:1.25", 104.0, 1.04, "qq/softmax"),
        BenchRow("segment", "y", "segment", 130.0, 1.3, "bare model"),
        BenchRow("text", "240 of 12000", "open_clip encode_text (77 tokens)", 80.0, 8.0, "fast encode_text", max_abs_diff=2e-7),
        BenchRow("text", "per prompt: ...", "fast encode_text", 1.0, 1.0, "fast encode_text"),
        BenchRow("text", "per prompt: ...", "open_clip encode_text (77 tokens)", 6.0, 6.0, "fast encode_text"),
        BenchRow("windows", "z", "ours", 10.0, 1.0, "ours"),
        BenchRow("windows", "z", "published", 25.0, 2.5, "ours"),
    ]
    checks = {name: (value, met) for name, value, _, met in target_checks(rows)}
    speedup = checks["fast entmax speed-up over entmax_bisect (ViT-B/16, 448 px)"]
    assert speedup[0] == 4.0 and not speedup[1]  # the worst case counts
    assert checks["fast entmax speed-up over the entmax package's fastest path (worst case)"] == (0.9, False)
    assert checks["qq/entmax:1.5 forward / qq/softmax forward"] == (1.1, True)
    assert checks["qq/entmax:1.25 forward / qq/softmax forward"] == (1.04, True)
    assert checks["segment time / bare model time"] == (1.3, False)
    assert checks["text speed-up over open_clip encode_text (per prompt)"] == (6.0, True)
    assert checks["text max abs difference to open_clip encode_text"] == (2e-7, True)
    assert checks["published window loop time / ours"] == (2.5, True)


def test_bench_ttfm_fields(tiny_clip):
    """Time to first mask on the tiny model: 3 classes x 4 templates, the plain path on every 2nd prompt."""
    from clipseg_sparse.bench.ttfm import ade20k_names, bench_ttfm

    names = ade20k_names()
    assert len(names) == 150 and names[:3] == ["wall", "building", "sky"]
    templates = ["a photo of a {}.", "{}", "a bad photo of the {}.", "itap of my {}."]
    rows, s = bench_ttfm(tiny_clip, names[:3], templates, image_size=(48, 64), settings=InferenceSettings(resolution=64, window=0), plain_prompts=6, repeat=1)
    assert (s["prompts"], s["subset"]) == (12, 6)
    assert s["total_s"] == s["text_s"] + s["image_s"] and s["text_s"] > 0 and s["image_s"] > 0
    assert 0 <= s["max_abs_diff"] <= 1e-6 and s["rate_speedup"] > 0 and s["subset_speedup"] > 0
    assert s["rate_speedup"] == pytest.approx((s["plain_ms"] / 6) / (s["text_s"] * 1e3 / 12))
    first = {r.variant: r for r in rows if r.suite == "first mask"}
    assert first["total"].ms == pytest.approx(s["total_s"] * 1e3) and "text (12 prompts, cold cache)" in first
    text = [r for r in rows if r.suite == "text"]
    assert [r.max_abs_diff for r in text] == [None, s["max_abs_diff"], None, None]
    assert "6 of 12 prompts (every 2)" in text[0].case


def test_cli_bench_quick_prints_tables():
    result = CliRunner().invoke(app, ["bench", "--quick", "--model", TINY_CONFIG])
    assert result.exit_code == 0, result.output
    for text in ["fast entmax:1.5", "entmax.entmax15 k=64", "qq/softmax", "bare model", "targets (benchmarks/README.md)",
                 "first mask", "open_clip encode_text", "published", "bf16", "text speed-up over open_clip"]:
        assert text in result.output


def test_published_window_loop_gives_our_labels(tiny_clip):
    """The mmseg-style loop (one window per forward, logits accumulated at full size) and our batched,
    separable computation are the same arithmetic: the labels agree (up to float ties)."""
    from clipseg_sparse.bench.timing import smooth_image
    from clipseg_sparse.bench.published import bench_published_windows, published_slide_labels
    from clipseg_sparse.segment.segmenter import Segmenter

    settings = InferenceSettings(resolution=72, window=40, stride=24)  # windows not a multiple of the patch
    seg = Segmenter(tiny_clip, "cat,dog|puppy,sky,grass", spec="sclip", settings=settings, templates="single")
    image = smooth_image((60, 90))
    assert (published_slide_labels(seg, image) == seg.predict_labels(image)).mean() >= 0.999
    rows, agree = bench_published_windows(seg, [image], repeat=1)
    assert agree >= 0.999 and [r.ratio > 0 for r in rows] == [True, True] and rows[0].ratio == 1.0


def test_flop_count_of_a_forward_is_the_hand_count_in_both_precisions(tiny_clip):
    """FlopCounterMode plus the formulas `roofline` teaches it: open_clip's fp32 blocks (nn.MultiheadAttention's
    fused inference op) and the bf16 blocks (explicit products or SDPA) both count the full work of a
    forward: per block 24 C^2 N (q, k, v, out and the 4x MLP) + 4 N^2 C (q k^T and the product with v), the
    patch embedding 2 * 3 p^2 C per patch and the projection 2 C D per token."""
    import torch

    from clipseg_sparse import load_clip
    from clipseg_sparse.bench.roofline import count_gflop

    v = tiny_clip.visual
    C, D, p, L = v.transformer.width, v.proj.shape[1], tiny_clip.patch_size, len(v.transformer.resblocks)
    pixels = torch.randn(1, 3, 64, 64)
    patches = (64 // p) ** 2
    N = 1 + patches
    expected = (L * (24 * C * C * N + 4 * N * N * C) + 2 * 3 * p * p * C * patches + 2 * C * D * patches) / 1e9
    low = load_clip(TINY_CONFIG, pretrained=None, device="cpu", precision="bf16")
    with torch.inference_mode():
        for clip in (tiny_clip, low):
            assert count_gflop(lambda: clip.encode_dense(pixels, None)) == pytest.approx(expected, rel=1e-9)


def test_roofline_lines_give_the_fraction_of_each_measured_rate():
    from clipseg_sparse.bench.roofline import roofline_lines

    rows = [
        BenchRow("matmul", "2048^3 product", "fp32", 100.0, 1.0, "fp32", gflop=20.0),  # 200 GFLOP/s
        BenchRow("matmul", "2048^3 product", "bf16", 25.0, 0.25, "fp32", gflop=20.0),  # 800 GFLOP/s
        BenchRow("precision forward", "ViT-B-16 448px sclip (cosine 0.9999)", "bf16", 400.0, 0.3, "fp32", gflop=160.0),
        BenchRow("precision text", "no FLOP count", "bf16", 10.0, 1.0, "fp32"),
    ]
    head, line = roofline_lines(rows)
    assert head == "matrix-product rate of this machine (2048^3, same run): fp32 200 GFLOP/s, bf16 800 GFLOP/s (bf16 / fp32 = 4.0x: the most a forward can gain from bf16 here)"
    assert line == (
        "roofline precision forward | ViT-B-16 448px sclip | bf16: 160.0 GFLOP in 400 ms = 400 GFLOP/s "
        "(200.0 % of the fp32 rate, 50.0 % of the bf16 rate)"
    )
    assert roofline_lines(rows[2:]) == []


def test_bench_ttfm_in_bf16_leaves_the_fp32_exactness_target_out():
    """The 1e-6 agreement with open_clip is fp32's claim: a bf16 run reports its difference in the case text
    but gives the target no row to read."""
    from clipseg_sparse import load_clip
    from clipseg_sparse.bench.ttfm import bench_ttfm

    low = load_clip(TINY_CONFIG, pretrained=None, device="cpu", precision="bf16")
    rows, s = bench_ttfm(low, ["wall", "sky"], ["a photo of a {}."], image_size=(48, 64), settings=InferenceSettings(resolution=64, window=0), repeat=1)
    text = [r for r in rows if r.suite == "text"]
    assert all(r.max_abs_diff is None for r in text) and "the 1e-6 target is for fp32" in text[0].case
    assert "text max abs difference to open_clip encode_text" not in {name for name, *_ in target_checks(rows)}


def test_region_prototypes_are_the_cells_mean_features_and_label_their_own_cells():
    """3 x 3 cells of a 6 x 6 patch grid, each cell's features one direction plus noise: every prototype is its
    cell's normalised mean, and each patch's nearest prototype is its own cell's."""
    import torch
    import torch.nn.functional as F

    from clipseg_sparse.bench.precision import prototype_labels, region_prototypes

    g = torch.Generator().manual_seed(0)
    cell = torch.arange(6)[:, None] // 2 * 3 + torch.arange(6)[None] // 2
    directions = torch.eye(16)[:9]
    feats = F.normalize(directions[cell] + 0.05 * torch.randn(6, 6, 16, generator=g), dim=-1)[None]
    prototypes = region_prototypes(feats)
    expected = torch.stack([F.normalize(feats[0][cell == c].mean(0), dim=0) for c in range(9)])
    torch.testing.assert_close(prototypes, expected)
    assert torch.equal(prototype_labels(feats, prototypes)[0], cell)


def test_bench_precision_rows_and_accuracy_on_the_tiny_model():
    """The bf16 suite end to end on the tiny model: forward rows per spec with the fp32 FLOP count and the
    accuracy in the case; the text and segment rows only when prompts and images are given."""
    import numpy as np

    from clipseg_sparse.bench.roofline import count_gflop
    from clipseg_sparse.bench.run import bench_precision
    from clipseg_sparse.bench.timing import smooth_image

    images = [smooth_image((40, 60), np.random.default_rng(0))]
    settings = InferenceSettings(resolution=64, window=64, stride=32)
    rows = bench_precision([TINY_CONFIG], 64, images, ["a", "b", "c"], settings, repeat=1, prompts=4)
    suites = [(r.suite, r.variant) for r in rows]
    assert suites == [("precision forward", v) for _ in range(3) for v in ("fp32", "bf16")] + [
        ("precision text", "fp32"), ("precision text", "bf16"), ("precision segment", "fp32"), ("precision segment", "bf16")]
    forward = [r for r in rows if r.suite == "precision forward"]
    assert [r.case.split(" (")[0].split(" ", 4)[-1] for r in forward[::2]] == ["unpatched CLIP", "sclip", "sclip-entmax"]
    assert all("feature cosine mean" in r.case and "prototype labels agree" in r.case for r in forward)
    assert "entmax support agrees" in forward[4].case and "entmax support" not in forward[2].case
    from clipseg_sparse import load_clip
    import torch

    clip = load_clip(TINY_CONFIG, pretrained=None, device="cpu")
    with torch.inference_mode():
        gflop = count_gflop(lambda: clip.encode_dense(torch.zeros(1, 3, 64, 64), "sclip"))
    assert forward[2].gflop == pytest.approx(gflop)
    only = bench_precision([TINY_CONFIG], 64, [], ["a"], settings, repeat=1, prompts=0)
    assert {r.suite for r in only} == {"precision forward"}
