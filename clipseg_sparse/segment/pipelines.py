"""Segmenters that are not an attention spec on CLIP (SAM 3), registered by name so `eval` runs them
where a preset goes and puts their rows beside the presets'.

A pipeline is written `NAME[:ARGS]` (`--preset sam3`, `--preset sam3:0.4`). Its factory, registered in its
method's room (`methods/`), parses ARGS into a `Pipeline`: the backbone whose weights it loads (`ls
backbones`; weights by `--proxy-weights NAME=W`) and `build(model, vocabulary, settings)`, which returns an
object with the calls `eval` makes on a `Segmenter`: `predict_labels(rgb, name)`, `config()` (with the
`attention`, `model` and `pretrained` keys of result tables) and `class_names`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..registry import ENTRY_POINT_GROUP, Registry
from .settings import InferenceSettings
from .vocabulary import Vocabulary


@dataclass(frozen=True)
class Pipeline:
    """One configured pipeline: its canonical text, the backbone it runs, how to load and build it."""

    name: str  # canonical NAME:ARGS, recorded as the result's "attention"
    backbone: str  # BACKBONES entry whose weights it loads
    load: Callable[[str, str], Any]  # (weights: hub | none | a file, device) -> the loaded model
    build: Callable[[Any, Vocabulary, InferenceSettings], Any]  # (model, vocabulary, settings) -> a segmenter


PIPELINES: Registry[Callable[[str], Pipeline]] = Registry(
    "pipeline", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP, help_column="what it runs"
)


def find_pipeline(text: object) -> Pipeline | None:
    """The pipeline `text` names (`NAME[:ARGS]`; UserValueError for bad ARGS), or None when it names none (an
    attention spec or preset, or not a string)."""
    if not isinstance(text, str):
        return None
    name, _, args = text.strip().partition(":")
    return PIPELINES.get(name)(args) if name in PIPELINES else None
