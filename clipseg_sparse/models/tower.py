"""The seam between `DenseCLIP` and the image towers of CLIP families: the `Tower` protocol and `FAMILIES`.

`DenseCLIP` holds a `Tower`: what it needs of an image tower to embed pixels, hand the engine its blocks and
turn the last tokens into dense features and an image embedding. Each family lives in one file of
`families/` (open_clip's own ViT, the timm towers: EVA, SigLIP, PE-Core), registers there which open_clip
configurations are of it (`register_family`), and wraps a loaded model's image tower in its `Tower`.
Configurations no family runs (ResNet, CoCa, ConvNeXt, ...) are families too, with the reason they are refused.

`model_family(name, config)` asks the registered families in order, the catch-alls (`fallback`) last, as
open_clip's factory reads a config: from the config alone, before any weights. A family of another package
registers in its module of the entry-point group `clipseg_sparse.methods` (`registry.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..attention.spec import AttentionSpec
from ..errors import UserValueError
from ..registry import ENTRY_POINT_GROUP, Registry, caller_module

Tensor = torch.Tensor


@runtime_checkable
class Tower(Protocol):
    """What `DenseCLIP` needs of a family's image tower.

    visual: what `DenseCLIP.visual` gives and the engine runs: `transformer.resblocks` (each an
    `attention.contract.Block`), `ln_post` and `preprocess_cfg` (mean, std), as open_clip's
    VisionTransformer has them (that module itself, or a family's adapter that reads as one).
    device, dtype: of its weights. patch_size; grid_size: the native patch grid (h, w); prefix_tokens: the
    tokens before the patch grid (1 = the CLS token; 0 for SigLIP); embed_dim: the width D of its features.
    """

    @property
    def visual(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def patch_size(self) -> int: ...

    @property
    def grid_size(self) -> tuple[int, int]: ...

    @property
    def prefix_tokens(self) -> int: ...

    @property
    def embed_dim(self) -> int: ...

    def positional_embedding(self, grid: tuple[int, int], rule: str) -> Tensor | None:
        """The positional embeddings of the patch grid `grid` by `rule` ("size" or "scale", checked by
        `DenseCLIP.positional_embedding`), None for a tower without absolute positions."""
        ...

    def embed(self, pixels: Tensor, rule: str) -> tuple[Tensor, tuple[int, int]]:
        """Tokens B x (P + h*w) x C entering the first block and the patch grid (h, w), of pixels
        B x 3 x H x W (CLIP-normalised, on the tower's device and dtype, sides multiples of the patch)."""
        ...

    def final_norm(self) -> Callable[[Tensor], Tensor]:
        """The norm after the last block, as dense features read it (open_clip ViTs: in fp32 when reduced)."""
        ...

    def features(self, normed: Tensor) -> Tensor:
        """L2-normalised fp32 features ... x D of tokens ... x C after `final_norm`."""
        ...

    def dense_and_image(self, normed: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """`features` of the last n tokens (B x n x D) and the L2-normalised image embedding (B x D) of all
        tokens after `final_norm` (B x N x C)."""
        ...

    def refuse(self, spec: AttentionSpec, model_name: str) -> str | None:
        """Why this tower cannot run `spec` (written after "attention spec SPEC: "), None when it can."""
        ...


@dataclass(frozen=True)
class Family:
    """What an open_clip configuration is: family name, image-tower kind, why dense inference is refused
    (None when it runs), and for a family that runs, `wrap(model)`: the `Tower` of a loaded model."""

    name: str
    tower: str
    reason: str | None = None
    wrap: Callable[[torch.nn.Module], Tower] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.reason is None) != (self.wrap is not None):
            raise TypeError(f"family {self.name!r}: a family either runs (wrap, no reason) or is refused (a reason, no wrap)")


Match = Callable[[str, dict], "Family | None"]


@dataclass(frozen=True)
class FamilyRule:
    """A registered family: `match(name, config)` is the `Family` of open_clip configuration `name` (its JSON
    `config`) when it is of this family, else None. fallback: asked after every other family (catch-alls
    such as "any other open_clip ViT"), so a family registered later still comes before them."""

    match: Match
    fallback: bool = False


# Built-ins in match order: open_clip's ViT (and the open_clip configurations refused outright), then the timm
# towers (their refusals first).
FAMILIES: Registry[FamilyRule] = Registry(
    "model family",
    locations=tuple(
        f"clipseg_sparse.models.families.{name}" for name in ("openclip_vit", "timm_tower", "eva", "pe_core", "siglip")
    ),
    group=ENTRY_POINT_GROUP,
)


def register_family(name: str, match: Match, *, fallback: bool = False, help: str = "") -> FamilyRule:
    """Register family `name` (the `Family.name` its `match` gives) from its module (`ls` and `where` name it)."""
    return FAMILIES.register(name, FamilyRule(match, fallback), help=help, module=caller_module())


def timm_model_name(config: dict) -> str | None:
    """The timm model of a configuration's image tower (open_clip builds a `TimmModel` from it), None for
    open_clip's own towers."""
    return config.get("vision_cfg", {}).get("timm_model_name")


def model_family(name: str, config: dict) -> Family:
    """The family of open_clip configuration `name` (its JSON `config`), read from the config alone."""
    rules = [FAMILIES.get(n) for n in FAMILIES]
    for rule in [r for r in rules if not r.fallback] + [r for r in rules if r.fallback]:
        family = rule.match(name, config)
        if family is not None:
            return family
    raise LookupError(f"no model family matches {name!r}; families: {', '.join(FAMILIES.names())}")


def wrap_tower(model: torch.nn.Module, name: str, config: dict | None = None) -> Tower:
    """The image tower of loaded open_clip `model`, wrapped by its family. config: the model's open_clip
    configuration (default: the one open_clip has registered under `name`; none, an open_clip ViT, for a
    name it does not know)."""
    if config is None:
        import open_clip

        config = open_clip.get_model_config(name) or {}
    family = model_family(name, config)
    if family.wrap is None:
        raise UserValueError(f"model {name!r} is not supported: {family.reason}; see `clipseg-sparse ls models`")
    return family.wrap(model)
