import json

import numpy as np
import pytest
from PIL import Image

from clipseg_sparse.datasets.labels import PALETTE, label_image
from clipseg_sparse.segment.labels import SegmentationResult
from clipseg_sparse.files.outputs import OutputOptions, Status, coco_rle, overlay_image, write_outputs
from clipseg_sparse.registry import UnknownNameError

SETTINGS = {"model": "m", "attention": "qq/softmax", "batch_size": 16, "classes": [["cat"], ["dog"], ["sky"]]}


def make_result(height=20, width=30, seed=0) -> tuple[np.ndarray, SegmentationResult]:
    rng = np.random.default_rng(seed)
    probs = rng.random((3, height, width)).astype(np.float32)
    probs /= probs.sum(0)
    rgb = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    return rgb, SegmentationResult(probs.argmax(0), probs, ("cat", "dog", "sky"), dict(SETTINGS))


def test_palette_is_the_voc_colour_map():
    # colours of the PASCAL VOC ground-truth PNGs: background, aeroplane, bicycle, bird, boat, ..., person
    assert PALETTE[0].tolist() == [0, 0, 0]
    assert PALETTE[1].tolist() == [128, 0, 0]
    assert PALETTE[2].tolist() == [0, 128, 0]
    assert PALETTE[3].tolist() == [128, 128, 0]
    assert PALETTE[4].tolist() == [0, 0, 128]
    assert PALETTE[15].tolist() == [192, 128, 128]
    assert len({tuple(c) for c in PALETTE.tolist()}) == 256


def test_label_png_pixel_value_is_class_index(tmp_path):
    labels = np.arange(12).reshape(3, 4) * 20
    label_image(labels).save(tmp_path / "l.png")
    back = Image.open(tmp_path / "l.png")
    assert back.mode == "P" and np.array_equal(np.asarray(back), labels)
    assert back.getpalette()[3 * 20 : 3 * 21] == PALETTE[20].tolist()
    with pytest.raises(ValueError, match="coco-rle"):
        label_image(np.array([[256]]))


def test_overlay_blends_and_has_a_legend():
    rgb, result = make_result()
    img = overlay_image(rgb, result.labels, result.present(), result.class_names)
    arr = np.asarray(img).astype(int)
    assert img.height >= 20 and img.width > 30
    expected = (rgb.astype(int) + PALETTE[result.labels].astype(int)) / 2  # by hand: half image, half colour
    assert np.abs(arr[:20, :30] - expected).max() <= 0.5 + 1e-9
    legend = arr[:, 30:].reshape(-1, 3)
    for index in np.unique(result.labels):  # one swatch per class present
        assert (legend == PALETTE[index]).all(1).any()


def test_coco_rle_decodes_to_the_label_masks():
    from pycocotools import mask as mask_utils

    _, result = make_result()
    result.labels[result.labels == 1] = 0  # class 1 absent
    data = coco_rle(result.labels, result.class_names)
    assert [c["name"] for c in data["categories"]] == ["cat", "dog", "sky"]
    assert sorted(a["category_id"] for a in data["annotations"]) == [0, 2]
    for ann in data["annotations"]:
        mask = mask_utils.decode(ann["segmentation"])
        assert np.array_equal(mask.astype(bool), result.labels == ann["category_id"])
        assert ann["area"] == int((result.labels == ann["category_id"]).sum())


def test_write_and_status_cycle(tmp_path):
    rgb, result = make_result()
    base = tmp_path / "out" / "sub" / "img"
    opts = OutputOptions(save_probs=True)
    assert opts.status(base, SETTINGS)[0] is Status.todo
    record = write_outputs(base, tmp_path / "img.jpg", rgb, result, opts)
    assert sorted(p.name for p in base.parent.iterdir()) == ["img.json", "img.overlay.png", "img.png", "img.probs.npz"]
    on_disk = json.loads((base.parent / "img.json").read_text())
    assert on_disk == json.loads(json.dumps(record))
    assert on_disk["image_size"] == {"width": 30, "height": 20}
    fractions = {c["name"]: c["fraction"] for c in on_disk["classes_present"]}
    for i, name in enumerate(result.class_names):
        assert fractions.get(name, 0) == pytest.approx((result.labels == i).mean())
    with np.load(base.parent / "img.probs.npz") as npz:
        assert npz["probs"].dtype == np.float16 and list(npz["class_names"]) == ["cat", "dog", "sky"]
        assert np.allclose(npz["probs"], result.probs, atol=1e-3)
    assert opts.status(base, SETTINGS)[0] is Status.done
    assert opts.status(base, {**SETTINGS, "batch_size": 2})[0] is Status.done  # speed only
    assert opts.status(base, {**SETTINGS, "attention": "kk/softmax"})[0] is Status.conflict
    assert OutputOptions(mask_format="coco-rle").status(base, SETTINGS)[0] is Status.resume
    (base.parent / "img.overlay.png").unlink()
    assert opts.status(base, SETTINGS)[0] is Status.resume
    assert OutputOptions(overwrite=True).status(base, {**SETTINGS, "attention": "x"})[0] is Status.todo


