"""The numbers the papers printed, as data, so every report can put them beside this tool's.

Each method's module registers what its paper (or the table that reprints it) reports for one of its protocols:
`register_published(protocol, miou, source, ...)`, one entry per protocol, the CLIP the numbers were measured
with, the table and the repository file they were read from, and a note on known gaps. A result is *comparable*
with an entry (`Published.compare`) when it ran that protocol as published: the same protocol (or one of its
weights variants, `corrclip` / `corrclip-metaclip`, which differ only in the CLIP they load), CLIP weights, class
names, settings and the protocol's spec up to its normalizer (so the `-entmax` run of a preset gets its paper's
softmax number beside it, the difference being the gain over the paper). A `--limit` run is compared but never
marked: it scored a subset.

Reproduction gaps are the most common complaint in the peers' issue trackers; this makes one visible at a
glance (`report`, `reproduce`, `reproduce leaderboard`, `ls presets`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..attention.spec import AttentionSpec
from ..datasets import DATASETS
from ..registry import ENTRY_POINT_GROUP, Registry, caller_module
from ..segment.vocabulary import resolve_templates, templates_id
from .protocols import PROTOCOLS, Protocol

# The eight benchmarks of the field's comparison tables, in their usual column order; avg-8 is their mean.
EIGHT = ("voc21", "context60", "coco-object", "voc20", "context59", "coco-stuff", "cityscapes", "ade20k")
# A difference from the paper beyond this (mIoU points) is marked in reports, unless the user sets another.
TOLERANCE = 0.5


@dataclass(frozen=True)
class Published:
    """What one paper reports for one protocol: mIoU (percent) per benchmark, and where it was read."""

    protocol: str  # the protocol (and so the preset, class names, settings) the numbers pair with
    model: str  # the CLIP (or pipeline weights) the numbers were measured with: open_clip name ...
    pretrained: str  # ... and tag
    miou: Mapping[str, float]  # benchmark -> mIoU in percent, as printed
    source: str  # the paper's table and the repository file (owner/repo@commit path) it was read from
    note: str = ""  # known gaps between this tool's run and the paper's (docs/datasets.md: the documented differences)
    printed_average: float | None = None  # the avg-8 as the table prints it (a check on the typed cells)

    @property
    def average(self) -> float | None:
        """The avg-8 mIoU, only where the paper reports all eight benchmarks."""
        if not all(d in self.miou for d in EIGHT):
            return None
        return sum(self.miou[d] for d in EIGHT) / len(EIGHT)

    @property
    def clip(self) -> str:
        return f"{self.model}:{self.pretrained}"

    def describe(self, help: str) -> dict[str, str]:
        """`ls published`: the CLIP, the avg-8 (or the benchmarks reported), the cells, where they were read."""
        average = self.average
        cells = " ".join(f"{d} {self.miou[d]:g}" for d in EIGHT if d in self.miou)
        return {
            "CLIP": self.clip, "avg-8": f"{average:.1f}" if average is not None else f"{len(self.miou)} of 8",
            "mIoU": cells, "source": help + (f"\nnote: {self.note}" if self.note else ""),
        }  # fmt: skip

    def differences(self, config: Mapping[str, Any]) -> list[str]:
        """What makes a result's `config` (a result file's) differ from this entry's run, one short phrase
        each; empty when the result ran the protocol as published."""
        dataset = config.get("dataset")
        name = config.get("protocol")
        protocol = PROTOCOLS.get(self.protocol)
        if name not in PROTOCOLS or _family(PROTOCOLS.get(name)) != _family(protocol):
            return [f"protocol {name}"]
        if dataset not in self.miou:
            return [f"dataset {dataset} not reported"]
        out = [
            f"{key} {config[key]}" for key, want in (("model", self.model), ("pretrained", self.pretrained), ("class_names", protocol.class_names))
            if key in config and config[key] != want
        ]  # fmt: skip
        attention = config.get("attention")
        if attention is not None and _up_to_normalizer(attention) != _up_to_normalizer(_published_attention(protocol, dataset)):
            out.append(f"attention {attention}")
        settings = dataclasses.asdict(protocol.settings(dataset))
        out += [f"{k}={config[k]}" for k, v in settings.items() if k in config and _normal(config[k]) != _normal(v)]
        named = protocol.templates_for(dataset)  # only where the protocol names its templates (CLIPer's)
        if named is not None and "templates" in config and config["templates"] != templates_id(resolve_templates(named)):
            out.append("templates not the protocol's")
        return out

    def compare(self, config: Mapping[str, Any], value: float, tolerance: float = TOLERANCE) -> Comparison | None:
        """This entry's number beside a result's `value`, or None when the result is not comparable (another
        protocol, CLIP, class names, settings or spec; a benchmark the paper does not report). Only the run of
        the paper's own normalizer on a whole split is marked beyond `tolerance`: another normalizer's
        difference is its gain, a `--limit` run scored a subset."""
        if self.differences(config):
            return None
        dataset = config["dataset"]
        published = self.miou[dataset]
        attention = config.get("attention")
        as_published = attention is None or _canonical(attention) == _canonical(_published_attention(PROTOCOLS.get(self.protocol), dataset))
        return Comparison.of(published, value, as_published, config.get("limit") is not None, self, tolerance)


@dataclass(frozen=True)
class Comparison:
    """A result beside its paper's number: `delta` = this run minus the paper; `beyond` = |delta| over the
    tolerance for the paper's own run (`as_published`: its normalizer too) on a whole split (not `limited`)."""

    published: float
    delta: float
    beyond: bool
    as_published: bool
    limited: bool
    entry: Published

    @classmethod
    def of(cls, published: float, value: float, as_published: bool, limited: bool, entry: Published, tolerance: float) -> Comparison:
        delta = value - published
        return cls(published, delta, as_published and not limited and abs(delta) > tolerance, as_published, limited, entry)


