"""Image -> label map: settings, preprocessing, windows, label maps, the `Segmenter`, vocabularies, regions.

One job per module, in the order an image goes through them: `settings` (every knob), `preprocess`
(resize, normalise, window geometry: `prepare`), `plan` (what a run needs, the registered forwards, one
image's run), `resources` (a run's inputs besides the model), `maps` (factored cosine maps), `windows` (the
plain sliding-window forward), `labels` (probabilities and labels, band by band), `segmenter` (`Segmenter`,
which runs them). The names below are also importable from here (and from the old
`clipseg_sparse.inference`), loaded on first use.

May import `models`, `attention`, `stages`, `runtime`."""

from __future__ import annotations

import importlib

_NAMES = {
    "settings": ("InferenceSettings", "RESIZE_METHODS", "REMAINDER_RULES"),
    "preprocess": ("prepare", "resized_shape", "window_boxes", "round_up_pixels", "to_pixels", "window_geometry", "window_padding"),
    "plan": ("Plan", "FORWARDS", "Forward", "ImageRun", "AttentionWindow"),
    "resources": ("Resources",),
    "maps": ("BAND_ELEMENTS", "ROW_BLOCK", "CosineMap", "DenseMap", "ResizedMap", "row_bands", "grid_cosine", "resized_cosine"),
    "windows": ("iter_window_features", "dense_cosine", "GridSum"),
    "labels": ("class_probabilities", "probabilities_to_labels", "kept_classes", "masked_labels", "ClassMaps", "SegmentationResult"),
    "segmenter": ("Segmenter",),
}  # fmt: skip
_MODULE = {name: module for module, names in _NAMES.items() for name in names}

__all__ = list(_MODULE)


def __getattr__(name: str) -> object:
    if name in _MODULE:
        return getattr(importlib.import_module(f".{_MODULE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
