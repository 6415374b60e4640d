"""CASS (Kim et al., CVPR 2025): DINO's key graph, spectrally distilled into CLIP's last-block attention, and the
text presence adjustment.

Read from MICV-yonsei/CASS@228ecdd (`clip/model.py`: `VisionTransformer.forward`, `custom_attn`, `_get_dino_key`,
`_process_dino_key`, `_normalize_key_range`, `_apply_spectral_strategy`, `optimal_q`, `compute_spectrum`,
`wasserstein_distance_pytorch`, `_scale_singular_values`, `_normalize_attention_range`, `gaussian_window`,
`get_attention_addition`; `cass_segmentor.py`: `__init__`, `hierarchical_clustering`, `hierarchical_prompt`,
`forward_feature`, `forward_slide`, `predict`; `dino/dino_attention.py`; `configs/cfg_*.py`, `base_config.py`,
`eval.py`, `eval_all.sh`). In the engine's axes (names: K_c = d^-1/2 k k^T per head of CLIP's last block over the
patches, k_d DINO ViT-B/8's last-block keys):

- the score tap `spectral:RANK,EIGEN,WEIGHT[,raw]` (10, 20, 10): DINO sees the crop as the published code hands it
  over (`dino_pixels`: CLIP's normalisation undone with ImageNet's statistics, blue std typed 0.255, x 255 cast to
  uint8 (truncation, wrapping mod 256), a non-square crop resized to its short side squared by PIL's bicubic,
  ImageNet-normalised); k_d (patches, heads concatenated) regrouped into CLIP's heads, resized bilinearly to CLIP's
  grid, min-max rescaled to the range of the window's k (all heads); K_d = d^-1/2 k_d k_d^T. Each head's spectrum
  (the EIGEN largest eigenvalues, L2- then L1-normalised); W1(i, j) = sum |sorted p_d,i - sorted p_c,j|; the
  assignment minimising sum (1 - W1) (it pairs the most different spectra) gives CLIP head i DINO head
  col(i) = the assignment's column of row i, with w_i = W1(i, col(i)) (the code's indices swapped: row i is
  DINO's in W1 and CLIP's in the pairing). K_d,col(i) approximated by its randomized rank-RANK SVD (`low_rank`:
  `torch.svd_lowrank`'s algorithm, 2 power iterations, its Gaussian start drawn from a generator seeded 42 for
  every window), singular values rescaled to [0.5 min, 1.5 max] (not with `raw`: VOC20, Cityscapes), diagonal 0,
  min-max rescaled to K_c,i's range D_i; logits (WEIGHT w_i D_i + K_c,i) / (WEIGHT w_i + 1);
- then the spec: NACLIP's Gaussian prior (`gauss:5`), the normalizer (softmax; the `cass-entmax` slot, CASS's only
  one), the patches alone, out_proj(A V), no residual, no FFN (`cls:0/noffn`), ln_post, proj;
- the option `textadjust:LINKAGE,W,ALPHA,T[,window]`: the text presence adjustment (`segment/presence.py`, Ward
  linkage) in the plain windows (the forward `textadjust` below), with g the cosine of an unmodified CLIP's
  image embedding of the whole network input (or, with `window`, Cityscapes, the window's own; a whole-image run
  is its own window). RF-CLIP's `presence` option is the same adjustment in its own forward; an option names
  one forward, so CASS's has its own name.

The randomized SVD: the published code draws its start from the global CUDA generator, seeded 42 once per
evaluation run, so each image's draws depend on the device and on every image evaluated before it; they cannot
be reproduced. Seeding every window with 42 makes a result a function of the image alone, and a window's draws
are the ones the published code makes for the first window of a run on the CPU. Rank 10 and 2 power iterations
do not recover the exact top-10 subspace, so the draw matters: on random weights (ViT-B/16, DINO ViT-B/8, one 224
window, `benchmarks/cass_cost.py`) five other seeds move the L2-normalised features by 2e-4 to 5e-4 (the best of
150 names changes on 0 to 0.5 % of the patches), the exact rank-10 truncation by 2.6e-4; the published `.half()` cast
of DINO's qkv, not copied, by 8e-5.

Quirks copied, fixed and not copied: `CASS_NOTES` (datasets.md, Presets). Grid: `sweeps/grids/cass.toml`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.presets import register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..attention.taps import TAPS, BlockContext, Tap
from ..attention.terms import fmt_num
from ..attention.transforms import pair_scores
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, SCLIP_LINE, Protocol
from ..evaluation.published import register_published
from ..models.backbones import IMAGENET_MEAN, Backbone
from ..segment.maps import CosineMap
from ..segment.plan import FORWARDS, ImageRun
from ..segment.preprocess import window_boxes, window_padding
from ..segment.presence import linkage_clusters
from ..segment.windows import WindowsForward, iter_window_features, window_cosine_map
from ..stages import Needs
from .rfclip import presence_arg

BACKBONE = "dino_vitb8"  # base_config.py dino_type='dino_vitb8'
RANK, EIGEN, WEIGHT = 10, 20, 10.0  # optimal_q(initial_q=10) returns at once; custom_attn k_eigen=20, scale_factor=10
POWER_ITERATIONS = 2  # torch.svd_lowrank's default niter
SEED = 42  # base_config.py randomness seed
INVERSE_STD = (0.229, 0.224, 0.255)  # cass_segmentor.py inv_normalize: ImageNet's std, blue typed 0.255 (0.225)
FORWARD = "textadjust"


# -- the spectral tap -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spectral:
    """`spectral:RANK,EIGEN,WEIGHT[,raw]` parsed: the low-rank approximation's rank, the eigenvalues a head's
    spectrum keeps, the weight of the DINO graph, whether its singular values are rescaled (not with `raw`)."""

    rank: int
    eigen: int
    weight: float
    rescale: bool = True

    @classmethod
    def parse(cls, arg: str) -> "Spectral":
        parts = arg.split(",")
        try:
            if len(parts) in (3, 4) and (len(parts) == 3 or parts[3] == "raw"):
                rank, eigen, weight = int(parts[0]), int(parts[1]), float(parts[2])
                if rank >= 1 and eigen >= 1 and weight >= 0 and math.isfinite(weight):
                    return cls(rank, eigen, weight, len(parts) == 3)
        except ValueError:
            pass
        raise UserValueError(f"bad tap spectral:{arg}: write spectral:RANK,EIGEN,WEIGHT[,raw] (integers RANK, EIGEN >= 1, "
                             "WEIGHT >= 0; raw: singular values not rescaled)")

    def __str__(self) -> str:
        return f"{self.rank},{self.eigen},{fmt_num(self.weight)}" + ("" if self.rescale else ",raw")


def dino_pixels(crops: torch.Tensor, backbone: Backbone) -> torch.Tensor:
    """B x 3 x S x S DINO input of B CLIP-normalised crops (H x W, S = min(H, W)) as `forward_feature` and
    `DinoSelfAttention` make it: x * INVERSE_STD + ImageNet mean, x 255, cast to uint8 as numpy does (truncated,
    wrapped mod 256), resized by PIL (bicubic) to S x S when not square, / 255, normalised with the backbone's
    mean and std. Pixels of an image stay inside 19..244, so the wrap only touches values outside CLIP's gamut."""
    from PIL import Image

    view = lambda t: torch.tensor(t, dtype=torch.float32).view(1, 3, 1, 1)  # noqa: E731
    x = crops.detach().float().cpu() * view(INVERSE_STD) + view(IMAGENET_MEAN)
    byte = torch.remainder(torch.trunc(x * 255).to(torch.int64), 256).to(torch.uint8)
    H, W = byte.shape[-2:]
    if H != W:
        side = min(H, W)
        resized = [np.asarray(Image.fromarray(b.permute(1, 2, 0).numpy()).resize((side, side))) for b in byte]
        byte = torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2)
    return (byte.float() / 255 - view(backbone.info.mean)) / view(backbone.info.std)


