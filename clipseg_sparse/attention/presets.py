"""Helpers for named specs. The presets themselves live with their methods (`clipseg_sparse.methods`, one
module each: the paper, the published code's quirks copied and fixed in `Preset.notes`, also in docs/datasets.md);
`PRESETS` lives with the spec (`attention/spec.py`)."""

from __future__ import annotations

from ..registry import caller_module
from .spec import PRESETS, AttentionSpec, Preset


def register_preset(name: str, text: str, reference: str, notes: str = "", module: str | None = None) -> None:
    """Register `text` as preset `name`; `module` (default: the caller's) is where `ls presets` says it lives."""
    PRESETS.register(name, Preset(AttentionSpec.parse(text), reference, notes), help=reference, module=module or caller_module())


ENTMAX_ALPHA = 1.5  # the alpha of every `NAME-entmax` preset and pipeline


def register_entmax_variant(name: str, alpha: float = ENTMAX_ALPHA, module: str | None = None) -> None:
    """`NAME-entmax`: entmax replaces every normalizer slot of NAME (its groups and any iteration)."""
    base = PRESETS.get(name)
    register_preset(
        f"{name}-entmax",
        str(base.spec.replace(normalizer=f"entmax:{alpha:g}")),
        f"{name} with alpha-entmax (alpha {alpha:g}) instead of softmax (this project)",
        base.notes,
        module=module or caller_module(),
    )


def list_presets() -> list[str]:
    return PRESETS.names()


def resolve_spec(spec: "AttentionSpec | str | None") -> AttentionSpec:
    """Accept a spec, its text form or a preset name; None means unmodified CLIP."""
    if spec is None:
        return AttentionSpec()
    return spec if isinstance(spec, AttentionSpec) else AttentionSpec.parse(spec)
