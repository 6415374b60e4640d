"""explain: the query patch's attention row, its statistics, and the figure's panels and titles."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.attention import attention_maps, resolve_spec
from clipseg_sparse.cli.app import app
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.analysis.explain import attention_image, explain, query_patch, render_explain, write_explain
from clipseg_sparse.segment.preprocess import to_pixels
from clipseg_sparse.segment.settings import InferenceSettings
from conftest import TINY_CONFIG
from test_common import TINY_CPU, cache_dir, no_model, one_line, invoke  # noqa: F401 (fixtures)
from test_corrclip import TINY as CORRCLIP, region_map
from test_proxyclip import proxy  # noqa: F401  (fixture: tiny CLIP + tiny DINO installed as dino_vitb8)
from clipseg_sparse.segment.regions import RegionFolder
from clipseg_sparse.segment.bank import ImageBank
from test_bank import TINY_V2 as CORRCLIPV2, models  # noqa: F401  (fixture: tiny CLIP, aux CLIP, tiny RADIO as c_radio_v3_l)
from test_corrclipv2 import Given, deep_bank, deep_clip, radio  # noqa: F401  (fixtures: 24-block tiny CLIP, its bank, tiny RADIO)

SETTINGS = InferenceSettings(resolution=64, window=32, stride=16)


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)  # resized to 64 x 107 -> a 4 x 7 grid


def test_query_patch_maps_original_pixels_to_the_resized_grid():
    assert query_patch((0, 0), (48, 80), (64, 107), 16) == (0, 0)
    assert query_patch((79, 47), (48, 80), (64, 107), 16) == (3, 6)  # 47*64/48 = 62.7 -> row 3; 79*107/80 = 105.7 -> col 6
    assert query_patch((12, 24), (48, 80), (64, 107), 16) == (2, 1)  # 24*64/48 = 32 -> row 2; 12*107/80 = 16.05 -> col 1
    with pytest.raises(ValueError, match="outside"):
        query_patch((80, 0), (48, 80), (64, 107), 16)


def test_views_hold_the_query_row_and_its_statistics(tiny_clip, image):
    views = explain(tiny_clip, image, "a,b,c", ["qq/softmax", "qq/entmax:1.5"], (60, 30), SETTINGS, templates="single")
    assert [v.spec for v in views] == ["qq/softmax", "qq/entmax:1.5"]
    soft, sparse = views
    assert soft.query == (2, 5) and soft.attention.shape == (4, 7) and soft.labels.shape == (48, 80)
    # independent: the row of patch (2, 5) in a whole-image forward, normalised, CLS dropped, head mean
    pixels = F.pad(to_pixels(image, tiny_clip, (64, 107)), (0, 5, 0, 0))
    rows = attention_maps(tiny_clip, pixels, "qq/entmax:1.5")[0, :, 1 + 2 * 7 + 5].double()
    rows = rows / rows.sum(-1, keepdim=True)
    np.testing.assert_allclose(sparse.attention, rows.mean(0)[1:].reshape(4, 7).numpy(), atol=1e-6)
    entropies = [-sum(p * math.log(p) for p in r.tolist() if p > 0) for r in rows]
    assert sparse.entropy == pytest.approx(np.mean(entropies), rel=1e-6)
    assert sparse.support == pytest.approx(np.mean(np.exp(entropies)), rel=1e-6)
    assert sparse.nonzero == pytest.approx((rows > 0).sum(-1).double().mean().item())
    assert soft.nonzero == soft.tokens == 29 and sparse.nonzero < 29 and (sparse.attention == 0).any()
    one = explain(tiny_clip, image, "a,b,c", ["qq/entmax:1.5"], (60, 30), SETTINGS, templates="single", head=1)[0]
    np.testing.assert_allclose(one.attention, rows[1, 1:].reshape(4, 7).numpy(), atol=1e-6)
    assert one.heads == "head 1" and "head 1" in one.title
    no_cls = explain(tiny_clip, image, "a", ["qq/softmax/cls:0.3"], (60, 30), SETTINGS, templates="single")[0]
    assert no_cls.tokens == 28 and no_cls.attention.sum() == pytest.approx(1.0)  # cls:C: patches only
    with pytest.raises(ValueError, match="head 7"):
        explain(tiny_clip, image, "a", ["qq/softmax"], (0, 0), SETTINGS, templates="single", head=7)


def test_exact_zeros_are_drawn_grey_and_the_support_in_colour(tiny_clip, image):
    view = explain(tiny_clip, image, "a,b", ["kk/sparsemax"], (5, 5), SETTINGS, templates="single")[0]
    drawn = attention_image(view).astype(int)
    assert drawn.shape == (48, 80, 3)
    cell_h, cell_w = view.scale
    for (r, c), value in np.ndenumerate(view.attention):
        y, x = int((r + 0.5) * cell_h), int((c + 0.5) * cell_w)  # the centre of a grid cell
        if y >= 48 or x >= 80 or (abs(y - 5) < 12 and abs(x - 5) < 12):
            continue  # off the image, or under the ring drawn around the point
        grey = drawn[y, x, 0] == drawn[y, x, 1] == drawn[y, x, 2]
        assert grey == (value == 0), (r, c, value, drawn[y, x])


def test_figure_has_two_titled_panels_per_spec_and_the_expected_size(tiny_clip, image, tmp_path):
    specs = ["sclip", "sclip-entmax", "qq/randmask:1.5"]
    views = explain(tiny_clip, image, "a,b", specs, (40, 20), SETTINGS, templates="single")
    fig = render_explain(views, caption="random weights")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2 * len(specs)
    titles = [ax.get_title() for ax in axes]
    for i, view in enumerate(views):
        assert titles[2 * i].startswith(view.spec) and "entropy" in titles[2 * i] and "support" in titles[2 * i]
        assert titles[2 * i + 1] == f"{view.spec}: segmentation"
    assert fig._suptitle.get_text() == "random weights"
    path = write_explain(views, tmp_path / "x.png", dpi=50)
    width, height = Image.open(path).size
    assert width == 500 and height == round(50 * len(specs) * (10 / 2 * 48 / 80 + 0.8))


def test_explain_cli_writes_the_png_and_refuses_bad_input(tmp_path, image, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "img.png"
    Image.fromarray(image).save(src)
    runner = CliRunner()
    args = ["explain", str(src), "--classes", "a,b", "--preset", "clearclip", "--preset", "clearclip-entmax",
            "--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--resolution", "64"]  # fmt: skip
    out = tmp_path / "e.png"
    result = runner.invoke(app, [*args, "--point", "10,10", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert Image.open(out).size[0] == 1000 and "qq/entmax:1.5/nores/noffn: entropy" in result.stdout
    again = runner.invoke(app, [*args, "--point", "10,10", "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.stderr
    for point, message in (("10", "expected X,Y"), ("500,5", "outside")):
        bad = runner.invoke(app, [*args, "--point", point, "--out", str(tmp_path / "f.png")])
        assert bad.exit_code == 2 and message in bad.stderr.strip().splitlines()[-1], bad.stderr


@pytest.mark.parametrize("protocol", PROTOCOLS.names())
def test_explain_attends_over_the_pixels_eval_scores(tiny_clip, image, protocol, forward_inputs):
    """explain's whole-image forward sees what eval's whole-image forward sees under every protocol
    (its resize, positional-embedding rule, remainder rule and rounding)."""
    settings = PROTOCOLS.get(protocol).settings("ade20k", dict(resolution=56, window=0)).replace(stages=())
    explain(tiny_clip, image, "a,b", ["qq/softmax"], (60, 30), settings, templates="single")
    explained = forward_inputs[:]
    forward_inputs.clear()
    Segmenter(tiny_clip, "a,b", "qq/softmax", settings, templates="single").predict(image)
    ((evaluated, eval_rule),) = forward_inputs
    assert len(explained) == 2  # the attention, then the segmentation
    for pixels, rule in explained:
        assert rule == eval_rule and torch.equal(pixels, evaluated)


REGION_SETTINGS = InferenceSettings(resolution=0, window=64, stride=32)


def _segmented_point(regions: np.ndarray) -> tuple[int, int]:
    """(x, y) in the middle of the last 8 x 8 cell (DINO ViT-B/8's patch) that lies in a region (id >= 0):
    past the first row and column, where CLIP's 16-pixel grid would name another cell."""
    row, col = np.argwhere(regions[::8, ::8] >= 0)[-1]
    assert row > 0 and col > 0
    return int(col) * 8 + 4, int(row) * 8 + 4


def test_explain_reads_the_region_map_for_the_attention_and_the_segmentation(proxy, tmp_path):  # noqa: F811
    """CorrCLIP's attention was unexplainable (explain built its Segmenter without a region source): the
    region map scopes the attention row, on DINO's patch-8 grid, and the labels are the Segmenter's."""
    clip, _ = proxy
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    regions = region_map(rng, 64, 96).numpy()
    np.save(tmp_path / "photo.npy", regions.astype(np.int32))
    source, spec = RegionFolder(tmp_path), CORRCLIP.format(eps=0.2, norm="entmax:1.5")
    x, y = _segmented_point(regions)
    with pytest.raises(ValueError, match=r"needs region masks for each image: give --regions FOLDER"):
        explain(clip, rgb, "cat,dog,sky", [spec], (x, y), REGION_SETTINGS, templates="single")
    view = explain(clip, rgb, "cat,dog,sky", [spec], (x, y), REGION_SETTINGS, templates="single", regions=source, name="photo.jpg")[0]
    segmenter = Segmenter(clip, "cat,dog,sky", spec, REGION_SETTINGS, templates="single", regions=source)
    assert np.array_equal(view.labels, segmenter.predict_labels(rgb, "photo.jpg"))
    assert view.attention.shape == (8, 12) and view.query == (y // 8, x // 8) and view.scale == (8.0, 8.0) and view.tokens == 96
    # independent: the query's row of the whole image's attention under its region map (no CLS: cls:0)
    maps = clip.attention_maps(to_pixels(rgb, clip, (64, 96)), spec, regions=torch.from_numpy(regions).long()[None])[0]
    rows = maps[:, view.query[0] * 12 + view.query[1]].double()
    rows = rows / rows.sum(-1, keepdim=True)
    np.testing.assert_allclose(view.attention, rows.mean(0).reshape(8, 12).numpy(), atol=1e-6)
    ids = regions[::8, ::8]  # the map nearest-resized to the 8 x 12 grid
    other = (ids >= 0) & (ids != ids[view.query])
    assert other.any() and (view.attention[other] == 0).all()  # the query's region scopes its row
    # a path names its own region file
    (tmp_path / "images").mkdir()
    Image.fromarray(rgb).save(tmp_path / "images" / "photo.png")
    by_path = explain(clip, tmp_path / "images" / "photo.png", "cat,dog,sky", [spec], (x, y), REGION_SETTINGS, templates="single", regions=source)[0]
    np.testing.assert_array_equal(by_path.attention, view.attention)


def test_explain_cli_regions(proxy, tmp_path, monkeypatch):  # noqa: F811
    """explain --regions as segment: a folder (or sam2 / sam3); a preset that reads regions without it, a
    missing folder or a folder without the image's file stop it in one line before the model loads."""
    import clipseg_sparse.cli.analysis as cli

    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    (tmp_path / "masks").mkdir()
    spec = CORRCLIP.format(eps=0.2, norm="softmax")
    args = ["explain", str(tmp_path / "img.png"), "--classes", "cat,dog", "--attn", spec, "--point", "10,10", "--model", TINY_CONFIG,
            "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", "64", "--out", str(tmp_path / "e.png")]  # fmt: skip
    runner = CliRunner()
    with monkeypatch.context() as m:
        m.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the --regions check"))
        for extra, message in (
            ([], f"attention {spec} needs region masks for each image: give --regions FOLDER"),
            (["--regions", str(tmp_path / "masks")], "no region masks for 1 image(s) in"),
            (["--regions", str(tmp_path / "nowhere")], "nowhere: region-mask folder not found"),
        ):
            res = runner.invoke(app, [*args, *extra], env={"COLUMNS": "300"})
            lines = [line for line in res.output.splitlines() if line.strip()]
            assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    Image.fromarray((region_map(rng, 64, 96).numpy() + 1).astype(np.uint8)).save(tmp_path / "masks" / "img.png")
    res = runner.invoke(app, [*args, "--regions", str(tmp_path / "masks")], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert f"{spec}: entropy" in res.stdout and Image.open(tmp_path / "e.png").size[0] == 1000


def test_explain_cli_takes_proxy_weights_as_segment(tmp_path, monkeypatch):
    """--proxy-weights reaches the external backbones of the explained specs: a checkpoint that does not exist
    stops the command in one line naming it, before any image is read."""
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    missing = tmp_path / "dino.pth"
    args = ["explain", str(tmp_path / "img.png"), "--classes", "cat,dog", "--attn", "ext:dino_vitb16[cos]/softmax/cls:0/noffn", "--point", "10,10",
            "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu", "--proxy-weights", f"dino_vitb16={missing}", "--out", str(tmp_path / "e.png")]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and str(missing) in lines[0], res.output
    assert not (tmp_path / "e.png").exists()


def _bank(models, folder):
    """An image bank of two small images built with the models' CLIP (values) and tiny RADIO (keys)."""
    from test_bank import build, write_images

    clip, _, radio = models
    jobs, regions = write_images(folder / "images", 2)
    build(folder / "bank", jobs, regions, [clip], radio)
    return ImageBank.open(folder / "bank")


def test_explain_corrclipv2_gets_the_whole_image_features_and_the_bank(models, tmp_path):
    """CorrCLIPv2 was unexplainable: its `ext:c_radio_v3_l.image` taps read whole-image features that the
    attention forward was not given, and its retrieval stage needs a bank. The row is the whole image's
    attention under the backbone's features of the image and its region map; the labels are the Segmenter's
    with the same regions and bank (the bank acts after the attention)."""
    clip, _, radio = models
    bank = _bank(models, tmp_path)
    rng = np.random.default_rng(6)
    rgb = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    regions = region_map(rng, 64, 96).numpy()
    source, point = Given(regions), _segmented_point(regions)
    with pytest.raises(ValueError, match=r"stage retrieve:3:0.5 needs an image bank: give --bank BANK"):
        explain(clip, rgb, "cat,dog,sky", [CORRCLIPV2], point, REGION_SETTINGS, templates="single", regions=source)
    view = explain(clip, rgb, "cat,dog,sky", [CORRCLIPV2], point, REGION_SETTINGS, templates="single", regions=source, bank=bank)[0]
    segmenter = Segmenter(clip, "cat,dog,sky", CORRCLIPV2, REGION_SETTINGS, templates="single", regions=source, bank=bank)
    assert np.array_equal(view.labels, segmenter.predict_labels(rgb, "photo.png"))
    assert view.attention.shape == (8, 12) and view.query == (point[1] // 8, point[0] // 8) and view.tokens == 96
    # independent: the whole image's attention with RADIO's features of it at the input size and the region map
    features = {"c_radio_v3_l": radio.image_features(torch.from_numpy(rgb), (64, 96))}
    maps = clip.attention_maps(to_pixels(rgb, clip, (64, 96)), CORRCLIPV2, torch.from_numpy(regions)[None], context={"image_features": features})[0]
    rows = maps[:, view.query[0] * 12 + view.query[1]].double()
    rows = rows / rows.sum(-1, keepdim=True)
    np.testing.assert_allclose(view.attention, rows.mean(0).reshape(8, 12).numpy(), atol=1e-6)
    ids = regions[::8, ::8]
    other = (ids >= 0) & (ids != ids[view.query])
    assert other.any() and (view.attention[other] == 0).all()  # region-scoped, as CorrCLIP's
    # the features are what the score reads: other features give another row
    shuffled = {"c_radio_v3_l": features["c_radio_v3_l"].flip(-1)}
    moved = clip.attention_maps(to_pixels(rgb, clip, (64, 96)), CORRCLIPV2, torch.from_numpy(regions)[None], context={"image_features": shuffled})[0]
    assert not torch.allclose(moved[:, view.query[0] * 12 + view.query[1]].double(), maps[:, view.query[0] * 12 + view.query[1]].double())


def test_explain_cli_bank(models, tmp_path, monkeypatch):
    """explain --bank as segment: a retrieval preset without it, or a folder that is no bank, stops in one line
    before the model loads; with it, the command draws the spec (a spec without retrieval notes it unused)."""
    import clipseg_sparse.cli.analysis as cli

    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    _bank(models, tmp_path)
    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    (tmp_path / "masks").mkdir()
    np.save(tmp_path / "masks" / "img.npy", region_map(rng, 64, 96).numpy().astype(np.int32))
    common = ["explain", str(tmp_path / "img.png"), "--classes", "cat,dog", "--point", "10,10", "--model", TINY_CONFIG, "--pretrained", "none",
              "--device", "cpu", "--templates", "single", "--resolution", "64", "--regions", str(tmp_path / "masks")]  # fmt: skip
    runner = CliRunner()
    with monkeypatch.context() as m:
        m.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the --bank check"))
        for extra, message in (
            (["--preset", "corrclipv2"], "stage retrieve:20:0.5 needs an image bank: give --bank BANK (build one with `clipseg-sparse bank build`)"),
            (["--attn", CORRCLIPV2, "--bank", str(tmp_path / "images")], "not an image bank"),
        ):
            res = runner.invoke(app, [*common, *extra, "--out", str(tmp_path / "x.png")], env={"COLUMNS": "300"})
            lines = [line for line in res.output.splitlines() if line.strip()]
            assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    plain = CORRCLIPV2.removesuffix("/hook:retrieve:3:0.5")
    args = [*common, "--attn", CORRCLIPV2, "--attn", plain, "--bank", str(tmp_path / "bank"), "--out", str(tmp_path / "e.png")]
    res = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    lines = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    assert list(lines) == [str(resolve_spec(CORRCLIPV2)), plain] and Image.open(tmp_path / "e.png").size[0] == 1000
    assert lines[plain].startswith("entropy") and lines[str(resolve_spec(CORRCLIPV2))] == lines[plain]  # the bank acts after the attention
    unused = runner.invoke(app, [*common, "--attn", plain, "--bank", str(tmp_path / "bank"), "--out", str(tmp_path / "f.png")], env={"COLUMNS": "300"})
    assert unused.exit_code == 0 and "--bank" in unused.stderr and "unused" in unused.stderr, unused.output


def test_explain_runs_the_corrclipv2_presets(deep_bank, radio):  # noqa: F811
    """The presets themselves (blocks 6..10 of a 24-block tiny CLIP, hook:retrieve:20): labels as the
    Segmenter's, rows as the whole image's attention under RADIO's features of it."""
    clip, bank = deep_bank
    rng = np.random.default_rng(8)
    rgb = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    regions = region_map(rng, 64, 96).numpy()
    presets, point = ["corrclipv2", "corrclipv2-entmax"], _segmented_point(regions)
    views = explain(clip, rgb, "cat,dog,sky", presets, point, REGION_SETTINGS, templates="single", regions=Given(regions), bank=bank)
    features = {"c_radio_v3_l": radio.image_features(torch.from_numpy(rgb), (64, 96))}
    for preset, view in zip(presets, views):
        segmenter = Segmenter(clip, "cat,dog,sky", preset, REGION_SETTINGS, templates="single", regions=Given(regions), bank=bank)
        assert view.spec == str(resolve_spec(preset)) and np.array_equal(view.labels, segmenter.predict_labels(rgb))
        maps = attention_maps(clip, to_pixels(rgb, clip, (64, 96)), preset, torch.from_numpy(regions)[None], context={"image_features": features})[0]
        rows = maps[:, view.query[0] * 12 + view.query[1]].double()
        np.testing.assert_allclose(view.attention, (rows / rows.sum(-1, keepdim=True)).mean(0).reshape(8, 12).numpy(), atol=1e-6)
    assert views[0].nonzero > views[1].nonzero  # entmax drops some of softmax's support


def test_explain_refuses_a_repeated_class_name_before_the_model_loads(tmp_path, no_model):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "a.png")
    one_line(invoke("explain", tmp_path / "a.png", "--point", "1,1", "--classes", "sky,tree|sky", *TINY_CPU, "--out", tmp_path / "e.png"),
             "duplicate class name: 'sky'")  # fmt: skip
