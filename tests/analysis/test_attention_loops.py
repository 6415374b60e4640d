"""analyze and explain measure attention maps (`attention_maps` over the windows `eval` cuts, or one
whole-image forward). Windows, at-input and post stages (lp:patch, lp:pixel, tlp, pamr) act on the cosine maps
after the attention, so these loops have nothing for them to act on: their numbers equal those of the spec
without the stage. explain's segmentation panel runs them, through `Segmenter`."""

from pathlib import Path

import numpy as np
import pytest

from clipseg_sparse.analysis.explain import explain
from clipseg_sparse.analysis.statistics import analyze
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings

ADE_ROOT = Path(__file__).parents[1] / "data" / "ade20k"
STAGED = "qq/softmax/hook:lp:pixel:0.01:2:0.95/hook:tlp:8"  # an at-input stage (LPOSS+'s) and a post stage (PEARL's)


def test_explain_segments_with_the_specs_stages_and_shows_the_same_attention(tiny_clip):
    image = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    settings = InferenceSettings(resolution=48, window=32, stride=16)
    (staged,) = explain(tiny_clip, image, "a,b,c", [STAGED], (10, 10), settings, templates="single")
    (plain,) = explain(tiny_clip, image, "a,b,c", ["qq/softmax"], (10, 10), settings, templates="single")
    with_stages = Segmenter(tiny_clip, "a,b,c", STAGED, settings, templates="single").predict(image)
    without = Segmenter(tiny_clip, "a,b,c", "qq/softmax", settings, templates="single").predict(image)
    assert not np.allclose(with_stages.probs, without.probs)  # the stages change the segmentation ...
    assert np.array_equal(staged.labels, with_stages.labels)  # ... and explain's panel is that segmentation
    np.testing.assert_array_equal(staged.attention, plain.attention)  # the attention is the spec's, before them


@pytest.mark.parametrize("overrides", [dict(resolution=56, window=0), dict(resolution=56, window=32, stride=16)])
def test_analyze_statistics_do_not_depend_on_stages_after_the_attention(tiny_clip, overrides):
    kw = dict(overrides=overrides, limit=1, progress=False)
    staged = analyze(tiny_clip, "ade20k", ADE_ROOT, STAGED, **kw)
    plain = analyze(tiny_clip, "ade20k", ADE_ROOT, "qq/softmax", **kw)
    assert staged["config"]["attention"] == STAGED and staged["metrics"] == plain["metrics"]