def head_spectra(scores: torch.Tensor, eigen: int) -> torch.Tensor:
    """H x E: each head's largest `eigen` eigenvalues (float64, descending) of H x N x N symmetric scores, L2- then
    L1-normalised (`compute_spectrum`, then the two `F.normalize` calls of `_apply_spectral_strategy`)."""
    vals = torch.linalg.eigvalsh(scores.double()).flip(-1)[:, :eigen]
    return F.normalize(F.normalize(vals, p=2, dim=1), p=1, dim=1)


def assignment(cost: torch.Tensor) -> list[int]:
    """The column of each row of a square cost matrix in the assignment of least total cost: the published
    code's `scipy.optimize.linear_sum_assignment` (rows come back in order)."""
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(cost.double().cpu().numpy())[1].tolist()


def low_rank(a: torch.Tensor, start: torch.Tensor, iterations: int = POWER_ITERATIONS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U, S, Vh) of the randomized SVD of the N x N matrix `a` from the N x r Gaussian `start`: torch.svd_lowrank's
    algorithm (Halko et al. 2009, algorithms 4.4 and 5.1), which draws `start` itself from the global generator."""
    q = torch.linalg.qr(a @ start).Q
    for _ in range(iterations):
        q = torch.linalg.qr(a.mH @ q).Q
        q = torch.linalg.qr(a @ q).Q
    u, s, vh = torch.linalg.svd(q.mH @ a, full_matrices=False)
    return q @ u, s, vh


def _rescaled(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x min-max mapped onto the range of `like` (`_normalize_key_range`, `_normalize_attention_range`)."""
    lo, hi = like.min(), like.max()
    return (x - x.min()) / (x.max() - x.min()) * (hi - lo) + lo


