import pytest

from clipseg_sparse.attention import PRESETS
from clipseg_sparse.datasets import DATASETS, NAME_SETS
from clipseg_sparse.segment.pipelines import PIPELINES
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.evaluation.protocols import PROTOCOLS

# (protocol, dataset) -> values read from the published mmseg configs (cfg_*.py) and segmentor defaults.
PUBLISHED = {
    ("sclip", "voc21"): dict(resolution=336, window=224, stride=112, logit_scale=65, bg_threshold=0.1, area_threshold=0.1),
    ("sclip", "context60"): dict(resolution=336, logit_scale=50, bg_threshold=0.1, area_threshold=0),
    ("sclip", "coco-object"): dict(resolution=336, logit_scale=50, bg_threshold=0.1),
    ("sclip", "ade20k"): dict(resolution=336, logit_scale=40, bg_threshold=0, pamr=False),  # pamr_steps=0
    ("sclip", "coco-stuff"): dict(resolution=448, logit_scale=40),
    ("sclip", "cityscapes"): dict(resolution=560, window=224, stride=112),
    ("clearclip", "voc21"): dict(resolution=448, window=448, stride=224, logit_scale=50, bg_threshold=0.5, area_threshold=0, pamr=False),
    ("clearclip", "context60"): dict(bg_threshold=0.15),
    ("clearclip", "coco-object"): dict(bg_threshold=0.4),
    ("clearclip", "cityscapes"): dict(resolution=448, window=224, stride=224),
    # NACLIP after "Update for v2": VOC21 / VOC20 whole image, COCO-Stuff at 336, PAMR on everywhere
    ("naclip", "voc21"): dict(resolution=336, window=0, logit_scale=40, bg_threshold=0.1, area_threshold=0, pamr=True),
    ("naclip", "voc20"): dict(resolution=336, window=0, bg_threshold=0, pamr=True),
    ("naclip", "context60"): dict(resolution=336, window=224, stride=112, bg_threshold=0.1, pamr=True),
    ("naclip", "coco-object"): dict(window=224, bg_threshold=0.1, pamr=True),
    ("naclip", "coco-stuff"): dict(resolution=336, window=224, stride=112, pamr=True),
    ("naclip", "ade20k"): dict(resolution=336, window=224, pamr=True),
    ("naclip", "cityscapes"): dict(resolution=560, window=224, stride=112, pamr=True),
    # before it (cbb720d), without post-processing
    ("naclip-v1", "voc21"): dict(resolution=336, window=224, stride=112, logit_scale=40, bg_threshold=0.1, pamr=False),
    ("naclip-v1", "voc20"): dict(resolution=336, window=224, pamr=False),
    ("naclip-v1", "coco-stuff"): dict(resolution=448, pamr=False),
    ("naclip-v1", "cityscapes"): dict(resolution=560),
}


@pytest.mark.parametrize("key", list(PUBLISHED))
def test_protocol_values_match_published_configs(key):
    protocol, dataset = key
    settings = PROTOCOLS.get(protocol).settings(dataset)
    for name, value in PUBLISHED[key].items():
        assert getattr(settings, name) == pytest.approx(value), name


@pytest.mark.parametrize("protocol", PROTOCOLS.names())
def test_every_protocol_gives_valid_settings_for_every_dataset(protocol):
    p = PROTOCOLS.get(protocol)
    assert (p.attention in PRESETS or p.attention in PIPELINES) and p.class_names in NAME_SETS
    for dataset in DATASETS:
        s = p.settings(dataset)
        assert isinstance(s, InferenceSettings)
        if not DATASETS.get(dataset).background:
            assert s.bg_threshold == 0 and s.area_threshold == 0


def test_command_line_overrides_win_and_none_is_ignored():
    p = PROTOCOLS.get("sclip")
    s = p.settings("voc21", {"logit_scale": 12.0, "window": None, "stride": 56})
    assert (s.logit_scale, s.window, s.stride, s.bg_threshold) == (12.0, 224, 56, 0.1)
    assert InferenceSettings().batch_size == s.batch_size  # untouched knob: library default
    with pytest.raises(ValueError, match="unknown inference setting"):
        p.settings("voc21", {"prob_thd": 0.2})
