"""Every per-dataset value of the OV-Stitcher and PEARL protocols against a transcription of the published
configs (short side of mmseg's Resize, slide_crop, slide_stride, prob_thd; the segmentor's renormalisation).

Transcribed by hand from atw617/OV-Stitcher@2bb6586 `configs/cfg_*.py` (segmentor @91a9489: logit_scale 40)
and PGSmall/PEARL@c26062b `configs/cfg_*.py` with `pearl_ovss.py` (defaults slide_crop 224, slide_stride 112,
prob_thd 0, logit_scale 40; `postprocess_result` divides the probabilities by their sum after the synonym max).
"""

from __future__ import annotations

import pytest

import clipseg_sparse.methods  # noqa: F401  (registers the protocols)
from clipseg_sparse.evaluation.protocols import PROTOCOLS

# dataset: (Resize short side, slide_crop, slide_stride, prob_thd); slide_crop 0 = whole image
OVSTITCHER = {
    "voc21": (448, 336, 112, 0.1), "context60": (448, 336, 112, 0.1), "coco-object": (448, 336, 112, 0.2),
    "voc20": (448, 336, 112, 0.0), "context59": (448, 336, 112, 0.0), "coco-stuff": (448, 336, 224, 0.0),
    "cityscapes": (560, 224, 112, 0.0), "ade20k": (448, 336, 112, 0.0),
}  # fmt: skip
PEARL = {
    "voc21": (336, 0, 112, 0.1), "context60": (336, 224, 112, 0.1), "coco-object": (336, 224, 112, 0.1),
    "voc20": (336, 0, 112, 0.0), "context59": (336, 224, 112, 0.0), "coco-stuff": (336, 224, 112, 0.0),
    "cityscapes": (560, 224, 112, 0.0), "ade20k": (336, 224, 112, 0.0),
}  # fmt: skip
RENORMALIZE = {"ovstitcher": False, "pearl": True}


@pytest.mark.parametrize("protocol, table", [("ovstitcher", OVSTITCHER), ("pearl", PEARL)])
@pytest.mark.parametrize("dataset", list(OVSTITCHER))
def test_protocol_settings_equal_the_published_configs(protocol, table, dataset):
    s = PROTOCOLS.get(protocol).settings(dataset)
    side, crop, stride, thd = table[dataset]
    assert (s.resolution, s.window, s.bg_threshold, s.logit_scale) == (side, crop, thd, 40.0)
    if crop:
        assert s.stride == stride
    assert s.renormalize is RENORMALIZE[protocol]
