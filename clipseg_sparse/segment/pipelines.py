"""Segmenters that are not an attention spec on CLIP (SAM 3), registered by name so `eval` runs them
where a preset goes and puts their rows beside the presets'.

A pipeline is written `NAME[:ARGS][/NORMALIZER]` (`--preset sam3`, `--preset sam3:0.4`, `sam3/entmax:1.5`:
a normalizer inside the pipeline's own attention, where it has a slot). Its factory, registered in its
method's room (`methods/`), parses the text after NAME into a `Pipeline`: the backbone whose weights it loads
(`ls backbones`; weights by `--proxy-weights NAME=W`), `load(weights, device, precision)`, and
`build(model, vocabulary, settings)`, which returns an object with the calls `eval` makes on a `Segmenter`:
`predict_labels(rgb, name)`, `config()` (with the `attention`, `model` and `pretrained` keys of result tables)
and `class_names`. A segmenter whose decoder attends from object queries to the image may also give
`query_attention(rgb) -> QueryAttention`, which `analyze` and `explain` read as they read CLIP's last-block
rows. A pipeline may give `check(vocabulary)`, which `eval` calls before the model loads (a vocabulary it
cannot run fails in one line, early).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..registry import ENTRY_POINT_GROUP, Registry
from .settings import InferenceSettings
from .vocabulary import Vocabulary


@dataclass(frozen=True)
class Pipeline:
    """One configured pipeline: its canonical text, the backbone it runs, how to load and build it."""

    name: str  # canonical NAME:ARGS, recorded as the result's "attention"
    backbone: str  # BACKBONES entry whose weights it loads
    load: Callable[[str, str, str], Any]  # (weights: hub | none | a file or folder, device, precision) -> the loaded model
    build: Callable[[Any, Vocabulary, InferenceSettings], Any]  # (model, vocabulary, settings) -> a segmenter
    check: Callable[[Vocabulary], None] | None = None  # refuses a vocabulary it cannot run, before the model loads


@dataclass(frozen=True)
class QueryAttention:
    """A detector's attention on one image: per prompt name, every object query's row over the image tokens
    (the last decoder layer's cross-attention, each row summing to 1), the queries' object scores, and which of
    them the segmenter keeps as instances. The image tokens are a `grid` over the model's input, which is the
    whole image resized to it (SAM 3 squashes it to a square)."""

    rows: torch.Tensor  # names x heads x Q x (h * w)
    scores: torch.Tensor  # names x Q
    kept: torch.Tensor  # names x Q bool: the instances the segmenter keeps (its confidence)
    grid: tuple[int, int]  # (h, w)
    name_class: tuple[int, ...]  # the class index of each name


PIPELINES: Registry[Callable[[str], Pipeline]] = Registry(
    "pipeline", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP, help_column="what it runs"
)


def split_pipeline(text: str) -> tuple[str, str]:
    """(NAME, the rest after NAME and its `:`): `sam3:0.3/entmax:1.5` -> (sam3, 0.3/entmax:1.5),
    `sam3/sparsemax` -> (sam3, /sparsemax)."""
    text = text.strip()
    name = re.match(r"[^:/]*", text).group(0)
    rest = text[len(name) :]
    return name, rest[1:] if rest.startswith(":") else rest


def find_pipeline(text: object) -> Pipeline | None:
    """The pipeline `text` names (`NAME[:ARGS][/NORMALIZER]`; a UserValueError for bad ARGS), or None when it
    names none (an attention spec or preset, or not a string)."""
    if not isinstance(text, str):
        return None
    name, args = split_pipeline(text)
    return PIPELINES.get(name)(args) if name in PIPELINES else None