def dino_keys(ctx: BlockContext, backbone: Backbone) -> torch.Tensor:
    """B x H x N x d: DINO's last-block patch keys of each crop, regrouped into CLIP's H heads of width d, resized
    bilinearly to CLIP's grid and min-max rescaled to the range of that window's CLIP keys (`_get_dino_key`,
    `_process_dino_key`, `_normalize_key_range`)."""
    B, H, N, d = ctx.k.shape
    out = backbone.features(dino_pixels(ctx.pixels, backbone), want=("qkv",))
    k = out.k.float().to(ctx.k.device)  # B x H' x M x d'
    if k.shape[1] * k.shape[3] != H * d:
        raise UserValueError(f"tap spectral: {backbone.info.name}'s keys are {k.shape[1] * k.shape[3]} wide, CLIP's {H * d}: CASS "
                             "regroups DINO's keys into CLIP's heads, which needs equal widths (ViT-B/16 with DINO ViT-B/8)")
    k = k.transpose(2, 3).reshape(B, H, d, *out.grid).flatten(1, 2)
    k = F.interpolate(k, size=tuple(ctx.grid), mode="bilinear", align_corners=False).view(B, H, d, N).transpose(2, 3)
    return torch.stack([_rescaled(kd, kc) for kd, kc in zip(k, ctx.k.float())])


def spectral_scores(ctx: BlockContext, arg: str) -> torch.Tensor:
    """B x H x N x N: CASS's mix of CLIP's and DINO's key graphs per head (module docstring), before the prior."""
    sp = Spectral.parse(arg)
    if "backbones" not in ctx.extra or ctx.pixels is None:
        raise ValueError("tap spectral runs DINO on the crops: give the block context the run's backbones and pixels (DenseCLIP passes them)")
    if ctx.k.shape[-2] != ctx.grid[0] * ctx.grid[1]:
        raise UserValueError(f"tap spectral:{arg} scores the patches alone, as CASS's last block: add cls:C to the spec (cls:0: no residual)")
    k = ctx.k.float()
    kc = pair_scores(k, k, k.shape[-1] ** -0.5)
    kd_keys = dino_keys(ctx, ctx.extra["backbones"].get(BACKBONE, k.device))
    kd = pair_scores(kd_keys, kd_keys, k.shape[-1] ** -0.5)
    B, H, N, _ = kc.shape
    rank = min(sp.rank, N)
    out = torch.empty_like(kc)
    for b in range(B):
        pd, pc = head_spectra(kd[b], sp.eigen), head_spectra(kc[b], sp.eigen)
        distance = (pd.sort(dim=1).values[:, None] - pc.sort(dim=1).values[None]).abs().sum(-1)  # W1, DINO x CLIP
        cost = (1 - distance).float()  # the published cost matrix is float32
        cols = assignment(cost)
        generator = torch.Generator().manual_seed(SEED)
        for i, j in enumerate(cols):
            scale = (1 - cost[i, j]) * sp.weight  # float32, as w_d * scale_factor
            start = torch.randn(N, rank, dtype=torch.float64, generator=generator).to(k.device)
            u, s, vh = low_rank(kd[b, j].double(), start)
            if sp.rescale:  # _scale_singular_values
                s = (s - s.min()) / (s.max() - s.min()) * (1.5 * s.max() - 0.5 * s.min()) + 0.5 * s.min()
            approx = (u * s) @ vh
            approx.fill_diagonal_(0)
            mixed = (scale.double() * _rescaled(approx, kc[b, i].double()) + kc[b, i].double()) / (scale.double() + 1)
            out[b, i] = mixed.float()
    return out


TAPS.register(
    "spectral",
    Tap(scores=spectral_scores, check=lambda arg: Spectral.parse(arg) and None, needs=lambda arg: Needs(backbones=(BACKBONE,)), projections=True),
    help="spectral:RANK,EIGEN,WEIGHT[,raw] (CASS: per head, k-k scores mixed with the randomized low-rank graph of the DINO ViT-B/8 "
    "key head paired by spectra; scores mixed before the normalizer)",
)


