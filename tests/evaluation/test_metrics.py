import math

import numpy as np
import pytest

from clipseg_sparse.evaluation.metrics import areas_to_record, intersect_and_union, record_to_areas, segmentation_metrics

PRED_1 = np.array([[0, 0, 1], [1, 2, 2]])
LABEL_1 = np.array([[0, 1, 1], [255, 2, 0]])
PRED_2 = np.array([[3, 3]])
LABEL_2 = np.array([[0, 0]])


def test_single_image_by_hand():
    # non-ignored pixels (pred, label): (0,0) (0,1) (1,1) (2,2) (2,0); the pixel labelled 255 is dropped
    areas = intersect_and_union(PRED_1, LABEL_1, num_classes=4)
    assert areas.tolist() == [[1, 1, 1, 0], [2, 1, 2, 0], [2, 2, 1, 0]]
    m = segmentation_metrics(areas)
    assert m["IoU"][:3].tolist() == pytest.approx([1 / 3, 1 / 2, 1 / 2])
    assert math.isnan(m["IoU"][3])  # absent from prediction and label: NaN, left out of the mean
    assert m["mIoU"] == pytest.approx(4 / 9)
    assert m["mAcc"] == pytest.approx((1 / 2 + 1 / 2 + 1) / 3)
    assert m["aAcc"] == pytest.approx(3 / 5)


def test_dataset_level_sums_not_mean_of_images():
    total = intersect_and_union(PRED_1, LABEL_1, 4) + intersect_and_union(PRED_2, LABEL_2, 4)
    m = segmentation_metrics(total)
    # class 0: I 1, P 2, L 4 -> 1/5; class 3 predicted but never present: IoU 0 (counted), Acc NaN
    assert m["IoU"].tolist() == pytest.approx([1 / 5, 1 / 2, 1 / 2, 0.0])
    assert m["mIoU"] == pytest.approx(0.3)
    assert math.isnan(m["Acc"][3])
    assert m["mAcc"] == pytest.approx((1 / 4 + 1 / 2 + 1) / 3)
    assert m["aAcc"] == pytest.approx(3 / 7)
    per_image = (segmentation_metrics(intersect_and_union(PRED_1, LABEL_1, 4))["mIoU"] + 0.0) / 2
    assert m["mIoU"] != pytest.approx(per_image)


def test_matches_a_confusion_matrix_on_random_data():
    rng = np.random.default_rng(1)
    C = 7
    conf = np.zeros((C, C), dtype=np.int64)
    total = np.zeros((3, C), dtype=np.int64)
    for _ in range(5):
        label = rng.integers(0, C, size=(20, 30))
        label[rng.random(label.shape) < 0.2] = 255
        pred = rng.integers(0, C - 1, size=label.shape)  # class C-1 never predicted
        for p, t in zip(pred.ravel(), label.ravel()):
            if t != 255:
                conf[t, p] += 1
        total += intersect_and_union(pred, label, C)
    diag, rows, cols = np.diag(conf), conf.sum(1), conf.sum(0)
    m = segmentation_metrics(total)
    np.testing.assert_allclose(m["IoU"], diag / (rows + cols - diag))
    np.testing.assert_allclose(m["Acc"], diag / rows)
    assert m["aAcc"] == pytest.approx(diag.sum() / conf.sum())


def test_sparse_record_round_trip_and_bad_values():
    areas = intersect_and_union(PRED_1, LABEL_1, 6)
    record = areas_to_record(areas)
    assert set(record) == {"0", "1", "2"}
    assert (record_to_areas(record, 6) == areas).all()
    with pytest.raises(ValueError):
        intersect_and_union(np.array([[7]]), np.array([[0]]), 6)
    with pytest.raises(ValueError):
        intersect_and_union(np.zeros((2, 2), int), np.zeros((2, 3), int), 6)