def _family(protocol: Protocol) -> Protocol:
    """A protocol without its name and CLIP: equal for a protocol and its weights variants."""
    return dataclasses.replace(protocol, name="", model=None, pretrained=None)


def _published_attention(protocol: Protocol, dataset: str) -> str:
    """The attention text the protocol runs on `dataset` (a pipeline's text, or the preset's spec)."""
    from ..segment.pipelines import find_pipeline

    if find_pipeline(protocol.attention) is not None:
        return protocol.pipeline_text(dataset)
    return str(protocol.spec_for(dataset))


def _canonical(text: str) -> str:
    """A spec's canonical text (a pipeline's as written)."""
    from ..segment.pipelines import find_pipeline

    return text if find_pipeline(text) is not None else str(AttentionSpec.parse(text))


def _up_to_normalizer(text: str) -> str:
    """A spec's text with its normalizer set to softmax; a pipeline's text without its `/NORMALIZER`."""
    from ..segment.pipelines import find_pipeline

    if find_pipeline(text) is not None:
        return text.partition("/")[0]
    return str(AttentionSpec.parse(text).replace(normalizer="softmax"))


def _normal(value: Any) -> Any:
    """Settings as a result file stores them (JSON: tuples become lists)."""
    return list(value) if isinstance(value, tuple) else value


# Each method registers its paper's numbers in its own module, next to its protocol.
PUBLISHED: Registry[Published] = Registry("published result", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP)


def register_published(
    protocol: Protocol,
    miou: Mapping[str, float],
    source: str,
    *,
    clip: str | None = None,
    note: str = "",
    printed_average: float | None = None,
) -> Published:
    """Register what a paper reports for `protocol` (keyed by the protocol's name). `clip` (`NAME:TAG`): the
    CLIP the paper measured with, when it is not the protocol's own (`Protocol.clip_weights`)."""
    model, pretrained = clip.split(":", 1) if clip else protocol.clip_weights()
    unknown = sorted(set(miou) - set(DATASETS.names()))
    if unknown:
        raise ValueError(f"published numbers of {protocol.name}: unknown benchmark(s) {unknown}")
    if not all(math.isfinite(v) and 0 <= v <= 100 for v in miou.values()):
        raise ValueError(f"published numbers of {protocol.name}: an mIoU outside 0..100")
    entry = Published(protocol.name, model, pretrained, dict(miou), source, note, printed_average)
    return PUBLISHED.register(protocol.name, entry, help=source, module=caller_module())


def comparison(config: Mapping[str, Any], value: float, tolerance: float = TOLERANCE) -> Comparison | None:
    """The published number beside a result (its config and metric value), or None where no paper reports
    that run (see `Published.compare`)."""
    for name in PUBLISHED.names():
        found = PUBLISHED.get(name).compare(config, value, tolerance)
        if found is not None:
            return found
    return None


def published_for_preset(preset: str) -> list[Published]:
    """The entries whose protocol runs `preset` (its softmax form): what `ls presets` shows beside it."""
    base = preset.removesuffix("-entmax")
    return [PUBLISHED.get(n) for n in PUBLISHED.names() if PROTOCOLS.get(PUBLISHED.get(n).protocol).attention == base]


__all__ = ["EIGHT", "PUBLISHED", "TOLERANCE", "Comparison", "Published", "comparison", "published_for_preset", "register_published"]
