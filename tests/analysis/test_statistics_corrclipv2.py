"""`analyze` on CorrCLIPv2 specs: the attention reads whole-image backbone features (`ext:NAME.image`) and
region maps, on a grid twice as fine as CLIP's; the retrieval stage acts after it (no bank). CorrCLIP v1's
spec (DINO B/8 q+k per window, same grid) runs the same way."""

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from clipseg_sparse.analysis.statistics import analyze
from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets import DATASETS
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.segment.preprocess import to_pixels
from clipseg_sparse.segment.regions import RegionFolder
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark_with_masks
from test_statistics import _loop_majority
from test_corrclip import TINY as CORRCLIP
from test_bank import TINY_V2, models  # noqa: F401  (fixture: tiny CLIP, aux CLIP, tiny RADIO as c_radio_v3_l)
from test_proxyclip import proxy  # noqa: F401  (the fixture `models` builds on)

OVERRIDES = dict(resolution=64, window=32, stride=16)  # 64 x 96 images: 3 x 5 whole windows, no resize, no padding


def _voc_with_masks(root):
    """Two 64 x 96 voc21 images and a blocky region map per sample id (-1 unsegmented)."""
    make_benchmark_with_masks("voc21", root, n=2, size=(64, 96))
    return DATASETS.get("voc21").samples(root / "voc")


def _loop_statistics(clip, radio, rgb, labels, regions, spec, pos_interp) -> tuple[int, dict]:
    """Per-window plain loops over `clip.attention_maps` of each 32-px window crop, given RADIO's whole-image
    features of the image cropped like the window (for specs that read them) and the region crop; labels by
    majority over 8-px cells."""
    pixels = to_pixels(rgb, clip, (64, 96))
    features = radio.image_features(torch.from_numpy(np.array(rgb)), (64, 96))
    sums, n = {"entropy": 0.0, "own_mass": 0.0, "nonzero": 0.0}, 0
    for y1 in (0, 16, 32):
        for x1 in (0, 16, 32, 48, 64):
            box = (slice(y1, y1 + 32), slice(x1, x1 + 32))
            context = {"image_features": {"c_radio_v3_l": features[..., box[0], box[1]]}} if ".image" in spec else None
            region = torch.from_numpy(regions[box].astype(np.int64))[None]
            maps = clip.attention_maps(pixels[..., box[0], box[1]], spec, region, pos_interp=pos_interp, context=context)[0].double().numpy()
            grid = _loop_majority(labels[box], 8)
            assert maps.shape[-1] == len(grid) == 16  # 2 x CLIP's 2 x 2 patch grid, no CLS (cls:0)
            for h in range(maps.shape[0]):
                for i, c in enumerate(grid):
                    if c < 0:
                        continue
                    row = maps[h, i] / maps[h, i].sum()
                    sums["entropy"] -= sum(p * math.log(p) for p in row if p > 0) / maps.shape[0]
                    sums["own_mass"] += sum(row[j] for j, d in enumerate(grid) if d == c) / maps.shape[0]
                    sums["nonzero"] += sum(p > 0 for p in row) / maps.shape[0]
                    n += h == 0
    return n, sums


@pytest.mark.parametrize("spec", [TINY_V2, CORRCLIP.format(eps=0.3, norm="softmax")])
def test_analyze_corrclipv2_measures_the_attention_the_forward_gets(models, tmp_path, spec):  # noqa: F811
    """analyze could not run CorrCLIPv2: its attention reads whole-image features the windows were not given
    (and, as CorrCLIP's, region maps, on a grid finer than CLIP's). Per image the statistics equal plain loops
    over `clip.attention_maps` with RADIO's features and the region map of each window; no bank is needed
    (retrieval acts after the attention)."""
    from clipseg_sparse.segment.images import load_image

    clip, _, radio = models
    samples = _voc_with_masks(tmp_path)
    source = RegionFolder(tmp_path / "masks")
    with pytest.raises(ValueError, match=r"needs region masks for each image: give --regions FOLDER"):
        analyze(clip, "voc21", tmp_path / "voc", spec, "corrclipv2", OVERRIDES, progress=False)
    record = analyze(clip, "voc21", tmp_path / "voc", spec, "corrclipv2", OVERRIDES, progress=False, regions=source)
    c = record["config"]
    assert c["regions"] == source.source() and list(c["proxy_backbones"]) == ["c_radio_v3_l" if spec == TINY_V2 else "dino_vitb8"]
    settings = PROTOCOLS.get("corrclipv2").settings("voc21", OVERRIDES)
    assert (settings.resize, settings.remainder) == ("torch", "pad")  # the loops' pixels are the protocol's
    bench = DATASETS.get("voc21")
    for sample in samples:
        regions = np.load(tmp_path / "masks" / f"{sample.id}.npy")
        n, sums = _loop_statistics(clip, radio, load_image(sample.image), bench.load_label(sample.label), regions, spec, settings.pos_interp)
        got = record["per_image"][sample.id]
        assert got["patches"] == n > 0
        for stat, total in sums.items():
            assert got[stat] == pytest.approx(total / n, rel=1e-6), stat
    assert record["metrics"]["nonzero"] < 16  # region-scoped rows: entries outside the query's region are exact zeros


def test_image_taps_without_the_features_fail_clearly(models):  # noqa: F811
    """The attention forward of an `ext:NAME.image` spec without whole-image features stops in one line."""
    clip = models[0]
    pixels = torch.zeros(1, 3, 32, 32)
    with pytest.raises(ValueError, match=r"ext:c_radio_v3_l.image reads whole-image features"):
        clip.attention_maps(pixels, TINY_V2, torch.zeros(1, 32, 32, dtype=torch.int64))


def test_analyze_cli_corrclipv2_takes_regions_and_no_bank(models, tmp_path, monkeypatch):  # noqa: F811
    """The preset without --regions stops in one line before the model loads; with --regions (and no --bank)
    it writes its result, which records the region source."""
    import clipseg_sparse.cli.analysis as cli

    _voc_with_masks(tmp_path)
    args = ["analyze", "--dataset", "voc21", "--root", str(tmp_path / "voc"), "--protocol", "corrclipv2", "--model", TINY_CONFIG,
            "--pretrained", "none", "--device", "cpu", "--resolution", "64", "--window", "32", "--stride", "16", "--out", str(tmp_path / "an")]  # fmt: skip
    runner = CliRunner()
    with monkeypatch.context() as m:
        m.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the --regions check"))
        res = runner.invoke(app, [*args, "--preset", "corrclipv2"], env={"COLUMNS": "300"})
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "needs region masks for each image: give --regions" in lines[0], res.output
    res = runner.invoke(app, [*args, "--attn", TINY_V2, "--regions", str(tmp_path / "masks")], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    (path,) = (tmp_path / "an").glob("*.json")
    record = json.loads(path.read_text())
    assert record["config"]["regions"] == RegionFolder(tmp_path / "masks").source() and record["num_images"] == 2
