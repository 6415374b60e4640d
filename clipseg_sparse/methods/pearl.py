"""PEARL (CVPR 2026): Procrustes-aligned attention and a text-aware Laplacian propagation (TLP).

Read from `PGSmall/PEARL@c26062b` (`pearl/attn.py` `pa_attn`, `_polar_unitary_newton_schulz`; `pearl/prop.py`
`TLP`; `pearl_ovss.py`; `clip/model.py` `custom_attn` with arch 'reduced'; `configs/cfg_*.py`;
research/peers-2026.md 2.4, corrected below where the code differs).

- Score taps `pa` and `pakk` (registered here): per head, token weights w = |q_t| (CLS weight 0) / (sum + 1e-6),
  weighted means q_mu, k_mu, centred q_c, k_c; M = k_c^T q_c; R = polar factor of M by 5 Newton-Schulz steps;
  `pa` compares q with k R, `pakk` k_c with itself (both by the dot metric, x d^-1/2). The preset's group
  `pa&pakk[scale:0.08]` sums them before one normalizer, so `pearl-entmax` puts entmax in that slot.
- Post stage `tlp[:GRID]` (default 80; Cityscapes 224): TLP on the raw cosine at the original size, guide = the
  CLIP-normalised network input resized to it (PEARL's `F.interpolate(inputs, ori_shape)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..attention.presets import register_entmax_variant, register_preset
from ..attention.taps import TAPS, Tap
from ..evaluation.protocols import PROTOCOLS, SCLIP_LINE, Protocol
from ..evaluation.published import register_published
from ..stages import STAGES, Stage

PA_ALPHA_KK, PA_POLAR_ITERS = 0.08, 5
TLP_GRID, TLP_TAU_S, TLP_DIAG_BOOST, TLP_KE_IMG, TLP_CG_ITERS, TLP_EPS = 80, 0.5, 10.0, 5.0, 25, 1e-6


# -- Procrustes-aligned attention --------------------------------------------------------------------------
def polar_newton_schulz(m: torch.Tensor, iters: int = PA_POLAR_ITERS, eps: float = 1e-6) -> torch.Tensor:
    """`_polar_unitary_newton_schulz`: the orthogonal polar factor M (M^T M)^-1/2 of ... x d x d matrices, the
    inverse square root by coupled Newton-Schulz steps on (M^T M) / |M^T M|_F + eps I."""
    d = m.shape[-1]
    eye = torch.eye(d, device=m.device, dtype=m.dtype).expand_as(m)
    a = m.transpose(-2, -1) @ m
    norm = a.flatten(-2).norm(dim=-1).clamp_min(eps)[..., None, None]
    y, z = a / norm + eps * eye, eye.clone()
    for _ in range(iters):
        t = 0.5 * (3.0 * eye - z @ y)
        y, z = y @ t, t @ z
    return m @ (z / norm.sqrt())


def procrustes_parts(q: torch.Tensor, k: torch.Tensor, skip_first: bool = True, iters: int = PA_POLAR_ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """(k R, k_c) of `pa_attn` for q, k: ... x N x d (fp32): weights |q_t| with the first token's set to 0
    when `skip_first` (CLS; `detach_cls`), normalised by their sum + 1e-6; R the polar factor of k_c^T q_c."""
    q, k = q.float(), k.float()
    w = q.norm(dim=-1, keepdim=True)
    if skip_first and q.shape[-2] > 0:
        w[..., 0:1, :] = 0.0
    w = w / (w.sum(dim=-2, keepdim=True) + 1e-6)
    q_c = q - (w * q).sum(dim=-2, keepdim=True)
    k_c = k - (w * k).sum(dim=-2, keepdim=True)
    r = polar_newton_schulz(k_c.transpose(-2, -1) @ q_c, iters)
    return k @ r, k_c


def _parts(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Computed once per edited block (the two taps read the same run); the CLS is the first attended token
    unless the spec attends patches only (cls:C)."""
    key = ("pa", id(ctx.q))
    if key not in ctx.extra:
        ctx.extra[key] = procrustes_parts(ctx.q, ctx.k, skip_first=ctx.offset == 0)
    return ctx.extra[key]


def _no_arg(kind: str):
    def check(arg: str) -> None:
        if arg:
            raise UserValueError(f"tap {kind!r} takes no argument")

    return check


TAPS.register("pa", Tap(features=lambda ctx, arg: (ctx.q.float(), _parts(ctx)[0]), check=_no_arg("pa")),
              help="pa (PEARL: q against k rotated into q's subspace by the Procrustes polar factor)")  # fmt: skip
