"""FG-OVD: reader on the real benchmark file, rank metrics, region pooling, crops, resumable runs, CLI."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.attention import AttentionSpec, resolve_spec
from clipseg_sparse.cli.app import app
from clipseg_sparse.files.results import progress_path
from clipseg_sparse.evaluation.fgovd import (
    BenchmarkFormatError,
    MissingImageError,
    evaluate_fgovd,
    fgovd_metrics,
    positive_rank,
    rank_metrics,
    read_benchmark,
)
from clipseg_sparse.evaluation.fgovd import evaluate as evaluate_mod
from clipseg_sparse.evaluation.fgovd.pooling import WindowFeatures, box_map, crop_box, encode_crops, mask_map
from clipseg_sparse.segment.preprocess import to_pixels
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.registry import UnknownNameError
from clipseg_sparse.files.results import ConfigMismatchError
from conftest import TINY_CONFIG

DATA = Path(__file__).parents[2] / "data" / "fgovd"
FULL = DATA / "transparency.json"  # the real benchmark file: 230 images, 409 annotations
SUBSET = DATA / "subset" / "transparency.json"  # 2 images (213224, 245026), 3 annotations
FAST = InferenceSettings(resolution=64, window=0)  # whole image at short side 64: one forward per image


def make_images(bench: Path, root: Path, count: int | None = None, noise: bool = False) -> list[dict]:
    """Write images of the declared sizes under root/file_name (solid colour, or noise); returns the entries."""
    entries = json.loads(bench.read_text())["images"][:count]
    for im in entries:
        rng = np.random.default_rng(im["id"])
        shape = (im["height"], im["width"], 3)
        pixels = rng.integers(0, 256, shape, dtype=np.uint8) if noise else np.full(shape, rng.integers(0, 256, 3), np.uint8)
        path = root / im["file_name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path)
    return entries


# -- reader -----------------------------------------------------------------------------------------
def test_reader_on_real_transparency_file():
    raw = json.loads(FULL.read_text())
    bench = read_benchmark(FULL)
    assert bench.split == "transparency"
    assert len(bench.annotations) == len(raw["annotations"]) == 409
    assert len(bench.images()) == 230
    assert all(a.file_name.startswith(("val2017/", "train2017/")) for a in bench.annotations)
    names = {c["id"]: c["name"] for c in raw["categories"]}
    images = {im["id"]: im for im in raw["images"]}
    by_id = {a.id: a for a in bench.annotations}
    differs = 0
    for ann in raw["annotations"]:
        got = by_id[ann["id"]]
        assert got.box == tuple(ann["bbox"])
        assert got.captions == tuple(names[c] for c in [ann["category_id"], *ann["neg_category_ids"]])
        assert got.file_name == images[ann["image_id"]]["file_name"]
        assert (got.height, got.width) == (images[ann["image_id"]]["height"], images[ann["image_id"]]["width"])
        differs += list(got.category_ids[1:]) != images[ann["image_id"]]["neg_category_ids"]
    assert differs > 0  # the image-level list is a different thing, and is not what we read


def test_split_comes_from_file_name(tmp_path):
    for stem, split in [("1_attributes", "hard"), ("2_attributes", "medium"), ("3_attributes", "easy"), ("shuffle_negatives", "trivial")]:
        path = tmp_path / f"{stem}.json"
        path.write_text(SUBSET.read_text())
        assert read_benchmark(path).split == split
    odd = tmp_path / "colour.json"
    odd.write_text(SUBSET.read_text())
    with pytest.raises(UnknownNameError, match="color"):
        read_benchmark(odd)
    assert read_benchmark(odd, split="color").split == "color"


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d["annotations"][1].pop("neg_category_ids"), "neg_category_ids"),
        (lambda d: d["annotations"][1].update(bbox=[1, 2, 0, 5]), "bbox"),
        (lambda d: d["annotations"][1].update(bbox=[1, 2, "3", 5]), "bbox"),
        (lambda d: d["annotations"][1].update(bbox=[500, 2, 30, 5]), "bbox"),  # image 213224 is 427 wide
        (lambda d: d["annotations"][1].update(category_id=999999), "category_id"),
        (lambda d: d["annotations"][1]["neg_category_ids"].append(999999), "neg_category_ids"),
        (lambda d: d["annotations"][1].update(image_id=1), "image_id"),
        (lambda d: d["images"][1].pop("file_name"), "file_name"),
        (lambda d: d["categories"][1].update(name=""), "name"),
    ],
)
def test_malformed_file_names_first_bad_entry(tmp_path, edit, field):
    data = json.loads(SUBSET.read_text())
    edit(data)
    path = tmp_path / "transparency.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BenchmarkFormatError) as e:
        read_benchmark(path)
    msg = str(e.value)
    assert "\n" not in msg and repr(field) in msg and "#1" in msg and str(path) in msg
    entry = {"neg_category_ids": "annotations", "bbox": "annotations", "category_id": "annotations", "image_id": "annotations"}
    section = entry.get(field, "images" if field == "file_name" else "categories")
    assert f"(id {data[section][1]['id']})" in msg


def test_malformed_top_level(tmp_path):
    path = tmp_path / "transparency.json"
    path.write_text("{not json")
    with pytest.raises(BenchmarkFormatError, match="not valid JSON"):
        read_benchmark(path)
    path.write_text(json.dumps({"images": [], "annotations": []}))
    with pytest.raises(BenchmarkFormatError, match="'categories'"):
        read_benchmark(path)


# -- metrics ----------------------------------------------------------------------------------------
def test_positive_rank_counts_ties_against_the_positive():
    assert positive_rank([0.9, 0.1, 0.2]) == 1
    assert positive_rank([0.5, 0.5, 0.2]) == 2  # a tie is not a win
    assert positive_rank([0.1, 0.3, 0.2, 0.1]) == 4
    assert positive_rank([0.3, 0.3, 0.3]) == 3


def test_positive_rank_with_nan_scores_is_a_valid_losing_rank():
    """A NaN score cannot beat or be beaten: it counts against the positive, and the rank stays in 1..len."""
    nan = float("nan")
    assert positive_rank([nan, 0.1, 0.2]) == 3  # was 0: nan >= nan is False
    assert positive_rank([0.9, nan, 0.2]) == 2
    assert positive_rank([0.9, 0.1]) == 1


def test_rank_metrics_by_hand_with_the_n_filter():
    scores = [
        [0.9, 0.1, 0.2, 0.3],  # ranks at N=1,2,3: 1, 1, 1
        [0.5, 0.5, 0.6, 0.1],  # 2, 3, 3
        [0.2, 0.1, 0.3],  # 1, 2 ; dropped at N=3
        [0.4, 0.8],  # 2 ; dropped at N=2, 3
    ]
    m1 = rank_metrics(scores, 1)
    assert m1 == {"count": 4, "top1": 50.0, "mean_rank": 1.5, "median_rank": 1.5}
    m2 = rank_metrics(scores, 2)
    assert m2["count"] == 3 and m2["top1"] == pytest.approx(100 / 3)
    assert m2["mean_rank"] == pytest.approx(2.0) and m2["median_rank"] == 2.0
    m3 = rank_metrics(scores, 3)
    assert m3 == {"count": 2, "top1": 50.0, "mean_rank": 2.0, "median_rank": 2.0}
    assert rank_metrics(scores, 4) == {"count": 0}


def test_split_keys_and_difficulty_mean():
    recs = [
        {"split": "hard", "scores": [0.1, 0.2]},  # rank 2
        {"split": "medium", "scores": [0.3, 0.2]},  # rank 1
        {"split": "easy", "scores": [0.3, 0.2]},  # rank 1
        {"split": "color", "scores": [0.3, 0.2, 0.1]},
    ]
    m = fgovd_metrics(recs, negatives=2)
    assert m["hard.top1@1"] == 0.0 and m["medium.top1@1"] == 100.0
    assert m["mean.top1@1"] == pytest.approx(200 / 3) and m["mean.mean_rank@1"] == pytest.approx(4 / 3)
    assert m["color.top1@2"] == 100.0 and m["hard.count@2"] == 0
    assert "mean.top1@2" not in m and "hard.top1@2" not in m
    assert "mean.top1@1" not in fgovd_metrics(recs[:2], negatives=1)


# -- regions ----------------------------------------------------------------------------------------
def test_box_map_fractional_coverage_by_hand():
    m = box_map((1.5, 0.25, 2.0, 1.0), (1.0, 1.0), (3, 5))  # x 1.5..3.5, y 0.25..1.25
    rows = torch.tensor([0.75, 0.25, 0.0])
    cols = torch.tensor([0.0, 0.5, 1.0, 0.5, 0.0])
    assert torch.allclose(m, rows[:, None] * cols[None])
    assert m.sum().item() == pytest.approx(2.0)
    scaled = box_map((2.0, 2.0, 4.0, 2.0), (0.5, 0.5), (4, 4))  # -> x 1..3, y 1..2 at half size
    assert scaled.sum().item() == pytest.approx(2.0) and scaled[1, 1:3].eq(1).all()


def _features(clip, size, settings, seed=0):
    torch.manual_seed(seed)
    rgb = (torch.rand(*size, 3) * 255).to(torch.uint8).numpy()
    spec = AttentionSpec.parse("clearclip")
    return rgb, WindowFeatures.compute(clip, to_pixels(rgb, clip, size), spec, settings)


def test_box_on_one_patch_returns_that_patch(tiny_clip):
    _, wf = _features(tiny_clip, (64, 96), InferenceSettings(window=0))
    assert wf.feats.shape[:3] == (1, 4, 6)
    emb = wf.pool(torch.stack([box_map((32, 16, 16, 16), (1.0, 1.0), (64, 96))]))  # patch row 1, col 2
    assert torch.allclose(emb[0], wf.feats[0, 1, 2], atol=1e-6)
    half = box_map((32, 16, 24, 16), (1.0, 1.0), (64, 96))  # patch (1, 2) whole, (1, 3) half
    w = wf.patch_weights(half[None])[0, 0]
    assert w[1, 2].item() == pytest.approx(2 / 3) and w[1, 3].item() == pytest.approx(1 / 3) and w.sum().item() == pytest.approx(1)
    expected = F.normalize(2 / 3 * wf.feats[0, 1, 2] + 1 / 3 * wf.feats[0, 1, 3], dim=0)
    assert torch.allclose(wf.pool(half[None])[0], expected, atol=1e-6)


def test_partial_patches_at_the_image_edge(tiny_clip):
    # 70 x 100 is zero-padded to 80 x 112 (5 x 7 patches); the last row and column are partial
    _, wf = _features(tiny_clip, (70, 100), InferenceSettings(window=0))
    assert wf.feats.shape[:3] == (1, 5, 7)
    edge = box_map((96, 64, 4, 6), (1.0, 1.0), (70, 100))  # the image part of patch (4, 6)
    assert torch.allclose(wf.pool(edge[None])[0], wf.feats[0, 4, 6], atol=1e-6)
    w = wf.patch_weights(box_map((0, 0, 100, 70), (1.0, 1.0), (70, 100))[None])[0, 0]
    assert w[0, 0].item() == pytest.approx(256 / 7000) and w[4, 6].item() == pytest.approx(24 / 7000)


def test_overlapping_windows_share_pixels_evenly(tiny_clip):
    # 64 x 96 with 64-px windows at stride 32: windows at x = 0, 32 (cols 0..63, 32..95)
    _, wf = _features(tiny_clip, (64, 96), InferenceSettings(window=64, stride=32))
    assert [b[2:] for b in wf.boxes] == [(0, 64), (32, 96)]
    box = box_map((32, 0, 16, 16), (1.0, 1.0), (64, 96))  # pixels 32..47: patch 2 of window 0, patch 0 of window 1
    w = wf.patch_weights(box[None])[:, 0]
    assert w[0, 0, 2].item() == pytest.approx(0.5) and w[1, 0, 0].item() == pytest.approx(0.5)
    assert w.sum().item() == pytest.approx(1.0)
    expected = F.normalize(wf.feats[0, 0, 2] + wf.feats[1, 0, 0], dim=0)
    assert torch.allclose(wf.pool(box[None])[0], expected, atol=1e-6)
    # x 16..48: pixels 16..31 are seen by window 0 only, 32..47 by both
    w = wf.patch_weights(box_map((16, 0, 32, 16), (1.0, 1.0), (64, 96))[None])[:, 0]
    assert [w[0, 0, 1].item(), w[0, 0, 2].item(), w[1, 0, 0].item()] == pytest.approx([0.5, 0.25, 0.25])
    several = torch.stack([box_map(b, (1.0, 1.0), (64, 96)) for b in [(3.3, 5.1, 70.2, 40.7), (0, 0, 96, 64), (50, 10, 8, 8)]])
    assert torch.allclose(wf.patch_weights(several).sum((0, 2, 3)), torch.ones(3), atol=1e-6)


def test_mask_of_a_rectangle_polygon_matches_the_box(tiny_clip):
    from clipseg_sparse.evaluation.fgovd.data import RegionAnnotation

    _, wf = _features(tiny_clip, (64, 96), InferenceSettings(window=0))
    x, y, w, h = 20, 8, 40, 30
    ann = RegionAnnotation(1, "t", 1, "f.jpg", 64, 96, (x, y, w, h), (1,), ("c",), [[x, y, x + w, y, x + w, y + h, x, y + h]])
    assert torch.equal(mask_map(ann, (64, 96)), box_map((x, y, w, h), (1.0, 1.0), (64, 96)))
    assert torch.allclose(wf.pool(mask_map(ann, (64, 96))[None]), wf.pool(box_map(ann.box, (1.0, 1.0), (64, 96))[None]), atol=1e-6)
    # resized to half: area averaging gives the same fractional map as the scaled box
    assert torch.allclose(mask_map(ann, (32, 48)), box_map(ann.box, (0.5, 0.5), (32, 48)), atol=1e-6)


def test_crop_box_rule_by_hand():
    assert crop_box((10.4, 20.6, 30.2, 40.1), 1.0, 640, 480) == (10, 20, 41, 61)
    # x2: w 20 -> 40, shift floor(10) = 10: 40..80; y: h 10 -> 20, shift 5: 15..35
    assert crop_box((50, 20, 20, 10), 2.0, 640, 480) == (40, 15, 80, 35)
    assert crop_box((5, 5, 20, 10), 3.0, 50, 20) == (0, 0, 45, 20)  # clipped to the image


@pytest.mark.parametrize("spec", ["clip", "clearclip"])
def test_crop_embedding_sees_only_the_crop(tiny_clip, spec):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (80, 120, 3), dtype=np.uint8)
    b = rng.integers(0, 256, (80, 120, 3), dtype=np.uint8)
    box = (30.0, 10.0, 50.0, 40.0)
    b[10:50, 30:80] = a[10:50, 30:80]  # same crop, different surroundings
    ea, eb = (encode_crops(tiny_clip, im, [box], AttentionSpec.parse(spec)) for im in (a, b))
    assert torch.allclose(ea, eb, atol=1e-5)
    wider = encode_crops(tiny_clip, a, [box], AttentionSpec.parse(spec), scale_factor=1.5)
    assert not torch.allclose(ea, wider, atol=1e-3)
    assert torch.allclose(ea.norm(dim=-1), torch.ones(1))


# -- whole runs -------------------------------------------------------------------------------------
def _recompute(per_annotation, split, n):
    """Independent recomputation of top-1 / mean / median rank from saved scores."""
    ranks = []
    for rec in per_annotation:
        if rec["split"] == split and len(rec["scores"]) > n:
            s = rec["scores"][: n + 1]
            ranks.append(1 + sum(v >= s[0] for v in s[1:]))
    return 100 * sum(r == 1 for r in ranks) / len(ranks), sum(ranks) / len(ranks), statistics.median(ranks)


@pytest.mark.parametrize("region", ["pool", "mask", "crop"])
def test_subset_run_and_metrics_from_saved_scores(tiny_clip, tmp_path, region, monkeypatch):
    make_images(SUBSET, tmp_path / "coco", noise=True)
    calls = []
    real = evaluate_mod.region_embeddings
    monkeypatch.setattr(evaluate_mod, "region_embeddings", lambda clip, rgb, anns, *a, **k: calls.append(len(anns)) or real(clip, rgb, anns, *a, **k))
    out = tmp_path / "res.json"
    res = evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "clearclip", region=region, settings=FAST, out=out, progress=False)
    assert sorted(calls) == [1, 2]  # one encoding per image, for all its annotations
    saved = json.loads(out.read_text())
    assert saved["metrics"] == res["metrics"]
    assert saved["kind"] == "fgovd" and saved["schema"] == 1
    cfg = saved["config"]
    assert cfg["region"] == region and cfg["attention"] == "qq/softmax/nores/noffn" and cfg["benchmarks"] == ["transparency"]
    assert cfg["resolution"] == 64 and cfg["window"] == 0 and cfg["negatives"] == 10 and cfg["templates"] == "none"
    assert set(saved["timing"]) >= {"wall_s", "annotations_per_s"} and "torch" in saved["versions"]
    assert [r["id"] for r in saved["per_annotation"]] == [66, 68, 114]
    assert all(len(r["scores"]) == 3 and all(-1 <= s <= 1 for s in r["scores"]) for r in saved["per_annotation"])
    for n in (1, 2):
        top1, mean, median = _recompute(saved["per_annotation"], "transparency", n)
        assert saved["metrics"][f"transparency.top1@{n}"] == pytest.approx(top1)
        assert saved["metrics"][f"transparency.mean_rank@{n}"] == pytest.approx(mean)
        assert saved["metrics"][f"transparency.median_rank@{n}"] == pytest.approx(median)
    assert saved["metrics"]["transparency.count@3"] == 0 and "transparency.top1@3" not in saved["metrics"]


def test_images_shared_by_several_files_are_encoded_once(tiny_clip, tmp_path, monkeypatch):
    make_images(SUBSET, tmp_path / "coco", noise=True)
    files = []
    for stem in ("1_attributes", "2_attributes", "3_attributes"):
        files.append(tmp_path / f"{stem}.json")
        files[-1].write_text(SUBSET.read_text())
    calls = []
    real = evaluate_mod.region_embeddings
    monkeypatch.setattr(evaluate_mod, "region_embeddings", lambda clip, rgb, anns, *a, **k: calls.append(len(anns)) or real(clip, rgb, anns, *a, **k))
    res = evaluate_fgovd(tiny_clip, files, tmp_path / "coco", "sclip", settings=FAST, negatives=2, progress=False)
    assert sorted(calls) == [3, 6]  # two images, each with its regions from all three files
    assert res["config"]["benchmarks"] == ["hard", "medium", "easy"] and len(res["per_annotation"]) == 9
    m = res["metrics"]
    for n in (1, 2):
        assert m[f"mean.top1@{n}"] == pytest.approx((m[f"hard.top1@{n}"] + m[f"medium.top1@{n}"] + m[f"easy.top1@{n}"]) / 3)
    with pytest.raises(ValueError, match="once"):
        evaluate_fgovd(tiny_clip, [files[0], files[0]], tmp_path / "coco", "sclip", settings=FAST, progress=False)


def test_scores_are_cosines_with_captions_as_written(tiny_clip, tmp_path):
    make_images(SUBSET, tmp_path / "coco", noise=True)
    res = evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "clip", region="crop", settings=FAST, progress=False)
    bench = read_benchmark(SUBSET)
    ann = bench.annotations[2]  # id 114, alone on image 245026
    rgb = np.asarray(Image.open(tmp_path / "coco" / ann.file_name))
    image = encode_crops(tiny_clip, rgb, [ann.box], AttentionSpec())[0]
    text = F.normalize(tiny_clip.encode_text(list(ann.captions)), dim=-1)
    rec = next(r for r in res["per_annotation"] if r["id"] == 114)
    assert np.allclose(rec["scores"], (text @ image).tolist(), atol=1e-5)


def test_real_file_with_limit_and_n_filter(tiny_clip, tmp_path):
    entries = make_images(FULL, tmp_path / "coco", count=4)
    res = evaluate_fgovd(tiny_clip, [FULL], tmp_path / "coco", "sclip", settings=FAST, limit=4, negatives=4, progress=False)
    raw = json.loads(FULL.read_text())
    ids = {im["id"] for im in entries}
    anns = [a for a in raw["annotations"] if a["image_id"] in ids]
    assert sorted(r["id"] for r in res["per_annotation"]) == sorted(a["id"] for a in anns)
    for n in range(1, 5):
        assert res["metrics"][f"transparency.count@{n}"] == sum(len(a["neg_category_ids"]) >= n for a in anns)
    lengths = {r["id"]: len(r["scores"]) for r in res["per_annotation"]}
    assert all(lengths[a["id"]] == 1 + min(4, len(a["neg_category_ids"])) for a in anns)


def test_resume_after_interruption_gives_the_same_result(tiny_clip, tmp_path, monkeypatch):
    make_images(SUBSET, tmp_path / "coco", noise=True)
    out = tmp_path / "res.json"
    kwargs = dict(settings=FAST, out=out, progress=False)
    full = evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "sclip", **kwargs)
    log = progress_path(out)
    lines = log.read_text().splitlines()
    assert len(lines) == 3  # header + one line per image
    log.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:25])  # killed while writing the second image
    out.unlink()
    calls = []
    real = evaluate_mod.region_embeddings
    monkeypatch.setattr(evaluate_mod, "region_embeddings", lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed = evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "sclip", **kwargs)
    assert len(calls) == 1 and resumed["timing"]["resumed_images"] == 1
    assert resumed["metrics"] == full["metrics"] and resumed["per_annotation"] == full["per_annotation"]
    assert resumed["config"] == full["config"]
    # a finished result is returned, not recomputed
    assert evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "sclip", **kwargs)["created"] == resumed["created"]
    assert len(calls) == 1
    with pytest.raises(ConfigMismatchError, match="overwrite"):
        evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "clearclip", **kwargs)
    again = evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "clearclip", overwrite=True, **kwargs)
    assert len(calls) == 3 and again["config"]["attention"] == "qq/softmax/nores/noffn"
    # a partial log of another configuration is refused too, unless the run restarts
    out.unlink()
    with pytest.raises(ConfigMismatchError):
        evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "sclip", **kwargs)
    assert evaluate_fgovd(tiny_clip, [SUBSET], tmp_path / "coco", "sclip", resume=False, **kwargs)["metrics"] == full["metrics"]


def test_missing_image_and_bad_inputs(tiny_clip, tmp_path):
    root = tmp_path / "coco"
    make_images(SUBSET, root, count=1)  # 213224 only: 245026 is missing
    with pytest.raises(MissingImageError) as e:
        evaluate_fgovd(tiny_clip, [SUBSET], root, "clip", settings=FAST, progress=False)
    msg = str(e.value)
    assert "val2017/000000245026.jpg" in msg and "annotation id 114" in msg and "\n" not in msg
    with pytest.raises(MissingImageError, match="pass its parent"):
        evaluate_fgovd(tiny_clip, [SUBSET], root / "val2017", "clip", settings=FAST, progress=False)
    # limit 1 needs only the first image
    assert len(evaluate_fgovd(tiny_clip, [SUBSET], root, "clip", settings=FAST, limit=1, progress=False)["per_annotation"]) == 2
    # an image of the wrong size
    Image.new("RGB", (10, 10)).save(root / "val2017" / "000000245026.jpg")
    with pytest.raises(ValueError, match="declares 640x424"):
        evaluate_fgovd(tiny_clip, [SUBSET], root, "clip", settings=FAST, progress=False)
    # --region mask without a segmentation
    data = json.loads(SUBSET.read_text())
    data["annotations"][2].pop("segmentation")
    nomask = tmp_path / "nomask" / "transparency.json"
    nomask.parent.mkdir()
    nomask.write_text(json.dumps(data))
    with pytest.raises(BenchmarkFormatError, match="annotation id 114.*'segmentation'"):
        evaluate_fgovd(tiny_clip, [nomask], root, "clip", region="mask", settings=FAST, progress=False)
    # a degenerate polygon (a line) rasterises to nothing
    data["annotations"][2]["segmentation"] = [[530.0, 320.0, 560.0, 320.0, 545.0, 320.0]]
    nomask.write_text(json.dumps(data))
    make_images(SUBSET, root)
    with pytest.raises(ValueError, match="annotation id 114 .*'segmentation' covers no pixel"):
        evaluate_fgovd(tiny_clip, [nomask], root, "clip", region="mask", settings=FAST, progress=False)


def test_cli_fgovd(tmp_path):
    root = tmp_path / "coco"
    make_images(SUBSET, root)
    out = tmp_path / "r.json"
    args = ["fgovd", "-b", str(SUBSET), "--images", str(root), "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--resolution", "64", "--window", "0", "--negatives", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "transparency" in res.stdout and "top-1" in res.stdout
    assert "text: " in res.stderr and "prompts/s" in res.stderr  # the captions' progress bar
    saved = json.loads(out.read_text())
    assert saved["config"]["attention"] == "qq+kk/softmax" and saved["config"]["negatives"] == 2  # sclip for pool
    res = CliRunner().invoke(app, [*args, "--region", "crop", "--resolution", "64", "--out", str(out)])
    assert res.exit_code == 2 and "overwrite" in res.output
    res = CliRunner().invoke(app, [*args, "--region", "crop", "--scale-factor", "1.5", "--out", str(out), "--overwrite"])
    assert res.exit_code == 0, res.output
    saved = json.loads(out.read_text())
    assert saved["config"]["attention"] == "qk/softmax" and saved["config"]["scale_factor"] == 1.5  # clip for crop
    res = CliRunner().invoke(app, ["fgovd", "-b", str(SUBSET), "--images", str(tmp_path / "nowhere"), "--model", TINY_CONFIG, "--pretrained", "none"])
    assert res.exit_code == 2 and "images root" in res.output
    bad = tmp_path / "color.json"
    bad.write_text(json.dumps({"images": [], "annotations": [{"id": 5}], "categories": []}))
    res = CliRunner().invoke(app, ["fgovd", "-b", str(bad), "--images", str(root), "--model", TINY_CONFIG, "--pretrained", "none"])
    assert res.exit_code == 2 and "annotation #0 (id 5): field 'image_id'" in res.output


def test_cli_fgovd_checks_files_before_loading_a_model(tmp_path):
    res = CliRunner().invoke(app, ["fgovd", "-b", str(tmp_path / "1_attributes.json"), "--images", str(tmp_path), "--model", "no-such-model"])
    assert res.exit_code == 2 and "benchmark file not found" in res.output
    (tmp_path / "hard.json").write_text("{}")
    res = CliRunner().invoke(app, ["fgovd", "-b", str(tmp_path / "hard.json"), "--images", str(tmp_path), "--model", "no-such-model"])
    assert res.exit_code == 2 and "1_attributes" in res.output


def test_cli_fgovd_help():
    res = CliRunner().invoke(app, ["fgovd", "--help"])
    assert res.exit_code == 0 and "--region" in res.output and "--scale-factor" in res.output


@pytest.mark.parametrize("preset, stage", [("trident", "sam:1.2"), ("clipsurgery", "surgery"), ("pearl", "tlp:80")])
def test_cli_fgovd_refuses_stages_it_cannot_run_before_loading_a_model(tmp_path, preset, stage):
    """FG-OVD pools dense features: a preset's class-map, label or whole-image stages would be skipped
    silently, so they are refused by name, before any model loads."""
    res = CliRunner().invoke(app, ["fgovd", "-b", str(SUBSET), "--images", str(tmp_path), "--preset", preset, "--model", "no-such-model"])
    assert res.exit_code == 2 and f"cannot run stage(s) {stage}" in res.output, res.output


def test_fgovd_runs_token_stages_and_refuses_the_others(tmp_path, tiny_clip):
    root = tmp_path / "coco"
    make_images(SUBSET, root)
    with pytest.raises(ValueError, match="cannot run stage\\(s\\) tlp:80"):
        evaluate_fgovd(tiny_clip, [SUBSET], root, "pearl", settings=FAST, progress=False)
    with pytest.raises(ValueError, match="cannot run stage\\(s\\) pamr"):
        evaluate_fgovd(tiny_clip, [SUBSET], root, "sclip", settings=FAST.replace(stages=("pamr",)), progress=False)
    spec = "qq+kk/softmax/hook:lof"  # SC-CLIP's LOF edits the features: a token stage (31 neighbours: 128 px)
    result = evaluate_fgovd(tiny_clip, [SUBSET], root, spec, settings=FAST.replace(resolution=128), progress=False, limit=1)
    assert result["config"]["attention"] == str(resolve_spec(spec))
    plain = evaluate_fgovd(tiny_clip, [SUBSET], root, "qq+kk/softmax", settings=FAST.replace(resolution=128), progress=False, limit=1)
    scores = [np.array([a["scores"] for a in r["per_annotation"]]) for r in (result, plain)]
    assert scores[0].shape == scores[1].shape and not np.allclose(*scores)  # the stage ran: it moved the region scores
