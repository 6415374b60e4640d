"""Evaluation protocols: the inference settings each published repository uses per benchmark.

A protocol maps a dataset to `InferenceSettings` (short side, sliding window, logit scale, background
probability threshold `prob_thd`, SCLIP's `area_thd`, PAMR) and names the attention preset and
class-name set it pairs with. Values are read from the repositories' mmseg configs (`configs/cfg_*.py`)
and their segmentor defaults, at the commits given in `source`. The protocols also follow the code
below the configs: mmcv's OpenCV resize of the uint8 image (`resize="opencv"`), the positional-embedding
scale factor (n + 0.1) / native (`pos_interp="scale"`), window sides that are not whole patches cut by
the patch convolution (SCLIP, NACLIP) or zero-padded centred (ClearCLIP) (`remainder`), and the saved
probabilities (SCLIP's area threshold zeroes classes; NACLIP renormalises, `renormalize`). Precedence,
written once in `Protocol.settings`: overrides (command line) > protocol per dataset > protocol
defaults > `InferenceSettings` defaults.

A protocol may name the CLIP its paper's numbers were measured with (`model`, `pretrained`: `corrclip-metaclip`
runs MetaCLIP fullcc B/16 with nothing else given); `Protocol.clip_weights` writes that precedence once:
command line > protocol > library default (`models.clip.DEFAULT_MODEL`, `DEFAULT_PRETRAINED`). Result files
record the weights that were loaded.

Not reproduced: every published repository runs CLIP in fp16 on GPU (ClearCLIP creates its OpenCLIP
model with precision='fp16'; SCLIP and NACLIP load OpenAI's `clip`, whose `build_model` converts the
weights to half, cast back to float only on CPU): choose `--precision fp16` yourself on a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..attention import AttentionSpec
from ..attention.presets import ENTMAX_ALPHA
from ..models.clip import DEFAULT_MODEL, DEFAULT_PRETRAINED
from ..segment.settings import InferenceSettings
from ..registry import ENTRY_POINT_GROUP, Registry, caller_module


def _settings_text(settings: Mapping[str, Any]) -> str:
    """`resolution=336, stages=pamr`: settings as `ls protocols` prints them."""
    return ", ".join(
        f"{k}={','.join(v)}" if isinstance(v, tuple) else f"{k}={v}" if isinstance(v, (bool, str)) else f"{k}={v:g}" for k, v in settings.items()
    )


@dataclass(frozen=True)
class Protocol:
    """Per-dataset inference settings of one published evaluation, plus its default pairings."""

    name: str
    attention: str  # attention preset (or pipeline, segment/pipelines.py) the protocol was published with
    class_names: str  # class-name set its repository ships
    source: str  # repository@commit the values are read from
    defaults: Mapping[str, Any] = field(default_factory=dict)  # for every dataset
    per_dataset: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # dataset -> the text of `attention` with that dataset's published constants (ResCLIP's lambda, tau, temp_thd)
    attention_per_dataset: Mapping[str, str] = field(default_factory=dict)
    # the CLIP the paper reports with this protocol (open_clip name, pretrained tag); None: the library default
    model: str | None = None
    pretrained: str | None = None
    # the prompt templates the repository embeds names with (`resolve_templates`: a named set or a file), for every
    # dataset and per dataset where they differ (CLIPer's); None: the caller's default (eval: openai)
    templates: str | None = None
    templates_per_dataset: Mapping[str, str] = field(default_factory=dict)

    def describe(self, help: str) -> dict[str, str]:
        """`ls protocols`: the attention preset, class names and CLIP weights it pairs with (model and tag, where
        it names them), and its settings (all datasets, then per dataset)."""
        clip = "".join(f"\n{v}" for v in (self.model, self.pretrained) if v)  # none: the library default
        return {
            "attention / names / CLIP": f"{self.attention} / {self.class_names}{clip}", "all datasets": _settings_text(self.defaults),
            "per dataset": "\n".join(f"{ds}: {_settings_text(d)}" for ds, d in self.per_dataset.items()),
            "follows (source)": f"{help}\n{self.source}",
        }

    def settings(self, dataset: str, overrides: Mapping[str, Any] | None = None) -> InferenceSettings:
        """InferenceSettings for `dataset`; `overrides` entries that are None are ignored, unknown ones
        raise ValueError."""
        return (
            InferenceSettings()
            .replace(**self.defaults)
            .replace(**self.per_dataset.get(dataset, {}))
            .replace(**dict(overrides or {}))
        )

    def pipeline_text(self, dataset: str, text: str | None = None) -> str:
        """The `NAME[:ARGS][/NORMALIZER]` text of a pipeline to run on `dataset` (segment/pipelines.py): the
        protocol's own up to its normalizer (None, its bare name, NAME-entmax, NAME/NORMALIZER) with the
        dataset's published constants, the normalizer kept; any other text as given."""
        text = self.attention if text is None else text
        base, slash, normalizer = text.partition("/")
        if base == f"{self.attention}-entmax" and not slash:
            base, slash, normalizer = self.attention, "/", f"entmax:{ENTMAX_ALPHA:g}"
        if base != self.attention:
            return text
        return self.attention_per_dataset.get(dataset, base) + slash + normalizer

    def templates_for(self, dataset: str) -> str | None:
        """The templates the protocol embeds `dataset`'s names with (None: it sets none)."""
        return self.templates_per_dataset.get(dataset, self.templates)

    def clip_weights(self, model: str | None = None, pretrained: str | None = None) -> tuple[str, str]:
        """(model, pretrained) to load, each the given value (command line, grid) if not None, else the
        protocol's, else the library default. Field by field: `--model ViT-L-14-quickgelu` with
        `corrclip-metaclip` loads ViT-L-14-quickgelu with the protocol's metaclip_fullcc."""
        return (
            model if model is not None else self.model or DEFAULT_MODEL,
            pretrained if pretrained is not None else self.pretrained or DEFAULT_PRETRAINED,
        )

    def spec_for(self, dataset: str, spec: AttentionSpec | str | None = None) -> AttentionSpec:
        """The spec to run on `dataset` (None: the protocol's preset). A spec that is the protocol's preset
        up to its normalizer (`resclip`, `resclip-entmax`, `resclip/entmax:1.3`) gets the dataset's
        published constants, its normalizer kept; any other spec runs as given."""
        from ..attention import PRESETS, resolve_spec

        spec = resolve_spec(spec if spec is not None else self.attention)
        variant = self.attention_per_dataset.get(dataset)
        base = PRESETS.get(self.attention).spec
        if variant is None or spec.replace(normalizer=base.normalizer) != base:
            return spec
        return AttentionSpec.parse(variant).replace(normalizer=spec.normalizer)