# -- the text presence adjustment in the plain windows -------------------------------------------------------------------
def _adjust_text(arg: str) -> str:
    p, source = presence_arg(arg)
    return ",".join([p.linkage, *(fmt_num(x) for x in (p.weight, p.alpha, p.threshold))] + (["window"] if source == "window" else []))


register_option("textadjust", _adjust_text, needs=lambda arg: Needs(forward=((FORWARD, f"textadjust:{arg}"),)),
                help="textadjust:LINKAGE,W,ALPHA,T[,window] (CASS's text presence adjustment, segment/presence.py, in the plain windows "
                "with an unmodified CLIP's image embedding; the textadjust forward)")


def adjusted_cosine(run: ImageRun, out_size: tuple[int, int] | None = None) -> CosineMap:
    """The windows' cosine maps with the names adjusted per window (module docstring), N_names x H x W at `out_size`."""
    clip, s = run.clip, run.settings
    presence, source = presence_arg(run.spec.extra("textadjust"))
    text = run.text.to(clip.device)
    clusters = linkage_clusters(text, presence.linkage, presence.threshold)
    H, W = run.pixels.shape[-2:]
    boxes = window_boxes(H, W, s.window, s.stride)
    pad = window_padding(boxes[0], clip.patch_size, s.remainder, not s.window)

    def embedding(pixels: torch.Tensor) -> torch.Tensor:  # the L2-normalised CLS of an unmodified CLIP (x_last)
        return clip.encode_dense(pixels, None, with_cls=True, pos_interp=s.pos_interp)[1]

    whole = None
    if source == "image":  # once per image (a whole-image run's is its own window's)
        whole = embedding(F.pad(run.pixels, window_padding((0, H, 0, W), clip.patch_size, s.remainder, True))) @ text.T
    done, cos = [], []
    for chunk, feats in iter_window_features(run):
        done += chunk
        if whole is not None:
            g = whole.expand(len(chunk), -1)
        else:
            g = embedding(F.pad(torch.cat([run.pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk]), pad)) @ text.T
        cos.append(presence.logits(feats.flatten(1, 2), g, text, clusters).reshape(*feats.shape[:3], -1))
    return window_cosine_map(run, done, torch.cat(cos), out_size)


class TextAdjustForward(WindowsForward):
    """The plain windows (token and windows stages inside), each window's names adjusted by the text presence
    adjustment before its map joins the others; `attention` as the plain windows'."""

    name = FORWARD
    kinds = frozenset({"token", "windows", "retrieval"})

    def cosine(self, run: ImageRun) -> CosineMap:
        return adjusted_cosine(run, run.out_size)


FORWARDS.register(FORWARD, TextAdjustForward(), help="the plain windows with CASS's text presence adjustment per window (textadjust:...)")


# -- presets and protocol -------------------------------------------------------------------------------------------------
def _spec(w: float, a: float, t: float, dataset: str = "") -> str:
    raw = ",raw" if dataset in ("voc20", "cityscapes") else ""  # _scale_singular_values: dataset in ['voc20', 'city_scapes']
    window = ",window" if dataset == "cityscapes" else ""  # forward_slide: whole_img None on city_scapes
    return f"spectral:{RANK},{EIGEN},{WEIGHT:g}{raw}/softmax/gauss:5/cls:0/noffn/textadjust:ward,{w:g},{a:g},{t:g}{window}"


