"""explain: the query patch's attention row, its statistics, and the figure's panels and titles."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.analysis.explain import attention_image, explain, query_patch, render_explain, write_explain
from clipseg_sparse.segment.preprocess import to_pixels
from clipseg_sparse.segment.settings import InferenceSettings
from conftest import TINY_CONFIG

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
    from clipseg_sparse.attention import attention_maps

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