# Each method registers its protocol(s) in its own module (`clipseg_sparse.methods.<name>`, `PROTOCOL`).
PROTOCOLS: Registry[Protocol] = Registry("protocol", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP)


def register_weights_variant(base: Protocol, suffix: str, model: str, pretrained: str, reported: str) -> Protocol:
    """Protocol `BASE-SUFFIX`: `base` with the CLIP its paper's table reports beside OpenAI's (`reported`: where,
    and the table's avg-8 mIoU), so `eval --protocol BASE-SUFFIX` loads those weights with no --model."""
    variant = dataclasses.replace(base, name=f"{base.name}-{suffix}", model=model, pretrained=pretrained)
    help = f"{PROTOCOLS.help(base.name)}; CLIP {model}:{pretrained} ({reported})"
    return PROTOCOLS.register(variant.name, variant, help=help, module=caller_module())


# What every published pipeline does below the configs (mmcv / mmseg, the repos' CLIP code): mmcv's
# cv2.resize of the uint8 image, positional embeddings by scale factor (n + 0.1) / native, and window or
# image sides that are not whole patches cut by the patch convolution (ClearCLIP pads its windows, centred).
MMSEG_CODE = dict(resize="opencv", pos_interp="scale", remainder="drop")
# NACLIP's configs are SCLIP's with the logit scale and area threshold left at their defaults.
SCLIP_LINE = dict(resolution=336, window=224, stride=112, logit_scale=40.0, **MMSEG_CODE)
SCLIP_LINE_SIZES = {"coco-stuff": dict(resolution=448), "cityscapes": dict(resolution=560)}
BG_DATASETS = ("voc21", "context60", "coco-object")  # the benchmarks with a background class

