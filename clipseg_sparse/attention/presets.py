"""Published methods as named specs. Each preset says which paper it follows and, where the published
code has quirks, which ones the spec copies and which it fixes (`Preset.notes`, also in datasets.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Registry
from .spec import AttentionSpec, fmt_num


@dataclass(frozen=True)
class Preset:
    spec: AttentionSpec
    reference: str
    notes: str = ""  # quirks of the published code copied or fixed


PRESETS: Registry[Preset] = Registry("attention preset")


def register_preset(name: str, text: str, reference: str, notes: str = "") -> None:
    PRESETS.register(name, Preset(AttentionSpec.parse(text), reference, notes), help=reference)


def register_entmax_variant(name: str, alpha: float = 1.5) -> None:
    """`NAME-entmax`: entmax replaces every normalizer slot of NAME (its groups and any iteration)."""
    base = PRESETS.get(name)
    register_preset(
        f"{name}-entmax",
        str(base.spec.replace(normalizer=f"entmax:{alpha:g}")),
        f"{name} with alpha-entmax (alpha {alpha:g}) instead of softmax (this project)",
        base.notes,
    )


def list_presets() -> list[str]:
    return PRESETS.names()


def resolve_spec(spec: "AttentionSpec | str | None") -> AttentionSpec:
    """Accept a spec, its text form or a preset name; None means unmodified CLIP."""
    if spec is None:
        return AttentionSpec()
    return spec if isinstance(spec, AttentionSpec) else AttentionSpec.parse(spec)


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
    register_entmax_variant(_name)

_SCCLIP = (
    "x@{pre}[cos,shift:1,scale:3,pos]+kk/softmax/cls:{cls}/noffn/avg/aggin:x@{pre}[cos,thresh:0.4]"
    "/aggout:x@{post}[cos,thresh:0.4]/in:sum@{first}-{last}/hook:lof"
)
_SCCLIP_NOTES = (
    "copied: LOF on squared Euclidean distances with the query's own k-distance as reach distance (k 30, "
    "outliers strictly above the float32 0.95 quantile), 3x3 neighbour-mean repair of the block input and of "
    "the layer the mid map reads (not of the output-aggregation layer or the multi-level sum), mean of the mid "
    "map over the whole map including its diagonal, '< 0.4 -> 0' aggregation with rows divided by sum + 1e-6, "
    "the multi-level branch without input aggregation, residual 0.3 x CLS, no CLS token in the output; "
    "fixed: LOF, its quantile and the mid-map mean are taken per window (the published code runs batch 1 and "
    "mixes images when batched), outlier cells use the grid's column count (the code divides by the row count, "
    "wrong on non-square grids)"
)
register_preset(
    "scclip",
    _SCCLIP.format(pre=9, post=4, first=4, last=10, cls=0.3),
    "SC-CLIP (Bai et al., arXiv 2411.15869), ViT-B/16 layer indices: LOF outlier repair, mid map from block 9 "
    "with shift 1, scale 3 and positive support averaged with softmax(kk), aggregation by block 9 before and "
    "block 4 after, multi-level input sum of blocks 4..10, residual 0.3 x CLS",
    _SCCLIP_NOTES,
)
register_preset(
    "scclip-l14",
    _SCCLIP.format(pre=17, post=7, first=9, last=19, cls=0.1),
    "SC-CLIP (Bai et al., arXiv 2411.15869), ViT-L/14 layer indices from the authors (SuleBai/SC-CLIP#5): mid "
    "map and input aggregation from block 17, output aggregation block 7, multi-level sum of blocks 9..19, "
    "residual 0.1 x CLS",
    _SCCLIP_NOTES,
)
register_preset(
    "gem",
    "vv[cos,temp:auto,iter:1]+kk[cos,temp:auto,iter:1]+qq[cos,temp:auto,iter:1]/softmax/noffn/layers:6/parallel/avg",
    "GEM (Bousselham et al., CVPR 2024): self-self attention of L2-normalised v, k and q with the adaptive "
    "temperature and one clustering step, mean of the three, on a parallel path over the last 6 blocks "
    "(residual kept, no FFN)",
    "copied: 6 blocks (gem_depth 7 gives range(1, 7)), temperature = mean token norm of the original path's "
    "ln_1 state x d^-1/2 per image, final maps applied to the unnormalised v, CLS included in the attention",
)
register_preset(
    "clipsurgery",
    "vv/softmax/noffn/layers:6/parallel/hook:surgery",
    "CLIP Surgery (Li et al., Pattern Recognition 2025): v-v self-attention on a parallel path over the last "
    "6 blocks (residual kept, no FFN, CLS from the original path) and feature surgery on the text side",
    "copied: 6 blocks (range(1, 7)), v-v attention with the usual 1/sqrt(d) and no normalisation (ViT "
    "setting), the new path reads ln_1 of the original path, feature surgery with its hard-coded factor 2 "
    "(its t argument is unused); fixed: feature surgery per window (the published reshape works for batch 1 "
    "only); not copied (protocol or demo matters): the positional embedding resized bilinearly and written "
    "back into the model, the 85 templates, min-max normalised maps",
)
for _name in ("scclip", "scclip-l14", "gem", "clipsurgery"):
    register_entmax_variant(_name)



def resclip_text(threshold: float, rcs: tuple[float, float], sfr: tuple[float, float]) -> str:
    """ResCLIP's spec for one config: `temp_thd`, `attn_rcs_weights` (tau, lambda), `attn_sfr_weights` (tau,
    lambda). A = tau_r ((1 - lambda_r) softmax(S) + lambda_r A_rcs), S = tau_s ((1 - lambda_s) s k k^T +
    lambda_s F) + prior, i.e. groups weighted tau_r (1 - lambda_r) and tau_r lambda_r, terms tau_s (1 - lambda_s)
    and tau_s lambda_s (rounded to 10 decimals: the products' float noise, ~1e-16, is not kept)."""
    w = lambda x: fmt_num(round(x, 10))  # noqa: E731
    (tau_r, lam_r), (tau_s, lam_s) = rcs, sfr
    return (
        f"{w(tau_r * (1 - lam_r))}*({w(tau_s * (1 - lam_s))}*kk&{w(tau_s * lam_s)}*feedback:{fmt_num(threshold)})"
        f"+{w(tau_r * lam_r)}*attn@6-9/softmax/gauss:5/nores/noffn"
    )


register_preset(
    "resclip",
    resclip_text(0.25, (2.0, 0.3), (2.1, 0.7)),
    "ResCLIP (Yang et al., CVPR 2025) on NACLIP: residual cross-correlation (RCS, CLIP's mean attention of "
    "blocks 6..9 mixed after the softmax) and semantic feedback refinement (SFR, a first pass's patch labels "
    "mixed into the k-k scores); constants of its ADE20K config (the resclip protocol sets each dataset's)",
    "copied: RCS blocks 6..9 (indices 5..8) hard-coded for every backbone, ViT-L/14 included; tau_rcs scales "
    "the attention (not the logits); RCS and SFR always on (the published use_rcs=/use_sfr= trailing commas make "
    "tuples that are always true); the first pass without the SFR term and without tau_sfr; its labels are "
    "name (query) indices, synonyms not merged, from softmax(logit scale x cosine) after PAMR(10, (8, 16)) "
    "on the window guided by the window itself, pixels below temp_thd -> name 0, torch.mode per patch (CPU: "
    "the smallest label on ties; the published code runs on CUDA); the line check walks only the first "
    "steps / K of each segment (t = k / K with K the grid's largest distance) with float32 points rounded "
    "half to even, failed pairs decayed by exp(-cheb / K); the Gaussian blur (sigma of the prior, 5) runs "
    "along the flattened raster index, so it mixes the ends of neighbouring rows; map divided by its "
    "maximum and rounded to fp16 before the mix; "
    "fixed / not copied: fp32 everywhere else (the published model runs in fp16 on GPU); batches of windows "
    "(each window its own map, maximum and labels; the published code runs one window at a time); "
    "PAMR's silent skip on GPU out-of-memory. With remainder 'drop' (whole-image VOC) the first pass "
    "upsamples to the whole window and runs PAMR there, as published; the leftover pixels join no patch. "
    "entmax variant: entmax replaces both edited normalizers (first and final pass); A_rcs stays CLIP's own "
    "softmax maps, so each row keeps tau_r lambda_r A_rcs > 0 (dense) and the sparsity is in the k-k/feedback "
    "share tau_r (1 - lambda_r) of the attention",
)
register_entmax_variant("resclip")

from ..models import proxies as proxy_source  # noqa: E402,F401  (registers the ext: tap and the proxyclip presets)
from ..methods import corrclip  # noqa: E402,F401  (registers the corrclip presets)
from ..methods import trident  # noqa: E402,F401  (registers the sam global stage and the trident presets)