def test_resume_writes_only_missing_files(tmp_path):
    rgb, result = make_result()
    base = tmp_path / "img"
    write_outputs(base, tmp_path / "img.jpg", rgb, result, OutputOptions())
    png = tmp_path / "img.png"
    before = png.stat().st_mtime_ns
    record = write_outputs(base, tmp_path / "img.jpg", rgb, result, OutputOptions(mask_format="coco-rle"))
    assert png.stat().st_mtime_ns == before
    assert record["files"] == {"labels": "img.rle.json", "overlay": "img.overlay.png"}
    assert (tmp_path / "img.rle.json").exists()


def test_foreign_file_is_a_conflict(tmp_path):
    (tmp_path / "img.png").write_bytes(b"someone else's")
    assert OutputOptions().status(tmp_path / "img", SETTINGS)[0] is Status.conflict
    assert OutputOptions(overwrite=True).status(tmp_path / "img", SETTINGS)[0] is Status.todo


def test_interrupted_write_leaves_no_torn_file_and_resumes(tmp_path, monkeypatch):
    import clipseg_sparse.files.outputs as outputs

    rgb, result = make_result()
    base = tmp_path / "img"

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "overlay_image", broken)
    with pytest.raises(KeyboardInterrupt):
        write_outputs(base, tmp_path / "img.jpg", rgb, result, OutputOptions())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.json", "img.png"]  # no temp file left
    assert OutputOptions().status(base, SETTINGS)[0] is Status.resume
    monkeypatch.undo()
    write_outputs(base, tmp_path / "img.jpg", rgb, result, OutputOptions())
    assert OutputOptions().status(base, SETTINGS)[0] is Status.done


def test_unknown_mask_format():
    with pytest.raises(UnknownNameError, match="coco-rle"):
        OutputOptions(mask_format="coco")


def test_coco_rle_with_300_classes_writes_overlay_and_legend(tmp_path):
    """Issue 15 finding 3: class indices >= 256 used to crash the overlay legend (IndexError in the palette)."""
    names = tuple(f"class{i}" for i in range(300))
    labels = np.zeros((20, 30), np.int64)
    labels[:, 10:20], labels[:, 20:] = 256, 299
    probs = np.zeros((300, 20, 30), np.float32)
    np.put_along_axis(probs, labels[None], 1.0, axis=0)
    rgb = np.full((20, 30, 3), 100, np.uint8)
    result = SegmentationResult(labels, probs, names, dict(SETTINGS, classes=[[n] for n in names]))
    options = OutputOptions(mask_format="coco-rle")
    options.check_classes(300)  # no error: RLE holds any number of classes
    record = write_outputs(tmp_path / "c", tmp_path / "c.jpg", rgb, result, options)
    assert [c["index"] for c in record["classes_present"]] == [0, 256, 299]
    overlay = np.asarray(Image.open(tmp_path / "c.overlay.png")).astype(int)
    # VOC bit spreading by hand: 299 = 0b100_101_011 -> R bits 1,1,0 G bits 1,0,0 B bits 0,1,1 from bit 7 down
    assert ((100 + np.array([192, 128, 96])) / 2 - overlay[5, 25]).max() <= 0.5
    # 256 = 0b100_000_000 -> only B gets bit 5: (0, 0, 32), distinct from class 0's black
    assert ((100 + np.array([0, 0, 32])) / 2 - overlay[5, 15]).max() <= 0.5
    legend = overlay[:, 30:].reshape(-1, 3)
    assert (legend == [192, 128, 96]).all(1).any() and (legend == [0, 0, 32]).all(1).any()