TAPS.register("pakk", Tap(features=lambda ctx, arg: (_parts(ctx)[1],) * 2, check=_no_arg("pakk")),
              help="pakk (PEARL: the q-norm-weighted centred keys against themselves)")  # fmt: skip

# -- TLP -------------------------------------------------------------------------------------------------
def class_similarity(text: torch.Tensor) -> torch.Tensor:
    """`TLP.bind_text`: S = rows of softmax(cos(T, T) / 0.5) + 10 I, divided by their sum + eps (names x names)."""
    t = F.normalize(text.float(), dim=-1)
    s = torch.softmax(t @ t.T / max(TLP_TAU_S, TLP_EPS), dim=1)
    s = s + TLP_DIAG_BOOST * torch.eye(s.shape[0], device=s.device, dtype=s.dtype)
    return s / (s.sum(dim=1, keepdim=True) + TLP_EPS)


def _diagonal_agree(s: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_c a_c * S_cc * b_c: what the published `einsum('cc,bcij->bcij', S, p)` computes (a repeated index
    takes S's diagonal, not the product S p), then the sum over classes with the other map."""
    return (a * torch.diagonal(s).view(1, -1, 1, 1) * b).sum(dim=1, keepdim=True)


def tlp(cosine: torch.Tensor, guide: torch.Tensor, text: torch.Tensor, grid: int = TLP_GRID) -> torch.Tensor:
    """PEARL's TLP on N x H x W cosine with a 3 x H x W guide and N x D text; returns N x H x W.

    Copied: logits and guide average-pooled by (round(H / grid), round(W / grid)) cells (floor), softmax of the
    raw cosine (no logit scale), conf = max prob; agree = sum_c S_cc p_c^2 (the einsum's diagonal, clamped to
    [0, 1]); data weight (max(conf, 0.05))^2 (1 + agree); gray = 0.299 c0 + 0.587 c1 + 0.114 c2 of the normalised
    guide; 4-neighbour edges exp(-5 |d gray| / mean |d gray|) x (1 + clamp(sum_c S_cc p_c(i) p_c(j))) clamped to
    <= 1; (C + L_w) F = C logits solved by 25 conjugate-gradient steps from F = logits with one step length over
    all classes (sums over classes and pixels); upsampled bilinearly.
    """
    n, H, W = cosine.shape
    s = class_similarity(text.to(cosine.device))
    sh, sw = max(1, round(H / float(grid))), max(1, round(W / float(grid)))
    # the batch dimension added through H x W x N: a map in that memory (the windows forward's) stays a
    # channels-last batch that avg_pool2d reads in place (cosine[None] is taken for a strided NCHW and copied: 0.4 s)
    img, log = guide[None].float(), cosine.permute(1, 2, 0)[None].permute(0, 3, 1, 2).float()
    if sh > 1 or sw > 1:
        img = F.avg_pool2d(img, kernel_size=(sh, sw), stride=(sh, sw), ceil_mode=False, count_include_pad=False)
        log = F.avg_pool2d(log, kernel_size=(sh, sw), stride=(sh, sw), ceil_mode=False, count_include_pad=False)
    log = log.contiguous()  # the pooled map (small): the CG's sums in the same order whatever the input's memory
    probs = torch.softmax(log, dim=1)
    conf = probs.max(dim=1, keepdim=True)[0]
    agree = _diagonal_agree(s, probs, probs).clamp(0.0, 1.0)
    cw = conf.clamp_min(0.05) ** 2 * (1.0 + agree)
    gray = 0.299 * img[:, 0:1] + 0.587 * img[:, 1:2] + 0.114 * img[:, 2:3]
    gx = (gray[..., 1:] - gray[..., :-1]).abs()
    gy = (gray[..., 1:, :] - gray[..., :-1, :]).abs()
    gx, gy = gx / (gx.mean() + TLP_EPS), gy / (gy.mean() + TLP_EPS)
    g_h = _diagonal_agree(s, probs[..., 1:], probs[..., :-1]).clamp(0.0, 1.0)
    g_v = _diagonal_agree(s, probs[..., 1:, :], probs[..., :-1, :]).clamp(0.0, 1.0)
    w_h = (torch.exp(-TLP_KE_IMG * gx) * (1.0 + g_h)).clamp(0.0, 1.0)
    w_v = (torch.exp(-TLP_KE_IMG * gy) * (1.0 + g_v)).clamp(0.0, 1.0)

    def apply(x: torch.Tensor) -> torch.Tensor:  # C x + L_w x, L_w the weighted 4-neighbour graph Laplacian
        out = cw * x
        dh = w_h * (x[..., 1:] - x[..., :-1])
        out[..., 1:] += dh
        out[..., :-1] -= dh
        dv = w_v * (x[..., 1:, :] - x[..., :-1, :])
        out[..., 1:, :] += dv
        out[..., :-1, :] -= dv
        return out

    x = log.clone()
    r = cw * log - apply(x)
    p = r.clone()
    rs_old = (r * r).sum()
    for _ in range(TLP_CG_ITERS):
        ap = apply(p)
        alpha = rs_old / ((p * ap).sum() + 1e-12)
        x = x + alpha * p
        r = r - alpha * ap
        rs_new = (r * r).sum()
        p = r + rs_new / (rs_old + 1e-12) * p
        rs_old = rs_new
    if sh > 1 or sw > 1:
        x = F.interpolate(x, size=(H, W), mode="bilinear", align_corners=False)
    return x[0].to(cosine.dtype)


def _tlp_stage(args: str) -> Stage:
    usage = "expected tlp[:GRID] with GRID a positive integer (cells per side the map is pooled to), e.g. tlp:80"
    try:
        grid = int(args) if args else TLP_GRID
    except ValueError:
        raise UserValueError(f"bad stage 'tlp:{args}': {usage}") from None
    if grid < 1:
        raise UserValueError(f"bad stage 'tlp:{args}': {usage}")
    return Stage("post", f"tlp:{grid}", lambda cosine, guide, run: tlp(cosine, guide, run.text.to(cosine.device), grid))


STAGES.register(
    "tlp",
    _tlp_stage,
    help="post: PEARL's text-aware Laplacian propagation (map pooled to ~GRID cells a side, default 80; 4-neighbour gray "
    "edges x class agreement, 25 conjugate-gradient steps)",
)


# -- presets (protocol `pearl`: below) --------------------------------------------------
PEARL_SPEC = "pa&pakk[scale:{kk}]/softmax/nores/noffn"
PEARL_NOTES = (
    "copied: the last block per head: weights |q_t| with the CLS's 0, divided by their sum + 1e-6; weighted means "
    "of q and k; M = k_c^T q_c; R by 5 Newton-Schulz steps on (M^T M)/|M^T M|_F + 1e-6 I; logits (q d^-1/2)(k R)^T "
    "+ alpha_kk (k_c k_c^T) d^-1/2 (alpha_kk 0.08; ADE20K and Cityscapes 0.3), softmax over CLS and patches, A V, "
    "out_proj, no residual or FFN (arch 'reduced'), fp32; TLP (stage tlp) on the cosine at the original size; "
    "not copied: OpenAI's `clip` package in fp16 on GPU, positional embeddings by (n + 0.1) scale factor unless "
    "the protocol's pos_interp says so"
)
register_preset(
    "pearl",
    PEARL_SPEC.format(kk=0.08) + "/hook:tlp",
    "PEARL (CVPR 2026): Procrustes-aligned last-block attention (q against k rotated into q's subspace, plus 0.08 "
    "centred k-k), reduced block, then the text-aware Laplacian propagation TLP",
    PEARL_NOTES,
)
register_entmax_variant("pearl")

# SCLIP's line of configs (short side 336, Cityscapes 560; 224 / 112 windows; VOC21 and VOC20 on the whole image;
# prob_thd 0.1 on the background datasets), alpha_kk 0.3 on ADE20K and Cityscapes, TLP grid 224 on Cityscapes;
# pearl_ovss.py's postprocess_result divides the stored probabilities by their sum after the synonym max
# (renormalize, as NACLIP's segmentor; labels unchanged)
_PEARL = PEARL_SPEC + "/hook:tlp:{grid}"
PROTOCOL = PROTOCOLS.register(
    "pearl",
    Protocol(
        name="pearl",
        attention="pearl",
        class_names="sclip",
        source="PGSmall/PEARL@c26062b configs/cfg_*.py, pearl_ovss.py",
        defaults={**SCLIP_LINE, "renormalize": True},
        per_dataset={
            "cityscapes": dict(resolution=560),
            "voc21": dict(window=0, bg_threshold=0.1),
            "voc20": dict(window=0),
            "context60": dict(bg_threshold=0.1),
            "coco-object": dict(bg_threshold=0.1),
        },
        attention_per_dataset={"ade20k": _PEARL.format(kk=0.3, grid=80), "cityscapes": _PEARL.format(kk=0.3, grid=224)},
    ),
    help="PEARL (CVPR 2026)",
)

# The paper's Table 1 (OpenAI B/16) from the repository's results image. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 64.1, "context60": 35.1, "coco-object": 37.3, "voc20": 86.9, "context59": 38.6, "coco-stuff": 26.3,
     "cityscapes": 37.6, "ade20k": 19.4},
    "PGSmall/PEARL@c26062b assets/results.png",
    printed_average=43.2,
)  # fmt: skip
