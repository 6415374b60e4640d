"""Every knob between pixels and labels, checked when the settings are made (not at the first image).

The defaults follow the published training-free code (SCLIP / mmseg); the evaluation protocols set what
each repository does differently (`evaluation/protocols.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import UserValueError
from ..models.clip import POS_INTERP_RULES
from ..stages import resolve_stages


@dataclass(frozen=True)
class InferenceSettings:
    """Every knob between pixels and labels. 0 disables resolution (keep size), max_long_side (no cap) and
    window (whole image)."""

    resolution: int = 336
    max_long_side: int = 2048
    window: int = 224
    stride: int = 112
    logit_scale: float = 40.0
    bg_threshold: float = 0.0
    area_threshold: float = 0.0
    batch_size: int = 16
    pamr: bool = False  # PAMR post stage (stages.py), NACLIP's default
    stages: tuple[str, ...] = ()  # further registered stages (`ls stages`), as text: NAME[:ARGS]
    # how the published mmseg code differs from our defaults (the protocols choose theirs):
    resize: str = "torch"  # torch: bilinear on floats; opencv: cv2.resize on the uint8 image (mmcv)
    pos_interp: str = "size"  # positional embeddings: "size" (exact grid) or "scale" ((n + 0.1) / native)
    remainder: str = "pad"  # window pixels past the last whole patch: pad, centre or drop (see window_geometry)
    renormalize: bool = False  # saved probabilities divided by their sum after the synonym max (NACLIP)
    # resized sides rounded up to a multiple of this and to >= window (Trident: 16); 0: off, or the patch size
    # when a global stage splices the windows
    size_multiple: int = 0
    # how: "each" side rounded up alone, or "longer": both sides first scaled by (the longer side rounded up) /
    # the longer side, then each rounded up (Trident's `preprocess_image`); see `preprocess.rounded_size`
    size_rule: str = "each"

    def __post_init__(self) -> None:
        for name, choices in (("resize", RESIZE_METHODS), ("pos_interp", POS_INTERP_RULES), ("remainder", REMAINDER_RULES), ("size_rule", SIZE_RULES)):
            if getattr(self, name) not in choices:
                raise UserValueError(f"{name} must be one of {', '.join(choices)} (got {getattr(self, name)!r})")
        if isinstance(self.stages, str):
            raise UserValueError(f"stages must be a list of stage names (got the string {self.stages!r})")
        object.__setattr__(self, "stages", tuple(self.stages))
        resolve_stages(self.stage_texts())  # unknown names and bad arguments fail here
        for name in ("resolution", "window", "max_long_side", "size_multiple"):
            if getattr(self, name) < 0:
                raise UserValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.window and not 0 < self.stride <= self.window:
            raise UserValueError(f"stride must be in (0, window] (got stride {self.stride}, window {self.window})")
        if not 0.0 <= self.bg_threshold <= 1.0 or not 0.0 <= self.area_threshold <= 1.0:
            raise UserValueError("bg_threshold and area_threshold must be in [0, 1]")
        if self.batch_size < 1 or self.logit_scale <= 0:
            raise UserValueError("batch_size must be >= 1 and logit_scale > 0")

    def stage_texts(self) -> tuple[str, ...]:
        """Every stage to run, in order: `stages`, then PAMR when `pamr` is on."""
        return self.stages + (("pamr",) if self.pamr else ())

    def replace(self, **changes: object) -> "InferenceSettings":
        """A validated copy with `changes`; None values are ignored (an option left unset). Unknown names
        raise UserValueError listing the settings."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise UserValueError(f"unknown inference setting(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


RESIZE_METHODS = ("torch", "opencv")
REMAINDER_RULES = ("pad", "centre", "drop")
SIZE_RULES = ("each", "longer")
