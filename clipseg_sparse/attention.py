"""The attention spec: one value that describes every training-free edit of CLIP's last block(s).

A spec has a score *source* (which projections are compared), a row *normalizer*, an optional
neighbourhood *prior*, a temperature, whether the edited blocks keep their residual and FFN, how many
final blocks are edited, and an optional negative (DnA-style) branch. Published methods are named presets.

Compact text form, used on the command line, in sweep grids, result files and table rows:

    SOURCE/NORMALIZER[/OPTION...]
    SOURCE      qk | qq | kk | vv | id | a sum such as qq+kk (each term normalised, then summed)
    NORMALIZER  softmax | entmax:ALPHA | sparsemax | randmask:ALPHA
    OPTION      gauss:SIGMA   NACLIP's Gaussian neighbourhood prior on the patch grid (added to logits)
                temp:T        score scale (default 1/sqrt(head_dim))
                nores         drop the residual connection in the edited blocks
                noffn         drop the FFN in the edited blocks
                layers:N      edit the last N blocks (default 1)
                neg:W         add W * softmin(S) V, the training-free negative branch of DnA

`str(spec)` writes the canonical form, and `AttentionSpec.parse(str(spec)) == spec`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .accel import adasplash_entmax_attention, can_use_adasplash
from .normalizers import Normalizer, normalize
from .registry import Registry

SOURCES = ("qk", "qq", "kk", "vv", "id")


@dataclass(frozen=True)
class AttentionSpec:
    """How the last `layers` blocks of a CLIP ViT compute attention. Defaults = unmodified CLIP."""

    source: tuple[str, ...] = ("qk",)
    normalizer: str = "softmax"
    gauss_sigma: float | None = None
    temperature: float | None = None
    residual: bool = True
    ffn: bool = True
    layers: int = 1
    negative: float = 0.0

    def __post_init__(self) -> None:
        source = (self.source,) if isinstance(self.source, str) else tuple(self.source)
        if not source:
            raise ValueError("attention source is empty")
        for term in source:
            if term not in SOURCES:
                raise ValueError(f"unknown attention source {term!r}; choose from {', '.join(SOURCES)} or a sum such as qq+kk")
        if "id" in source and len(source) > 1:
            raise ValueError("source 'id' (value path only) cannot be summed with other sources")
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "normalizer", str(Normalizer.parse(self.normalizer)))
        if self.gauss_sigma is not None and not self.gauss_sigma > 0:
            raise ValueError(f"gauss sigma must be > 0 (got {self.gauss_sigma})")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature})")
        if not (isinstance(self.layers, int) and self.layers >= 1):
            raise ValueError(f"layers must be an integer >= 1 (got {self.layers})")

    # -- text form -------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "AttentionSpec":
        """Parse a preset name (`sclip`) or the compact form (`qq+kk/entmax:1.5/nores`)."""
        text = text.strip()
        if text in PRESETS:
            return PRESETS.get(text).spec
        if "/" not in text and "+" not in text and text not in SOURCES:
            raise ValueError(
                f"unknown attention spec {text!r}: not a preset ({', '.join(PRESETS.names())}) and not of the "
                f"form SOURCE/NORMALIZER, e.g. qq/entmax:1.5; sources: {', '.join(SOURCES)}"
            )
        source_text, *rest = text.split("/")
        kwargs: dict = {"source": tuple(t.strip() for t in source_text.split("+"))}
        options = list(rest)
        if options and options[0].split(":")[0] in ("softmax", "entmax", "sparsemax", "randmask"):
            kwargs["normalizer"] = options.pop(0)
        for opt in options:
            name, _, arg = opt.partition(":")
            try:
                if name == "gauss":
                    kwargs["gauss_sigma"] = float(arg)
                elif name == "temp":
                    kwargs["temperature"] = float(arg)
                elif name == "nores" and not arg:
                    kwargs["residual"] = False
                elif name == "noffn" and not arg:
                    kwargs["ffn"] = False
                elif name == "layers":
                    kwargs["layers"] = int(arg)
                elif name == "neg":
                    kwargs["negative"] = float(arg)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"bad option {opt!r} in attention spec {text!r}; options: gauss:SIGMA, temp:T, nores, "
                    f"noffn, layers:N, neg:W; normalizers: softmax, entmax:ALPHA, sparsemax, randmask:ALPHA"
                ) from None
        return cls(**kwargs)

    def __str__(self) -> str:
        parts = ["+".join(self.source), self.normalizer]
        if self.gauss_sigma is not None:
            parts.append(f"gauss:{self.gauss_sigma:g}")
        if self.temperature is not None:
            parts.append(f"temp:{self.temperature:g}")
        if not self.residual:
            parts.append("nores")
        if not self.ffn:
            parts.append("noffn")
        if self.layers != 1:
            parts.append(f"layers:{self.layers}")
        if self.negative:
            parts.append(f"neg:{self.negative:g}")
        return "/".join(parts)

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    @property
    def is_identity(self) -> bool:
        """True when the spec leaves CLIP unchanged, so no block needs to be re-run by hand."""
        return self == AttentionSpec()


@dataclass(frozen=True)
class Preset:
    spec: AttentionSpec
    reference: str


PRESETS: Registry[Preset] = Registry("attention preset")


def register_preset(name: str, text: str, reference: str) -> None:
    PRESETS.register(name, Preset(AttentionSpec.parse(text), reference), help=reference)


register_preset("clip", "qk/softmax", "unmodified CLIP (Radford et al., ICML 2021)")
register_preset(
    "maskclip",
    "id/softmax",
    "MaskCLIP (Zhou et al., ECCV 2022): last block uses the value path only (no q-k attention); "
    "residual and FFN kept",
)
register_preset(
    "sclip",
    "qq+kk/softmax",
    "SCLIP (Wang et al., ECCV 2024): correlative self-attention softmax(qq)+softmax(kk); residual and FFN kept",
)
register_preset(
    "clearclip",
    "qq/softmax/nores/noffn",
    "ClearCLIP (Lan et al., ECCV 2024): q-q attention, residual and FFN dropped",
)
register_preset(
    "naclip",
    "kk/softmax/gauss:5/nores/noffn",
    "NACLIP (Hajimiri et al., WACV 2025): k-k attention plus a Gaussian neighbourhood prior (sigma 5 patches); "
    "residual and FFN dropped",
)
for _name in ("sclip", "clearclip", "naclip"):
    _base = PRESETS.get(_name).spec
    register_preset(
        f"{_name}-entmax",
        str(_base.replace(normalizer="entmax:1.5")),
        f"{_name} with alpha-entmax (alpha 1.5) instead of softmax (this project)",
    )


def list_presets() -> list[str]:
    return PRESETS.names()


def resolve_spec(spec: "AttentionSpec | str | None") -> AttentionSpec:
    """Accept a spec, its text form or a preset name; None means unmodified CLIP."""
    if spec is None:
        return AttentionSpec()
    return spec if isinstance(spec, AttentionSpec) else AttentionSpec.parse(spec)


# -- the edited block --------------------------------------------------------------------------------
def gaussian_prior(grid: tuple[int, int], sigma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """NACLIP's neighbourhood window: (1+hw) x (1+hw) logits bias, exp(-d^2 / 2 sigma^2) between patches.

    d is the distance on the patch grid; the CLS row and column get 0 (the prior is for patch tokens only).
    """
    h, w = grid
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    pos = torch.stack([ys.flatten(), xs.flatten()], -1).float()
    window = torch.exp(-torch.cdist(pos, pos).pow(2) / (2 * sigma**2))
    return F.pad(window, (1, 0, 1, 0)).to(dtype)


def edited_block_forward(
    block: torch.nn.Module, x: torch.Tensor, spec: AttentionSpec, grid: tuple[int, int]
) -> torch.Tensor:
    """Run one open_clip `ResidualAttentionBlock` with the attention described by `spec`.

    x: B x N x C tokens (batch first, CLS at index 0, then the h x w patch grid row-major).
    Uses the block's own weights (`attn.in_proj_weight`, `attn.out_proj`, `ln_1`, `ln_2`, `mlp`, `ls_*`)
    and changes none of them.
    """
    attn = block.attn
    if not isinstance(attn, torch.nn.MultiheadAttention):
        raise TypeError(
            f"attention edits need open_clip's default ResidualAttentionBlock (nn.MultiheadAttention), "
            f"got {type(attn).__name__}"
        )
    B, N, C = x.shape
    H = attn.num_heads
    d = C // H
    y = block.ln_1(x)
    q, k, v = F.linear(y, attn.in_proj_weight, attn.in_proj_bias).view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
    if spec.source == ("id",):
        out = v
    else:
        out = _attend(q, k, v, spec, grid)
    out = attn.out_proj(out.transpose(1, 2).reshape(B, N, C))
    x = (x if spec.residual else 0) + block.ls_1(out)
    if spec.ffn:
        x = x + block.ls_2(block.mlp(block.ln_2(x)))
    return x


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, grid: tuple[int, int]) -> torch.Tensor:
    """sum over source terms of normalize(scale * S_term + prior) @ v;  q, k, v: B x H x N x d."""
    scale = spec.temperature if spec.temperature is not None else q.shape[-1] ** -0.5
    prior = gaussian_prior(grid, spec.gauss_sigma, q.device, q.dtype) if spec.gauss_sigma else None
    proj = {"q": q, "k": k, "v": v}
    norm = Normalizer.parse(spec.normalizer)
    out = torch.zeros_like(v)
    for term in spec.source:
        a, b = proj[term[0]], proj[term[1]]
        scores = None  # the N x N matrix, built only where a path needs it, and then once
        if norm.kind == "softmax":  # fused kernel, no N x N matrix kept around
            out = out + F.scaled_dot_product_attention(a, b, v, attn_mask=prior, scale=scale)
        elif norm.kind in ("entmax", "sparsemax") and can_use_adasplash(a, prior is not None):
            out = out + adasplash_entmax_attention(a, b, v, norm.alpha, scale)
        else:
            scores = (a @ b.transpose(-2, -1)) * scale
            out = out + normalize(scores if prior is None else scores + prior, norm) @ v
        if spec.negative:
            if scores is None:
                scores = (a @ b.transpose(-2, -1)) * scale
            out = out + spec.negative * (torch.softmax(-scores.float(), dim=-1).to(v.dtype) @ v)
    return out

