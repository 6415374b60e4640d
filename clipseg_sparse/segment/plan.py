"""What one run of a spec needs, worked out once (`Plan`), the forwards a run picks from (`FORWARDS`), and one
image through a plan (`ImageRun`).

A run is a forward (a registered name: the plain sliding windows, `segment/windows.py`, or one a method
registers in its own room: Trident's splice, `methods/trident.py`; OV-Stitcher's stitched windows,
`methods/ovstitcher.py`) followed by a fixed chain of stages (`stages.KINDS`). `Plan.of(spec, settings, clip)`
holds the spec, the settings, every stage that runs (the spec's `hook:` stages merged with the settings'),
what they need besides CLIP (`stages.Needs`: backbones, whole-image features, region maps, an image bank) and
the forward. Every check that spans more than one part of a run (a stage the forward cannot run, two
forwards asked for, a spec past the model's depth) is made here, before any image; the Segmenter, the bank
builder, `analyze` and `explain` read the same plan.

A forward owns the part of a run between the network input and the N_names x H x W cosine map: which pixels
it cuts (`pixels`), how its windows meet (`cosine`), and the attention the edited block computes on them
(`attention`: what `analyze` and `explain` read, so every preset that segments can be explained). A spec
option or a stage asks for a forward by name (`stages.Needs.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from ..attention import AttentionSpec, resolve_spec
from ..errors import UserValueError
from ..models.backbones import Backbone
from ..models.clip import DenseCLIP
from ..models.proxies import ProxyBackbones, WholeImageFeatures
from ..registry import ENTRY_POINT_GROUP, Registry
from ..stages import Needs, Stage, merged_stages, resolve_stages
from .maps import CosineMap
from .preprocess import input_regions, prepare
from .settings import InferenceSettings

@dataclass(frozen=True)
class AttentionWindow:
    """The attention of the last edited block over one window (or the whole image): `maps` heads x N x N
    (CLS first when the spec keeps it), over a token `grid` that covers the window's pixels `box` =
    (y1, y2, x1, x2) of the network input padded by `pad` = (left, right, top, bottom) (negative: cut)."""

    box: tuple[int, int, int, int]
    pad: tuple[int, int, int, int]
    grid: tuple[int, int]
    maps: torch.Tensor

    @property
    def crop(self) -> tuple[int, int]:
        """Pixels (H, W) the grid covers: the window with its padding."""
        y1, y2, x1, x2 = self.box
        left, right, top, bottom = self.pad
        return y2 - y1 + top + bottom, x2 - x1 + left + right


class Forward:
    """One way from the network input to cosine maps (see the module docstring). Subclasses set `kinds`
    (the stage kinds among `plan.FORWARD_KINDS` they run) and `image_wide` (whether `attention` already
    covers the whole image with the run's own windows: `explain` then keeps them)."""

    name: str = ""
    kinds: frozenset[str] = frozenset()
    image_wide: bool = False

    def check(self, plan: Plan) -> None:
        """UserValueError for a spec or settings this forward cannot run (before any model)."""

    def check_model(self, plan: Plan, clip) -> None:
        """UserValueError for what this forward needs of the model (before any image)."""

    def refusal(self, stage: Stage, plan: Plan) -> str:
        """Why `stage`, of a kind this forward does not run, cannot run with `plan`."""
        return f"stage {stage.name} cannot run in the {self.name} forward of spec {plan.spec}"

    def pixels(self, image: np.ndarray, clip, settings: InferenceSettings) -> torch.Tensor:
        """The 1 x 3 x H' x W' network input the windows are cut from (`preprocess.prepare`)."""
        return prepare(image, clip, settings)

    def cosine(self, run: ImageRun) -> CosineMap:
        """N_names x H x W raw cosine at `run.out_size`, factored (`maps.CosineMap`)."""
        raise NotImplementedError

    def attention(self, run: ImageRun, whole_image: bool = False) -> Iterator[AttentionWindow]:
        """The edited block's attention the cosine is made of, one window at a time; with `whole_image`, over
        one window holding the whole image where the forward's windows are independent (`explain`)."""
        raise NotImplementedError


# the plain windows are built in (`segment/windows.py`); methods register theirs in their rooms
FORWARDS: Registry[Forward] = Registry(
    "forward", locations=("clipseg_sparse.segment.windows", "clipseg_sparse.methods"), group=ENTRY_POINT_GROUP
)



#: the forward of a run whose spec and stages ask for none
DEFAULT_FORWARD = "windows"


@dataclass(frozen=True)
class Plan:
    """One spec under one set of settings: its stages, needs and forward (see the module docstring)."""

    spec: AttentionSpec
    settings: InferenceSettings
    stages: tuple[Stage, ...]  # every stage that runs, in order
    given: tuple[Stage, ...]  # the settings' stages among them (`InferenceSettings.stages`, PAMR), as result files list them
    needs: Needs
    forward_name: str

    @classmethod
    def of(cls, spec: AttentionSpec | str | None, settings: InferenceSettings | None = None, clip=None) -> "Plan":
        """The plan of `spec` under `settings` (default settings); UserValueError for a combination that
        cannot run. With `clip`, also what that model cannot run (a ViT-L spec on a ViT-B, `check_model`)."""
        spec = resolve_spec(spec)
        settings = settings or InferenceSettings()
        given = resolve_stages(settings.stage_texts())
        stages = merged_stages(spec.stages, given)
        needs = spec.needs
        for stage in given:
            needs |= stage.needs
        asked = dict(needs.forward)
        if len(asked) > 1:
            (a, why_a), (b, why_b) = list(asked.items())[:2]
            raise UserValueError(f"{why_a} runs in the {a} forward and {why_b} in the {b} forward: one forward at a time")
        plan = cls(spec, settings, stages, given, needs, next(iter(asked), DEFAULT_FORWARD))
        plan.check()
        if clip is not None:
            plan.check_model(clip)
        return plan

    @cached_property
    def forward(self) -> Forward:
        return FORWARDS.get(self.forward_name)

    def of_kind(self, kind: str) -> tuple[Stage, ...]:
        """The stages of one kind, in the order they run."""
        return tuple(s for s in self.stages if s.kind == kind)

    def added_token_stages(self) -> tuple[Stage, ...]:
        """The token stages the settings add: the spec's own (`hook:`) run inside the encoder
        (`attention.blocks.encode_tokens`), which gets these after them."""
        return tuple(s for s in self.given if s.kind == "token")

    @property
    def backbones(self) -> tuple[str, ...]:
        """The external backbones the run uses (spec terms and stages), for loading and result files."""
        return self.needs.backbones

    def check(self) -> None:
        """UserValueError for what the forward cannot run: its own rules, then a stage of a kind it does not
        run (`Forward.kinds`, among FORWARD_KINDS)."""
        forward = self.forward
        forward.check(self)
        for stage in self.stages:
            if stage.kind in FORWARD_KINDS and stage.kind not in forward.kinds:
                raise UserValueError(forward.refusal(stage, self))

    def check_model(self, clip) -> None:
        """UserValueError, before any image, for what `clip` cannot run: the spec (`DenseCLIP.check_spec`:
        depth, taps, adapters), then what the forward needs of the model (patch-size multiples)."""
        clip.check_spec(self.spec)
        self.forward.check_model(self, clip)


#: stage kinds a forward says it runs or not (`Forward.kinds`): those inside it, and retrieval, which needs the
#: averaged map at the network input's size; text, input, post, labels and refine stages run after any forward
FORWARD_KINDS = ("token", "match", "windows", "global", "retrieval")


def whole_image_maps(image: np.ndarray, names, backbones: ProxyBackbones, device) -> dict[str, torch.Tensor]:
    """Backbone name -> 1 x C x h x w raw whole-image feature map of the original RGB image on the backbone's
    patch grid (`Backbone.image_feature_map`: one run per image for CorrCLIPv2's `ext:NAME.image` taps and its
    bank keys)."""
    return {name: backbones.get(name, device).image_feature_map(torch.from_numpy(np.array(image))) for name in names}


@dataclass
class ImageRun:
    """Everything one image's forward and stages read (the `stages.ImageRun` protocol): the plan, the model,
    the text, the original image, the network input (`Forward.pixels`), the image's region map at its size,
    the run's backbones, the whole-image features of the spec's `ext:NAME.image` taps (`image_features`, read
    by each window) and of the bank's key backbone (`key_features`), the image bank and its stores' text
    embeddings, and the vocabulary the text embeds (FreeCP's class descriptions, FLOSS's rankings are per name);
    `kept`: what one stage leaves for a later one on the same image, under a key of the method's own (so work
    done once per image is not done again, and the engine names no method).

    raw: the forward gives unnormalised projected features (`text` the identity: CorrCLIPv2's bank values).
    """

    plan: Plan
    clip: DenseCLIP
    text: torch.Tensor | None  # N_names x D (None: the windows' features alone, FG-OVD's pooling)
    image: np.ndarray | None  # the original RGB image (None: the network input alone)
    pixels: torch.Tensor
    regions: torch.Tensor | None
    backbones: ProxyBackbones
    image_features: Mapping[str, torch.Tensor] = field(default_factory=dict)
    bank: Any = None  # segment.bank.ImageBank of retrieval stages
    key_features: torch.Tensor | None = None  # 1 x C x h x w raw map of the bank's key backbone (its patch grid)
    store_texts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    raw: bool = False
    vocabulary: Any = None  # segment.vocabulary.Vocabulary whose names `text` embeds (stages that read names)
    templates: tuple[str, ...] = ()  # the vocabulary's templates, for a forward that embeds words of its own (CLIPer's background)
    kept: dict[str, Any] = field(default_factory=dict)  # what a stage leaves a later stage of this image (Trident's SAM encoding)

    @classmethod
    @torch.inference_mode()
    def of(
        cls, plan: Plan, clip: DenseCLIP, text: torch.Tensor, image: np.ndarray, regions: np.ndarray | None, resources: Any,
        store_texts: Mapping[str, torch.Tensor] | None = None, vocabulary: Any = None, templates: tuple[str, ...] = (),
    ) -> "ImageRun":
        """The run of an RGB uint8 image; regions: its H x W region ids (or None), resized nearest with it;
        vocabulary: the names `text` embeds, for stages that read them."""
        pixels = plan.forward.pixels(image, clip, plan.settings)
        size = tuple(pixels.shape[-2:])
        bank = resources.bank if plan.needs.bank else None
        names = list(dict.fromkeys([*plan.needs.image_features, *([bank.proxy] if bank is not None else [])]))
        maps = whole_image_maps(image, names, resources.backbones, clip.device)  # each backbone run once
        return cls(
            plan, clip, text, image, pixels, input_regions(regions, size), resources.backbones,
            {name: WholeImageFeatures(maps[name], size) for name in plan.needs.image_features}, bank,
            maps[bank.proxy] if bank is not None else None, store_texts or {}, vocabulary=vocabulary, templates=tuple(templates),
        )  # fmt: skip

    @property
    def spec(self) -> AttentionSpec:
        return self.plan.spec

    @property
    def settings(self) -> InferenceSettings:
        return self.plan.settings

    @property
    def patch(self) -> int:
        return self.clip.patch_size

    @property
    def normalizer(self) -> str:
        return self.spec.normalizer

    @property
    def size(self) -> tuple[int, int]:
        """The network input's (H', W')."""
        return tuple(self.pixels.shape[-2:])

    @property
    def out_size(self) -> tuple[int, int]:
        """Where the forward's map is made: the network input's size when retrieval or input stages follow
        (they work there), else the original image's."""
        at_input = self.plan.of_kind("retrieval") or self.plan.of_kind("input")
        return self.size if at_input else tuple(self.image.shape[:2])

    def backbone(self, name: str) -> Backbone:
        return self.backbones.get(name, self.clip.device)

    def retrieve(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R x N_names support logits of the image bank per region, H' x W' index of each pixel's region) at the
        network input's size (`bank.region_support`)."""
        return self.bank.region_support(self.regions, self.key_features[0], self.store_texts, k)

    def context(self) -> dict:
        """The block context of the run's windows (`DenseCLIP.encode_dense`): the text and logit scale a
        `feedback` term reads, the backbones `ext:` taps run, whether features stay unnormalised."""
        return {
            **({"text": self.text.to(self.clip.device), "logit_scale": self.settings.logit_scale} if self.text is not None else {}),
            "backbones": self.backbones, **({"raw_features": True} if self.raw else {}),
        }  # fmt: skip
