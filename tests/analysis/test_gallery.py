"""The HTML gallery from eval --save-pred and segment folders, read as HTML and opened in headless Chromium."""

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from browser import run_chromium, screenshot
from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets import DATASETS
from clipseg_sparse.evaluation.segmentation import evaluate
from clipseg_sparse.analysis.gallery import write_gallery
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.files.outputs import OutputOptions, write_outputs
from clipseg_sparse.segment.images import load_image

ADE_ROOT = Path(__file__).parents[1] / "data" / "ade20k"
FAST = dict(resolution=64, window=32, stride=16)
SPECS = ("clearclip", "clearclip-entmax")


@pytest.fixture(scope="module")
def folders(tiny_clip, tmp_path_factory):
    """eval --save-pred folders and segment output folders of two specs over the three ADE20K fixtures."""
    root = tmp_path_factory.mktemp("gallery")
    bench = DATASETS.get("ade20k")
    for spec in SPECS:
        evaluate(tiny_clip, "ade20k", ADE_ROOT, spec, overrides=FAST, save_pred=root / f"pred-{spec}", templates="single", progress=False)
        segmenter = Segmenter(tiny_clip, "wall,sky,tree", spec, InferenceSettings(**FAST), templates="single")
        for sample in bench.samples(ADE_ROOT)[:2]:
            rgb = load_image(sample.image)
            write_outputs(root / f"seg-{spec}" / "city" / sample.id, sample.image, rgb, segmenter.predict(rgb), OutputOptions())
    return root


def _loop_miou(pred: np.ndarray, label: np.ndarray, num_classes: int) -> float:
    ious = []
    for c in range(num_classes):
        keep = label != 255
        inter = np.sum((pred == c) & (label == c) & keep)
        union = np.sum(((pred == c) | (label == c)) & keep)
        if union:
            ious.append(inter / union)
    return 100 * float(np.mean(ious))


def _rows(page: str) -> list[str]:
    return re.findall(r'<tr data-key="([^"]+)"', page)


def test_prediction_gallery_has_every_panel_and_the_per_image_miou(folders, tmp_path):
    bench = DATASETS.get("ade20k")
    cols = [f"softmax={folders / 'pred-clearclip'}", f"entmax={folders / 'pred-clearclip-entmax'}"]
    out, gallery = write_gallery(cols, tmp_path / "g.html", "ade20k", ADE_ROOT)
    page = out.read_text()
    assert gallery.columns == ["softmax", "entmax"] and list(gallery.rows) == [s.id for s in bench.samples(ADE_ROOT)]
    assert page.count("<img ") == 3 * 2 and "<th>softmax</th>" in page and "<th>entmax</th>" in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page  # one self-contained file
    for sample in bench.samples(ADE_ROOT):
        label = bench.load_label(sample.label)
        for i, spec in enumerate(SPECS):
            expected = _loop_miou(bench.load_label(folders / f"pred-{spec}" / f"{sample.id}.png"), label, bench.num_classes)
            assert gallery.rows[sample.id][i].miou == pytest.approx(expected)
            assert f'data-miou-{i}="{expected:.4f}"' in page
    thumb = gallery.rows[bench.samples(ADE_ROOT)[0].id][0].image
    assert thumb.startswith("data:image/jpeg;base64,")
    with pytest.raises(ValueError, match="exists"):
        write_gallery(cols, out, "ade20k", ADE_ROOT)


def test_segment_gallery_names_columns_by_spec_and_keeps_legends(folders, tmp_path):
    import base64
    import io

    out, gallery = write_gallery([str(folders / "seg-clearclip"), str(folders / "seg-clearclip-entmax")], tmp_path / "s.html")
    assert gallery.columns == ["qq/softmax/nores/noffn", "qq/entmax:1.5/nores/noffn"]
    assert list(gallery.rows) == ["city/ADE_val_00000001", "city/ADE_val_00000002"] and not gallery.has_miou
    page = out.read_text()
    assert page.count("<img ") == 2 * 2 and "sort-diff" not in page
    thumb = Image.open(io.BytesIO(base64.b64decode(gallery.rows["city/ADE_val_00000001"][0].image.split(",", 1)[1])))
    image = Image.open(ADE_ROOT / "ADEChallengeData2016/images/validation/ADE_val_00000001.jpg")
    assert thumb.width == 360 and thumb.height < 360 * image.height / image.width  # the legend panel widens the overlay


def test_gallery_cli_errors_are_one_line(folders, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["report", str(folders / "pred-clearclip"), "--html", str(tmp_path / "x.html")])
    assert r.exit_code == 2 and "--dataset and --root" in r.stderr.strip().splitlines()[-1]
    r = runner.invoke(app, ["report", str(tmp_path / "nope"), "--html", str(tmp_path / "x.html")])
    assert r.exit_code == 2 and "not a folder" in r.stderr
    r = runner.invoke(app, ["report", str(folders / "pred-clearclip"), "--html", str(tmp_path / "x.html"), "--dataset", "ade20k", "--root", str(ADE_ROOT)])
    assert r.exit_code == 0 and (tmp_path / "x.html").is_file(), r.output


def test_gallery_in_headless_chromium_renders_without_console_errors_and_sorts(folders, tmp_path):
    bench = DATASETS.get("ade20k")
    out, gallery = write_gallery([str(folders / "pred-clearclip"), str(folders / "pred-clearclip-entmax")], tmp_path / "g.html", "ade20k", ADE_ROOT)
    shot = tmp_path / "shot.png"
    console = screenshot(out.as_uri(), shot, width=1000, height=800)
    assert console == []  # no errors, no messages
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape == (800, 1000, 3)
    assert img.std() > 20 and len(np.unique(img.reshape(-1, 3), axis=0)) > 500  # not blank: overlays drawn
    assert (img[:60, :300] < 100).all(-1).any()  # the dark title text at the top left

    # page.html#sort=1-0 opens sorted by mIoU(entmax) - mIoU(softmax), largest first (stable for ties)
    dom, console = run_chromium(out.as_uri() + "#sort=1-0", "--dump-dom")
    assert console == []
    labels = {s.id: bench.load_label(s.label) for s in bench.samples(ADE_ROOT)}
    miou = {k: [round(_loop_miou(bench.load_label(folders / f"pred-{spec}" / f"{k}.png"), lab, 150), 4) for spec in SPECS] for k, lab in labels.items()}
    expected = sorted(sorted(labels), key=lambda k: -(miou[k][1] - miou[k][0]))
    assert _rows(dom) == expected
    d = miou[expected[0]][1] - miou[expected[0]][0]
    assert re.findall(r'<td class="diff">([^<]*)</td>', dom)[0] == ("+" if d > 0 else "") + f"{d:.2f}"
