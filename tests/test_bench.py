"""The benchmark module on tiny shapes: well-formed rows, every variant present (no timing assertions)."""

from typer.testing import CliRunner

from clipseg_sparse.bench import (
    BenchRow,
    bench_forward,
    bench_normalizers,
    bench_segment,
    last_block_scores,
    score_cases,
    target_checks,
    write_images,
)
from clipseg_sparse.cli import app
from clipseg_sparse.inference import InferenceSettings
from clipseg_sparse.normalizers import entmax
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
        BenchRow("segment", "y", "segment", 130.0, 1.3, "bare model"),
    ]
    checks = {name: (value, met) for name, value, _, met in target_checks(rows)}
    speedup = checks["fast entmax speed-up over entmax_bisect (ViT-B/16, 448 px)"]
    assert speedup[0] == 4.0 and not speedup[1]  # the worst case counts
    assert checks["qq/entmax:1.5 forward / qq/softmax forward"] == (1.1, True)
    assert checks["segment time / bare model time"] == (1.3, False)


def test_cli_bench_quick_prints_tables():
    result = CliRunner().invoke(app, ["bench", "--quick", "--model", TINY_CONFIG])
    assert result.exit_code == 0, result.output
    for text in ["fast entmax:1.5", "entmax.entmax15 k=64", "qq/softmax", "bare model", "targets (benchmarks/README.md)"]:
        assert text in result.output
