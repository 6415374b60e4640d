"""An image whose class scores are not finite fails its labels (nothing non-finite is recorded)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clipseg_sparse.segment.labels import ClassMaps, NonFiniteScores
from clipseg_sparse.segment.maps import DenseMap


def _maps(value: float) -> ClassMaps:
    cosine = torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(0))
    cosine[1, 2, 3] = value
    return ClassMaps(DenseMap(cosine), [0, 1, 2], 3, 40.0)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("bg", [0.0, 0.5])
def test_non_finite_scores_fail_the_labels(value, bg):
    with pytest.raises(NonFiniteScores, match="not finite"):
        _maps(value).labels(bg)


def test_finite_scores_keep_their_labels():
    maps = _maps(0.5)
    expected = maps.rows(0, 4).argmax(0).numpy()
    assert np.array_equal(_maps(0.5).labels(), expected)
