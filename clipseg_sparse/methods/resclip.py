"""ResCLIP (Yang et al., CVPR 2025) on NACLIP: residual cross-correlation and semantic feedback refinement.

Read from yvhangyang/ResCLIP@6b082d9 (`clip/model.py`, `resclip_segmentor.py`, `configs/cfg_*.py`). In the
engine's axes: RCS is the map tap `attn@6-9` (CLIP's mean attention of blocks 6..9, mixed after the
softmax); SFR is the score tap `feedback:THD` (a first pass's patch labels mixed into the k-k scores), which
stays in `attention/feedback.py` because it is an axis of the engine; `resclip_text` writes one config's
constants as a spec, and the protocol gives each dataset its config's (`RESCLIP_CONSTANTS`). Quirks copied,
fixed and not copied: `RESCLIP_NOTES` (docs/datasets.md, Presets). Grid: `sweeps/grids/resclip.toml`.
"""

from __future__ import annotations

from ..attention.presets import register_entmax_variant, register_preset
from ..attention.terms import fmt_num
from ..evaluation.protocols import PROTOCOLS, SCLIP_LINE, Protocol
from ..evaluation.published import register_published
from .naclip import V2_DATASETS


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


RESCLIP_NOTES = (
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
    "share tau_r (1 - lambda_r) of the attention"
)
register_preset(
    "resclip",
    resclip_text(0.25, (2.0, 0.3), (2.1, 0.7)),
    "ResCLIP (Yang et al., CVPR 2025) on NACLIP: residual cross-correlation (RCS, CLIP's mean attention of "
    "blocks 6..9 mixed after the softmax) and semantic feedback refinement (SFR, a first pass's patch labels "
    "mixed into the k-k scores); constants of its ADE20K config (the resclip protocol sets each dataset's)",
    RESCLIP_NOTES,
)
register_entmax_variant("resclip")

# ResCLIP's configs (yvhangyang/ResCLIP@6b082d9 configs/cfg_*.py, ResCLIPSegmentation's defaults): NACLIP's
# line (336, 224/112 windows, logit scale 40; Cityscapes 560; VOC21 and VOC20 whole image), final PAMR off
# (pamr_steps=0; its first pass runs its own PAMR), probabilities renormalised after the synonym max, and
# per dataset temp_thd, attn_rcs_weights (tau, lambda), attn_sfr_weights (tau, lambda); every config sets
# delete_same_entity=True. The same configs serve ViT-L/14 (base_config.py's clip_path comment).
RESCLIP_CONSTANTS = {
    "voc21": (0.50, (2.0, 0.3), (2.2, 0.7)),
    "voc20": (0.10, (2.0, 0.6), (2.1, 0.6)),
    "context60": (0.30, (2.0, 0.3), (1.8, 0.7)),
    "context59": (0.25, (2.0, 0.4), (1.8, 0.7)),
    "coco-object": (0.11, (2.0, 0.4), (1.8, 0.7)),
    "coco-stuff": (0.11, (2.0, 0.4), (1.8, 0.7)),
    "cityscapes": (0.10, (2.0, 0.2), (2.1, 0.6)),
    "ade20k": (0.25, (2.0, 0.3), (2.1, 0.7)),
}
PROTOCOL = PROTOCOLS.register(
    "resclip",
    Protocol(
        name="resclip",
        attention="resclip",
        class_names="sclip",
        source="yvhangyang/ResCLIP@6b082d9 configs/cfg_*.py, resclip_segmentor.py, clip/model.py",
        defaults={**SCLIP_LINE, "renormalize": True},
        per_dataset=V2_DATASETS,
        attention_per_dataset={d: resclip_text(*c) for d, c in RESCLIP_CONSTANTS.items()},
    ),
    help="ResCLIP (CVPR 2025) on NACLIP: per-dataset lambda, tau and temp_thd in the spec, final PAMR off",
)

# The paper's tables (ResCLIP on NACLIP, OpenAI B/16), from the repository's figures. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 61.1, "context60": 33.5, "coco-object": 35.0, "voc20": 86.0, "context59": 36.8, "coco-stuff": 24.7,
     "cityscapes": 35.9, "ade20k": 18.0},
    "yvhangyang/ResCLIP figs/main_results_w.png + figs/main_results_wo.png",
    printed_average=41.4,
)  # fmt: skip
