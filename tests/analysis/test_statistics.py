"""Attention statistics: crafted maps and label grids with answers worked out by hand, then `analyze`
end to end on the real ADE20K fixtures with the tiny random model (checked against plain loops)."""

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from clipseg_sparse.analysis.statistics import (
    add_sums,
    analyze,
    attention_statistics,
    image_sums,
    patch_labels,
    stuff_classes,
    summarize,
)
from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets import DATASETS
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.files.results import progress_path
from clipseg_sparse.segment.segmenter import Segmenter
from conftest import TINY_CONFIG

ADE_ROOT = Path(__file__).parents[1] / "data" / "ade20k"
FAST = dict(resolution=64, window=32, stride=16)


def test_uniform_row_has_entropy_log_n_and_full_support():
    n = 7
    maps = torch.full((2, n, n), 1.0 / n)  # 2 heads, no CLS
    stats, classes = attention_statistics(maps, torch.zeros(n, dtype=torch.long), has_cls=False)
    assert stats["entropy"].shape == (2, n) and classes.tolist() == [0] * n
    torch.testing.assert_close(stats["entropy"], torch.full((2, n), math.log(n), dtype=torch.float64))
    torch.testing.assert_close(stats["support"], torch.full((2, n), float(n), dtype=torch.float64))
    assert (stats["nonzero"] == n).all()
    assert torch.allclose(stats["own_mass"], torch.ones(2, n, dtype=torch.float64))


def test_sparse_row_counts_exact_zeros_and_zero_log_zero_is_zero():
    row = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0])
    stats, _ = attention_statistics(row.expand(1, 5, 5), torch.arange(5), has_cls=False)
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert stats["entropy"][0, 0].item() == pytest.approx(expected)
    assert stats["support"][0, 0].item() == pytest.approx(math.exp(expected))
    assert stats["nonzero"][0].tolist() == [3.0] * 5


def test_block_diagonal_map_has_all_mass_on_its_own_class():
    labels = torch.tensor([0, 0, 1, 1, 1])
    block = (labels[:, None] == labels[None, :]).float()
    maps = (block / block.sum(1, keepdim=True))[None]
    stats, _ = attention_statistics(maps, labels, stuff=torch.tensor([False, True]), has_cls=False)
    assert torch.allclose(stats["own_mass"], torch.ones(1, 5, dtype=torch.float64))
    assert torch.allclose(stats["diffusivity"], torch.zeros(1, 5, dtype=torch.float64))
    assert stats["stuff_mass"][0].tolist() == pytest.approx([0, 0, 1, 1, 1])
    assert stats["entropy"][0].tolist() == pytest.approx([math.log(2)] * 2 + [math.log(3)] * 3)


def test_masses_with_cls_other_classes_void_keys_and_a_summed_source():
    # tokens: CLS, then patches of class 0, 0, 1 and one void patch (-1)
    labels = torch.tensor([0, 0, 1, -1])
    row = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.25])  # CLS, p0 (cls 0), p1 (cls 0), p2 (cls 1), p3 (void)
    maps = (2 * row).expand(1, 5, 5).clone()  # rows summing to 2, as qq+kk gives: divided by the sum
    stats, classes = attention_statistics(maps, labels, stuff=torch.tensor([False, True]), has_cls=True)
    assert classes.tolist() == [0, 0, 1]  # the void patch is not a query
    assert stats["own_mass"][0].tolist() == pytest.approx([0.5, 0.5, 0.15])
    assert stats["diffusivity"][0].tolist() == pytest.approx([0.5, 0.5, 0.85])
    assert stats["cls_mass"][0].tolist() == pytest.approx([0.1] * 3)
    assert stats["stuff_mass"][0].tolist() == pytest.approx([0.15] * 3)
    assert stats["nonzero"][0].tolist() == [5.0] * 3
    no_stuff, _ = attention_statistics(maps, labels, stuff=None)
    assert torch.isnan(no_stuff["stuff_mass"]).all()


