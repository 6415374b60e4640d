"""Dataset-level segmentation metrics, computed the way mmseg's IoUMetric does.

Each image contributes, per class, the pixel counts intersect = |pred = c and label = c|, pred area
|pred = c| and label area |label = c|, over pixels whose label is not 255 (ignored). These counts are
summed over the whole dataset (they are the diagonal and the row / column sums of the dataset's
confusion matrix), and only then turned into ratios, so mIoU is *not* a mean of per-image mIoUs:

    IoU_c = I_c / (P_c + L_c - I_c)        Acc_c = I_c / L_c        aAcc = sum_c I_c / sum_c L_c
    mIoU = nanmean_c IoU_c                 mAcc = nanmean_c Acc_c

A class absent from both prediction and ground truth has IoU 0/0 = NaN and is left out of mIoU, as in
mmseg; a class predicted but never in the ground truth has IoU 0 and counts. Acc_c is NaN (left out of
mAcc) whenever the class is absent from the ground truth.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import UserValueError
from ..datasets.labels import IGNORE_INDEX


def intersect_and_union(pred: np.ndarray, label: np.ndarray, num_classes: int, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """3 x C int64 counts (intersect, pred area, label area) of one image; pred and label are H x W."""
    if pred.shape != label.shape:
        raise UserValueError(f"prediction {pred.shape} and label {label.shape} differ in size")
    keep = label != ignore_index
    p, t = pred[keep].astype(np.int64).ravel(), label[keep].astype(np.int64).ravel()
    for name, x in (("prediction", p), ("label", t)):
        if x.size and (x.min() < 0 or x.max() >= num_classes):
            raise UserValueError(f"{name} values must be in 0..{num_classes - 1} (or {ignore_index} for labels)")
    return np.stack(
        [
            np.bincount(p[p == t], minlength=num_classes),
            np.bincount(p, minlength=num_classes),
            np.bincount(t, minlength=num_classes),
        ]
    )


def union(areas: np.ndarray) -> np.ndarray:
    intersect, pred, label = areas
    return pred + label - intersect


def segmentation_metrics(areas: np.ndarray) -> dict:
    """From summed 3 x C counts: per-class IoU and Acc (C arrays, NaN where undefined) and the means.

    Values are fractions in [0, 1]; mIoU / mAcc are NaN only if every class is NaN.
    """
    intersect, _, label = areas.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = intersect / union(areas)
        acc = intersect / label
        a_acc = intersect.sum() / label.sum() if label.sum() else np.nan
    mean = lambda x: float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")  # noqa: E731
    return {"IoU": iou, "Acc": acc, "mIoU": mean(iou), "mAcc": mean(acc), "aAcc": float(a_acc)}


def areas_to_record(areas: np.ndarray) -> dict[str, list[int]]:
    """Sparse JSON form of 3 x C counts: {class index: [intersect, pred, label]} for non-zero classes."""
    return {str(c): areas[:, c].tolist() for c in np.flatnonzero(areas.any(axis=0))}


def record_to_areas(record: Mapping[str, Sequence[int]], num_classes: int) -> np.ndarray:
    areas = np.zeros((3, num_classes), dtype=np.int64)
    for c, counts in record.items():
        areas[:, int(c)] = counts
    return areas