# configs/cfg_*.py ("CLIPb16 DINOb8"): (global_semantics_weight, mean_vector_weight, h_threshold)
CONSTANTS = {
    "voc21": (0.1, 0.03, 0.10), "voc20": (0.4, 0.02, 0.10), "context60": (0.25, 0.04, 0.09), "context59": (0.25, 0.04, 0.09),
    "coco-object": (0.25, 0.01, 0.10), "coco-stuff": (0.2, 0.02, 0.02), "cityscapes": (0.1, 0.03, 0.14), "ade20k": (0.3, 0.05, 0.06),
}  # fmt: skip
CASS = _spec(*CONSTANTS["ade20k"])
CASS_NOTES = (
    "copied: the last block on the patches alone (q, k, v [1:]), out_proj(A V), no residual or FFN, ln_post, proj; "
    "DINO ViT-B/8's last-block keys of the crop as the code hands it over (CLIP-normalised tensor x ImageNet std with "
    "the blue 0.225 typed 0.255, + ImageNet mean, x 255, numpy's uint8 cast: truncated, wrapping mod 256 outside the "
    "gamut; a non-square crop PIL-resized (bicubic) to its short side squared), regrouped into CLIP's 12 x 64 heads, "
    "resized bilinearly to CLIP's grid, min-max rescaled to the window's k range over all heads; per head the top-20 "
    "eigenvalues of s k k^T (float64), L2- then L1-normalised; cost 1 - W1 (sorted-spectrum L1 distance) with "
    "linear_sum_assignment minimising it (the most different spectra paired), the indices swapped (W1 taken at "
    "(DINO i, CLIP j), used for CLIP head i with DINO head j); DINO's graph by torch.svd_lowrank at q = 10, 2 power "
    "iterations (optimal_q's 95 % energy test always passes at 10: rank 10), singular values rescaled to [0.5 min, "
    "1.5 max] except on VOC20 and Cityscapes, diagonal 0, min-max rescaled to the paired CLIP head's range; logits "
    "(10 w D + K_c) / (10 w + 1) + NACLIP's Gaussian (sigma 5), softmax; names clustered by Ward linkage on cosine "
    "distances cut at h_threshold; per window in each cluster the name with the largest global similarity g moved "
    "towards the mean of its 2 most similar patches (mean_vector_weight), logits (1 - w) cos + w g; g from an "
    "unmodified CLIP's CLS of the whole network input (Cityscapes: of the window; VOC21, whole image: its own); "
    "fixed: the randomized SVD's start drawn from a generator seeded 42 for every window (the code draws from the "
    "global CUDA generator seeded once per run: each image's draws depend on every image before it; other draws move "
    "the features by up to 5e-4 on random weights); the whole "
    "input's embedding computed once per image (the code re-runs CLIP and DINO for every window); grids under 10 "
    "patches use rank N (the code fails); differs: DINO sees the pixels CLIP encodes (a whole image cut to whole "
    "16-px patches: VOC21), the code the uncut image (up to 15 px more per side before its square resize); "
    "not copied: fp16 on GPU and the .half() cast of DINO's qkv (the DINO graph in fp16: 8e-5 on random weights); "
    "the 'sequential' and 'vanilla' strategies and the dinov2_vitb14 and ViT-L/14 scale_up branches (off in the configs)"
)
register_preset(
    "cass",
    CASS,
    "CASS (Kim et al., CVPR 2025), ViT-B/16 with DINO ViT-B/8: per head, CLIP's k-k logits mixed with the randomized "
    "rank-10 approximation of the spectrally paired DINO key graph, NACLIP's Gaussian, the patches alone without "
    "residual or FFN; the text presence adjustment (Ward linkage; ADE20K's constants: the cass protocol sets each "
    "dataset's)",
    CASS_NOTES,
)
register_entmax_variant("cass")

# configs/cfg_*.py over CASS_segmentor's defaults: SCLIP's line at 336 (COCO-Stuff too; Cityscapes 560), 224/112 windows
# except VOC21 (whole image, slide_crop=0), logit scale 40, prob_thd 0.1 on VOC21, Context60 and COCO-Object, PAMR off
# (eval_all.sh --pamr off); its class files are SCLIP's, byte for byte.
PROTOCOL = PROTOCOLS.register(
    "cass",
    Protocol(
        name="cass",
        attention="cass",
        class_names="sclip",
        source="MICV-yonsei/CASS@228ecdd configs/cfg_*.py, configs/cls_*.txt, cass_segmentor.py, eval.py, eval_all.sh",
        defaults=SCLIP_LINE,
        per_dataset={
            "voc21": dict(window=0, bg_threshold=0.1),
            "context60": dict(bg_threshold=0.1),
            "coco-object": dict(bg_threshold=0.1),
            "cityscapes": dict(resolution=560),
        },
        attention_per_dataset={ds: _spec(*c, ds) for ds, c in CONSTANTS.items()},
    ),
    help="CASS (CVPR 2025): SCLIP's line (336, Cityscapes 560), VOC21 whole image, its per-dataset text-adjustment "
    "constants, singular values unscaled on VOC20 and Cityscapes, PAMR off",
)

# Reported mIoU, OpenAI CLIP ViT-B/16 with DINO ViT-B/8 (the paper's Table 1 as RF-CLIP's and OV-Stitcher's tables
# reprint it, research/peers.md 1; the repository's README shows it as an external image). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 65.8, "context60": 36.7, "coco-object": 37.8, "voc20": 87.8, "context59": 40.2,
     "coco-stuff": 26.7, "cityscapes": 39.4, "ade20k": 20.4},
    "CASS (arXiv 2411.17150) Table 1, second-hand (research/peers.md 1: RF-CLIP's and OV-Stitcher's tables); "
    "MICV-yonsei/CASS@228ecdd README.md links it as an image (miou.png) outside the repository",
    note="the published run's randomized SVD draws cannot be reproduced (see the cass preset's notes)",
    printed_average=44.4,
)  # fmt: skip
