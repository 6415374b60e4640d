"""Spec values that would be recorded as a run they are not: nan / inf refused when parsed (they gave NaN
scores), and a normalizer on a spec with no normalizer slot (source `id`), which changed nothing."""

from __future__ import annotations

import math

import pytest

import clipseg_sparse.methods  # noqa: F401  (registers the presets)
from clipseg_sparse.attention import AttentionSpec


@pytest.mark.parametrize("text", ["qq/softmax/neg:nan", "qq/softmax/neg:inf", "qq/softmax/neg:-inf", "qq/softmax/temp:inf",
                                  "qq/softmax/gauss:nan", "qq/softmax/gauss:inf", "qq/softmax/cls:nan", "qq/entmax:nan",
                                  "sclip/neg:nan", "lposs/hook:lp:pixel:inf", "trident/hook:sam:nan"])  # fmt: skip
def test_non_finite_spec_values_are_refused(text):
    with pytest.raises(ValueError, match="finite|not a number|alpha|bad stage"):
        AttentionSpec.parse(text)


@pytest.mark.parametrize("field", ["negative", "temperature", "gauss_sigma", "cls_residual"])
def test_non_finite_fields_are_refused(field):
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            AttentionSpec(source=("qq",), **{field: value})


@pytest.mark.parametrize("text", ["maskclip/entmax:1.5", "id/entmax:1.5", "lposs/sparsemax", "lposs+/entmax:1.25"])
def test_a_normalizer_on_a_spec_without_a_slot_is_refused(text):
    with pytest.raises(ValueError, match="source 'id'.*would change nothing"):
        AttentionSpec.parse(text)
