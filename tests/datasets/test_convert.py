from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipseg_sparse.datasets import DATASETS, DatasetError, class_vocabulary, display_labels
from clipseg_sparse.datasets.convert import (
    OBJECT_SUFFIX,
    STUFF_SUFFIX,
    convert_stuffthingmaps,
    coco_object_from_instances,
    object_lut,
    stuff_lut,
)
from fake_benchmarks import LAYOUT_OF, LAYOUTS, make_benchmark, write_png

ADE_ROOT = Path(__file__).parents[1] / "data" / "ade20k"
REDUCE_ZERO = {"voc20", "context59", "ade20k"}
EXPECTED_CLASSES = {"voc21": 21, "voc20": 20, "context60": 60, "context59": 59, "ade20k": 150,
                    "coco-stuff": 171, "coco-object": 81, "cityscapes": 19}
EXPECTED_IMAGES = {"voc21": 1449, "voc20": 1449, "context60": 5105, "context59": 5105, "ade20k": 2000,
                   "coco-stuff": 5000, "coco-object": 5000, "cityscapes": 500}


def expected_decode(raw: np.ndarray, reduce_zero: bool) -> np.ndarray:
    out = raw.copy()
    if reduce_zero:
        for (i, j), v in np.ndenumerate(raw):
            out[i, j] = 255 if v in (0, 255) else v - 1
    return out


@pytest.mark.parametrize("name", DATASETS.names())
def test_reader_finds_and_decodes_each_layout(tmp_path, name):
    bench = DATASETS.get(name)
    assert bench.num_classes == EXPECTED_CLASSES[name] and bench.num_images == EXPECTED_IMAGES[name]
    assert bench.reduce_zero_label == (name in REDUCE_ZERO)
    assert bench.background == (name in {"voc21", "context60", "coco-object"})
    raws = make_benchmark(name, tmp_path, n=3)
    samples = bench.samples(tmp_path)
    img_t, lab_t, mode, _ = LAYOUTS[LAYOUT_OF.get(name, name)]
    assert [s.image for s in samples] == [tmp_path / img_t.format(i=i) for i in range(3)]
    assert [s.label for s in samples] == [tmp_path / lab_t.format(i=i) for i in range(3)]
    assert Image.open(samples[0].label).mode == mode
    for sample, raw in zip(samples, raws):
        labels = bench.load_label(sample.label)
        np.testing.assert_array_equal(labels, expected_decode(raw, name in REDUCE_ZERO))
        np.testing.assert_array_equal(bench.decode(bench.encode(labels[labels != 255])), labels[labels != 255])
    # raw 0 stays class 0 (background on voc21 / context60 / coco-object) unless reduce_zero_label ignores it
    first = bench.load_label(samples[0].label)
    assert (first[:, :2] == 255).all()
    assert first[0, 2] == (255 if name in REDUCE_ZERO else 0)
    assert first[-1, -1] == bench.num_classes - 1
    # --root may also point at the layout folder itself
    if bench.layout:
        assert len(bench.samples(tmp_path / bench.layout)) == 3


def test_real_ade20k_samples_reduce_zero_label():
    bench = DATASETS.get("ade20k")
    samples = bench.samples(ADE_ROOT)
    assert [s.id for s in samples] == ["ADE_val_00000001", "ADE_val_00000002", "ADE_val_00000003"]
    raw_values = [{0, 1, 2, 3, 5, 7, 10, 18}, {0, 1, 2, 3, 5, 14, 18}, {0, 1, 2, 3, 5, 7, 12, 21, 44, 81, 88, 97, 103}]
    for sample, raw in zip(samples, raw_values):
        labels = bench.load_label(sample.label)
        assert set(np.unique(labels).tolist()) == {255} | {v - 1 for v in raw if v}
        assert labels.shape == np.asarray(Image.open(sample.image)).shape[:2]
    assert bench.classes[0] == "wall" and bench.classes[149] == "flag"


def test_voc_palette_png_with_void_and_background(tmp_path):
    raw = np.array([[0, 0, 255, 15], [1, 1, 255, 20]])
    make_benchmark("voc21", tmp_path, n=1)
    label_path = tmp_path / "VOCdevkit/VOC2012/SegmentationClass/2007_000000.png"
    write_png(label_path, raw, "P")
    assert DATASETS.get("voc21").load_label(label_path).tolist() == [[0, 0, 255, 15], [1, 1, 255, 20]]
    assert DATASETS.get("voc20").load_label(label_path).tolist() == [[255, 255, 255, 14], [0, 0, 255, 19]]