def test_majority_reduction_with_ignore_ties_and_padding():
    V = 255
    labels = torch.tensor(
        [
            [1, 1, 2, V, 3],
            [1, 2, V, V, 3],
            [4, 5, 6, 6, V],
            [5, 4, 6, V, V],
        ]
    )
    # patch 2: a 2 x 3 grid; the last column is padded with ignore
    # (0,0): 1 x3, 2 x1 -> 1 | (0,1): 2 x1, V x3 -> void | (0,2): 3 x2, V x2 (pad) -> tie, ignore loses -> 3
    # (1,0): 4 x2, 5 x2 -> tie -> 4 | (1,1): 6 x3, V x1 -> 6 | (1,2): V x4 -> void
    assert patch_labels(labels, 2).tolist() == [1, -1, 3, 4, 6, -1]
    assert patch_labels(torch.full((3, 3), V), 2).tolist() == [-1] * 4


def _loop_majority(labels: np.ndarray, p: int) -> list[int]:
    """The majority rule as a plain loop (independent of patch_labels' scatter)."""
    H, W = labels.shape
    out = []
    for i in range(0, -(-H // p) * p, p):
        for j in range(0, -(-W // p) * p, p):
            block = [int(labels[y, x]) if y < H and x < W else 255 for y in range(i, i + p) for x in range(j, j + p)]
            counts = Counter(block)
            best = max(counts.values())
            winners = sorted(v for v, c in counts.items() if c == best and v != 255)
            out.append(winners[0] if winners else -1)
    return out


def test_patch_labels_equal_a_plain_loop_on_random_grids():
    rng = np.random.default_rng(0)
    for _ in range(20):
        labels = rng.choice([0, 1, 2, 7, 255], size=(rng.integers(1, 20), rng.integers(1, 20)))
        assert patch_labels(torch.from_numpy(labels), 4).tolist() == _loop_majority(labels, 4)


def test_sums_add_and_summarize_to_patch_weighted_means():
    def record(values, classes):  # one head; stats all equal to `values`
        v = torch.tensor([values], dtype=torch.float64)
        return image_sums({"entropy": v, "diffusivity": 1 - v}, torch.tensor(classes), per_head=True)

    a, b = record([1.0, 2.0, 3.0], [0, 0, 1]), record([5.0], [1])
    both = add_sums(add_sums(None, a), b)
    assert both["patches"] == 4 and both["sums"]["entropy"] == pytest.approx(11.0)
    assert both["classes"]["1"] == [2, pytest.approx({"entropy": 8.0, "diffusivity": -6.0})]
    assert a["classes"]["1"][0] == 1  # adding did not change its inputs
    s = summarize({"a": a, "b": b}, ["wall", "sky"])
    assert s["metrics"]["entropy"] == pytest.approx(11.0 / 4) and s["patches"] == 4
    assert s["per_class"] == {"wall": {"patches": 2, "entropy": 1.5, "diffusivity": -0.5},
                              "sky": {"patches": 2, "entropy": 4.0, "diffusivity": -3.0}}  # fmt: skip
    assert s["per_image"]["a"]["entropy"] == pytest.approx(2.0) and s["per_image"]["b"]["patches"] == 1
    assert s["per_head"]["entropy"] == [pytest.approx(11.0 / 4)]


def test_attention_over_another_token_set_is_refused():
    from clipseg_sparse.analysis.statistics import check_tokens

    assert check_tokens(5, 4, "qq/softmax") is None and check_tokens(4, 4, "qq/softmax/cls:0.3") is None
    with pytest.raises(ValueError, match="attends over 16 tokens, not CLIP's 4 patches"):
        check_tokens(16, 4, "x")  # e.g. an external backbone's finer grid


def test_stuff_classes_of_the_datasets():
    ade = stuff_classes("ade20k")
    names = DATASETS.get("ade20k").classes
    assert len(ade) == 50 and {names[i] for i in (0, 1, 2, 4)} == {"wall", "building", "sky", "tree"}
    assert "person" not in {names[i] for i in ade} and "car" not in {names[i] for i in ade}
    assert stuff_classes("voc21") == (0,) and stuff_classes("voc20") is None
    assert stuff_classes("coco-stuff")[0] == 80 and DATASETS.get("cityscapes").classes[stuff_classes("cityscapes")[-1]] == "sky"


# -- end to end on the ADE20K fixtures -----------------------------------------------------------------
def _loop_statistics(clip, sample, spec, resolution: int, protocol: str) -> tuple[int, dict]:
    """Whole-image statistics by plain loops over the attention map of one forward, on the image as the
    protocol prepares it: its resize method and positional embeddings, the last partial patch padded
    (remainder pad) or cut (drop; centre cuts too on a whole image), the labels with it."""
    from clipseg_sparse.segment.images import load_image
    from clipseg_sparse.segment.preprocess import resized_shape, to_pixels

    settings = PROTOCOLS.get(protocol).settings("ade20k")
    bench = DATASETS.get("ade20k")
    rgb, labels = load_image(sample.image), bench.load_label(sample.label)
    size = resized_shape(*labels.shape, resolution)
    ps = clip.patch_size
    pixels = to_pixels(rgb, clip, size, settings.resize)
    ys = (np.arange(size[0]) * labels.shape[0] / size[0]).astype(int)  # nearest (torch's floor rule)
    xs = (np.arange(size[1]) * labels.shape[1] / size[1]).astype(int)
    resized = labels[ys][:, xs]
    if settings.remainder == "pad":
        pixels = torch.nn.functional.pad(pixels, (0, -size[1] % ps, 0, -size[0] % ps))
    else:
        whole = (size[0] // ps * ps, size[1] // ps * ps)
        pixels, resized = pixels[..., : whole[0], : whole[1]], resized[: whole[0], : whole[1]]
    maps = clip.attention_maps(pixels, spec, pos_interp=settings.pos_interp)[0].double().numpy()
    grid = _loop_majority(resized, ps)
    stuff = set(stuff_classes("ade20k"))
    sums, n = Counter(), 0
    for h in range(maps.shape[0]):
        for i, c in enumerate(grid):
            if c < 0:
                continue
            row = maps[h, 1 + i] / maps[h, 1 + i].sum()
            ent = -sum(p * math.log(p) for p in row if p > 0)
            own = sum(row[1 + j] for j, d in enumerate(grid) if d == c)
            sums["entropy"] += ent / maps.shape[0]
            sums["own_mass"] += own / maps.shape[0]
            sums["stuff_mass"] += sum(row[1 + j] for j, d in enumerate(grid) if d in stuff) / maps.shape[0]
            sums["nonzero"] += sum(p > 0 for p in row) / maps.shape[0]
            n += h == 0
    return n, sums


@pytest.mark.parametrize("spec,protocol", [("qq/softmax", "sclip"), ("kk/entmax:1.5/gauss:5", "sclip"), ("qq/softmax", "proxyclip")])
def test_whole_image_statistics_equal_plain_loops(tiny_clip, spec, protocol):
    bench = DATASETS.get("ade20k")
    sample = bench.samples(ADE_ROOT)[2]
    record = analyze(tiny_clip, "ade20k", ADE_ROOT, spec, protocol, overrides=dict(resolution=64, window=0), limit=3, progress=False)
    assert PROTOCOLS.get(protocol).settings("ade20k").remainder == ("drop" if protocol == "sclip" else "pad")
    n, sums = _loop_statistics(tiny_clip, sample, spec, 64, protocol)
    got = record["per_image"][sample.id]
    assert got["patches"] == n
    for stat in ("entropy", "own_mass", "stuff_mass", "nonzero"):
        assert got[stat] == pytest.approx(sums[stat] / n, rel=1e-6), stat


def test_analyze_ade20k_fixtures_end_to_end(tiny_clip, tmp_path):
    out = tmp_path / "ade.json"
    record = analyze(tiny_clip, "ade20k", ADE_ROOT, "qq/softmax", overrides=FAST, out=out, per_head=True, progress=False)
    assert json.loads(out.read_text()) == record
    assert record["kind"] == "analysis" and record["num_images"] == 3
    c = record["config"]
    assert (c["attention"], c["dataset"], c["resolution"], c["window"], c["stride"]) == ("qq/softmax", "ade20k", 64, 32, 16)
    assert c["stuff_classes"] == list(stuff_classes("ade20k")) and c["per_head"] is True and "model" in c
    m = record["metrics"]
    assert m["diffusivity"] == pytest.approx(1 - m["own_mass"])
    assert m["nonzero"] == 5.0  # softmax over CLS + the 2 x 2 patches of a 32 px window of 16 px patches
    assert 0 < m["entropy"] < math.log(5) and m["support"] < 5
    # dataset means are patch-weighted means of the images and of the classes
    images = record["per_image"].values()
    assert record["patches"] == sum(i["patches"] for i in images) == sum(c["patches"] for c in record["per_class"].values())
    assert m["own_mass"] == pytest.approx(sum(i["own_mass"] * i["patches"] for i in images) / record["patches"])
    assert set(record["per_class"]) <= set(DATASETS.get("ade20k").classes)
    assert np.mean(record["per_head"]["own_mass"]) == pytest.approx(m["own_mass"])  # 3 heads
    sparse = analyze(tiny_clip, "ade20k", ADE_ROOT, "qq/entmax:1.5", overrides=FAST, progress=False)
    assert sparse["metrics"]["nonzero"] < 5.0 and sparse["patches"] == record["patches"]
    ident = analyze(tiny_clip, "ade20k", ADE_ROOT, "maskclip", overrides=FAST, progress=False)["metrics"]
    assert (ident["own_mass"], ident["entropy"], ident["nonzero"]) == (1.0, 0.0, 1.0)
    patches_only = analyze(tiny_clip, "ade20k", ADE_ROOT, "qq/softmax/cls:0.3", overrides=FAST, progress=False)["metrics"]
    assert (patches_only["nonzero"], patches_only["cls_mass"]) == (4.0, 0.0)  # cls:C attends over the 2 x 2 patches only


def test_interrupted_analysis_resumes_to_the_same_result(tiny_clip, tmp_path, monkeypatch):
    import clipseg_sparse.analysis.statistics as analysis

    full = analyze(tiny_clip, "ade20k", ADE_ROOT, "sclip", overrides=FAST, progress=False)
    out = tmp_path / "part.json"
    real, calls = analysis.image_statistics, []

    def crash_after_one(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(analysis, "image_statistics", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        analyze(tiny_clip, "ade20k", ADE_ROOT, "sclip", overrides=FAST, out=out, progress=False)
    assert not out.exists() and len(progress_path(out).read_text().splitlines()) == 2
    monkeypatch.setattr(analysis, "image_statistics", real)
    resumed = analyze(tiny_clip, "ade20k", ADE_ROOT, "sclip", overrides=FAST, out=out, progress=False)
    assert resumed["timing"]["resumed_images"] == 1
    assert resumed["metrics"] == pytest.approx(full["metrics"]) and resumed["per_class"].keys() == full["per_class"].keys()
    for name, stats in full["per_class"].items():
        assert resumed["per_class"][name] == pytest.approx(stats)


def test_analyze_cli_writes_one_result_per_spec_and_refuses_bad_stuff(tmp_path, monkeypatch):
    runner = CliRunner()
    args = ["analyze", "--dataset", "ade20k", "--root", str(ADE_ROOT), "--model", TINY_CONFIG, "--pretrained", "none",
            "--resolution", "64", "--window", "32", "--stride", "16", "--limit", "1", "--out", str(tmp_path / "an")]  # fmt: skip
    result = runner.invoke(app, [*args, "--preset", "clearclip", "--attn", "qq/entmax:1.5/nores/noffn"])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "an").glob("*.json"))
    assert len(files) == 2 and all(f.startswith("ade20k__qq_") for f in files)
    assert "qq/entmax:1.5/nores/noffn" in result.stdout and "diffusivity" in result.stdout
    bad = runner.invoke(app, [*args, "--stuff", "wall,unicorn"])
    assert bad.exit_code == 2 and "unicorn" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("protocol", PROTOCOLS.names())
def test_analyze_measures_the_pixels_eval_scores(tiny_clip, protocol, forward_inputs):
    """The protocol's resize, positional-embedding rule, remainder rule and rounding reach analyze as they
    reach eval: every window's pixels equal (40-px windows: not whole 16-px patches)."""
    overrides = dict(resolution=56, window=40, stride=24)
    analyze(tiny_clip, "ade20k", ADE_ROOT, "qq/softmax", protocol=protocol, overrides=overrides, limit=1, progress=False)
    analysed = forward_inputs[:]
    forward_inputs.clear()
    settings = PROTOCOLS.get(protocol).settings("ade20k", overrides).replace(stages=())  # stages need SAM or regions, not other pixels
    Segmenter(tiny_clip, "a,b", "qq/softmax", settings, templates="single").predict(DATASETS.get("ade20k").samples(ADE_ROOT)[0].image)
    assert len(analysed) == len(forward_inputs) > 0
    for (pixels, rule), (evaluated, eval_rule) in zip(analysed, forward_inputs):
        assert rule == eval_rule and torch.equal(pixels, evaluated)


def test_an_analysis_made_before_analyze_followed_the_protocols_preprocessing_is_refused(tiny_clip, tmp_path):
    """Older analyze ignored the protocol's resize / pos_interp / remainder: its result file, which does not
    record them, must not be shown as the finished result of today's (different) measurement."""
    from clipseg_sparse.files.results import ConfigMismatchError

    out = tmp_path / "old.json"
    record = analyze(tiny_clip, "ade20k", ADE_ROOT, "sclip", overrides=FAST, out=out, progress=False)
    assert record["config"]["preprocess"] == {"resize": "opencv", "pos_interp": "scale", "remainder": "drop", "size_multiple": 0, "size_rule": "each"}
    old = json.loads(out.read_text())
    del old["config"]["preprocess"]
    out.write_text(json.dumps(old))
    with pytest.raises(ConfigMismatchError, match="preprocess"):
        analyze(tiny_clip, "ade20k", ADE_ROOT, "sclip", overrides=FAST, out=out, progress=False)
    again = analyze(tiny_clip, "ade20k", ADE_ROOT, "sclip", overrides=FAST, out=out, progress=False, overwrite=True)
    assert again["metrics"] == pytest.approx(record["metrics"])


def test_query_statistics_of_a_detector_equal_a_plain_loop():
    """Hand-built query rows on a 2 x 3 token grid: names whose class is in the image contribute their kept
    queries (the best one when none is kept); keys are labelled by the majority of their cell."""
    import math

    from clipseg_sparse.analysis.statistics import query_statistics, stuff_mask
    from clipseg_sparse.segment.pipelines import QueryAttention

    g = torch.Generator().manual_seed(0)
    rows = torch.rand(3, 2, 4, 6, generator=g) ** 3
    rows = rows / rows.sum(-1, keepdim=True)
    rows[1, :, 2, :3] = 0  # exact zeros count for nonzero
    rows[1, :, 2] /= rows[1, :, 2].sum(-1, keepdim=True)
    scores = torch.tensor([[0.9, 0.2, 0.6, 0.1], [0.1, 0.2, 0.8, 0.3], [0.4, 0.9, 0.1, 0.2]])
    att = QueryAttention(rows, scores, scores > 0.5, (2, 3), (1, 2, 3))  # class 3 is not in the image
    key_labels = [1, 1, 2, 2, 0, 1]  # row-major cells
    labels = np.kron(np.array(key_labels).reshape(2, 3), np.ones((5, 7), dtype=np.int64))  # 10 x 21 px
    stuff = stuff_mask((0,), 4)
    got = query_statistics(att, labels, stuff)
    want = {"entropy": 0.0, "own_mass": 0.0, "stuff_mass": 0.0, "nonzero": 0.0}
    count, per_class = 0, {}
    for name, c, queries in ((0, 1, [0, 2]), (1, 2, [2])):  # name 1 keeps no query but 2 (0.8); name 0 keeps 0 and 2
        for q in queries:
            heads = []
            for h in range(2):
                p = rows[name, h, q].double().tolist()
                heads.append({
                    "entropy": -sum(v * math.log(v) for v in p if v > 0),
                    "own_mass": sum(v for v, k in zip(p, key_labels) if k == c),
                    "stuff_mass": sum(v for v, k in zip(p, key_labels) if k == 0),
                    "nonzero": sum(v > 0 for v in p),
                })  # fmt: skip
            for k in want:
                want[k] += sum(hd[k] for hd in heads) / 2
            count += 1
            per_class[str(c)] = per_class.get(str(c), 0) + 1
    assert got["patches"] == count == 3 and {c: n for c, (n, _) in got["classes"].items()} == per_class
    for k, v in want.items():
        assert got["sums"][k] == pytest.approx(v, abs=1e-6), k  # float32 rows renormalised in float64
    assert got["sums"]["cls_mass"] == 0 and got["sums"]["diffusivity"] == pytest.approx(3 - want["own_mass"])
    none_kept = QueryAttention(rows, scores, torch.zeros_like(scores, dtype=torch.bool), (2, 3), (1, 2, 3))
    assert query_statistics(none_kept, labels, stuff)["patches"] == 2  # each present name's best query
    assert query_statistics(att, np.full((10, 21), 5), stuff) is None  # no prompted class in the image