def test_missing_and_malformed_datasets_name_the_path(tmp_path):
    bench = DATASETS.get("voc21")
    with pytest.raises(DatasetError, match=r"VOCdevkit/VOC2012/JPEGImages not found; see docs/datasets.md"):
        bench.samples(tmp_path)
    make_benchmark("voc21", tmp_path, n=2)
    (tmp_path / "VOCdevkit/VOC2012/SegmentationClass/2007_000001.png").unlink()
    with pytest.raises(DatasetError, match="label .*2007_000001.png not found"):
        bench.samples(tmp_path)
    (tmp_path / "VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt").unlink()
    with pytest.raises(DatasetError, match="split file .*val.txt not found"):
        bench.samples(tmp_path)
    rgb_label = tmp_path / "rgb.png"
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(rgb_label)
    with pytest.raises(DatasetError, match="single-channel"):
        bench.load_label(rgb_label)
    raw_ids = tmp_path / "raw.png"
    write_png(raw_ids, np.full((4, 4), 181), "L")  # a raw COCO-Stuff id where trainIds are expected
    with pytest.raises(DatasetError, match=r"label value\(s\) \[181\] outside 0..170"):
        DATASETS.get("coco-stuff").load_label(raw_ids)


@pytest.mark.parametrize("name", DATASETS.names())
def test_class_name_sets_cover_every_class(name):
    labels = display_labels(name)
    for which in ("sclip", "plain"):
        vocab, version = class_vocabulary(name, which)
        assert len(vocab) == len(labels) and vocab.labels == labels
        assert version.startswith(f"{which}/{name}.txt@")


def test_sclip_and_plain_names_differ_where_published_files_do(tmp_path):
    sclip, v1 = class_vocabulary("voc21", "sclip")
    plain, v2 = class_vocabulary("voc21", "plain")
    assert sclip.labels[0] == plain.labels[0] == "background"
    assert "sky" in sclip.names[0] and plain.names[0] == ("background",)
    assert sclip.names[15][:2] == ("person", "person in shirt") and plain.names[15] == ("person",)
    assert v1.split("@")[1] != v2.split("@")[1]
    assert class_vocabulary("ade20k", "sclip")[1].split("@")[1] == class_vocabulary("ade20k", "plain")[1].split("@")[1]
    custom = tmp_path / "names.txt"
    custom.write_text("\n".join(f"thing {i}, alias {i}" for i in range(19)))
    vocab, version = class_vocabulary("cityscapes", str(custom))
    assert vocab.names[3] == ("thing 3", "alias 3") and vocab.labels[3] == "wall" and version.startswith("file:names.txt")
    with pytest.raises(ValueError, match="19 classes .* voc20 has 20"):
        class_vocabulary("voc20", str(custom))
    with pytest.raises(ValueError, match="class names .clearclip.: not one of sclip, .*plain.* and not an existing file"):
        class_vocabulary("voc20", "clearclip")


# Pairs taken from the published tables (mmseg coco_stuff164k.py / NACLIP datasets/cvt_coco_object.py).
STUFF_PAIRS = {0: 0, 10: 10, 12: 11, 26: 24, 89: 79, 91: 80, 181: 170, 255: 255}
OBJECT_PAIRS = {0: 1, 10: 11, 12: 12, 26: 25, 89: 80, 91: 0, 181: 0, 255: 0}


def test_stuffthingmaps_conversions_follow_the_published_tables(tmp_path):
    assert {k: int(stuff_lut()[k]) for k in STUFF_PAIRS} == STUFF_PAIRS
    assert {k: int(object_lut()[k]) for k in OBJECT_PAIRS} == OBJECT_PAIRS
    src = tmp_path / "annotations" / "val2017"
    raw = np.array([list(STUFF_PAIRS)])
    write_png(src / "000000000139.png", raw, "L")
    assert convert_stuffthingmaps(src, src, stuff_lut(), STUFF_SUFFIX) == 1
    assert convert_stuffthingmaps(src, src, object_lut(), OBJECT_SUFFIX) == 1
    assert convert_stuffthingmaps(src, src, object_lut(), OBJECT_SUFFIX) == 0  # existing files are kept
    stuff = np.array(Image.open(src / "000000000139_labelTrainIds.png"))
    obj = np.array(Image.open(src / "000000000139_instanceTrainIds.png"))
    assert stuff.tolist() == [list(STUFF_PAIRS.values())]
    assert obj.tolist() == [list(OBJECT_PAIRS.values())]


def test_coco_object_from_instances_json(tmp_path):
    import json

    ann = {
        "images": [{"id": 7, "file_name": "000000000007.jpg", "height": 6, "width": 8}],
        "categories": [{"id": 1, "name": "person"}, {"id": 13, "name": "stop sign"}],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 1, "iscrowd": 0, "area": 24.0, "bbox": [0, 0, 6, 4],
             "segmentation": [[0, 0, 6, 0, 6, 4, 0, 4]]},
            {"id": 2, "image_id": 7, "category_id": 13, "iscrowd": 0, "area": 4.0, "bbox": [2, 2, 2, 2],
             "segmentation": [[2, 2, 4, 2, 4, 4, 2, 4]]},
        ],
    }
    path = tmp_path / "instances_val2017.json"
    path.write_text(json.dumps(ann))
    assert coco_object_from_instances(path, tmp_path / "out") == 1
    label = np.array(Image.open(tmp_path / "out" / "000000000007_instanceTrainIds.png"))
    assert label.shape == (6, 8)
    assert label[1, 1] == 1 and label[3, 3] == 12  # stop sign (COCO id 13) is thing 12, drawn on top
    assert label[5, 7] == 0 and set(np.unique(label)) == {0, 1, 12}
