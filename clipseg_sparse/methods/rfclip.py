"""RF-CLIP (AAAI 2026) as released: sink-channel denoising after every block, the mean of every block's k-k maps in
a last block run on two inputs, and CASS's text presence adjustment.

Read from liblacklucy/RF-CLIP@c2b333e (`clip/model.py`: `VisionTransformer.forward`, `attn_refocusing`,
`last_attn`, `feat_denoising`, `feat_enhancing`; `custom_segmentor.py`: `RF_CLIP`, `hierarchical_clustering`,
`hierarchical_prompt`, `forward_feature`, `forward_slide`; `configs/cfg_*.py`, `eval.py`, `eval_all.sh`). The released
code calls `attn_refocusing` with its default strategy 'vanilla', so the attention redistribution the paper
describes is never applied (its threshold 0.1 and beta 0.6 are dead code): implemented is what the code does. It
runs in its own forward, `refocus` below, one batch of windows at a time (B/16 names: x_l the tokens after block l):

- `denoise:SIGMA,ALPHA` (5, 0.4): after every block, patch tokens whose largest share p_c = (f_c - min f) /
  sum(f - min f) over the sink channels (the code's list for ViT-B/16, or ViT-L/14's commented one, chosen by the
  width; or listed `C;C;...`) exceeds SIGMA / width become (1 - ALPHA) f + ALPHA x their 3 x 3 mean (zero padded);
- `refocus:BETA` (0.4): blocks 1..L run as they are (each denoised), G = the mean of those L outputs, S = cos(G)
  over the patches with entries below BETA set to 0 (rows not normalised: ln_1 removes the scale); the last
  block's attention runs on two inputs, x_{L-1} and G, each with its patches replaced by S x its patches: out_proj(A
  V) on the patches, no residual, no FFN, A = the mean over all L blocks of normalize(s k k^T) over CLS + patches
  (the patch part, rows not renormalised; block L's from the input itself); the two outputs averaged, ln_post,
  proj. The spec is `kk/NORMALIZER/cls:0/noffn` with these options: its normalizer is the L k-k maps' (the
  `rfclip-entmax` slot);
- `presence:LINKAGE,W,ALPHA,T[,window]`: CASS's text presence adjustment (`segment/presence.py`) with RF-CLIP's
  complete linkage and per-dataset constants; the global embedding is the CLS of x_L (denoised) of the whole network
  input (the code re-runs it for every window), or with `window` the window's own (Cityscapes; and a whole-image
  run, VOC21 and COCO-Stuff, is its own window).

Quirks copied, fixed and not copied: `RFCLIP_NOTES` (datasets.md, Presets). Grid: `sweeps/grids/rfclip.toml`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec
from ..attention.contract import positive_attention
from ..attention.normalizers import normalize
from ..attention.presets import register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..attention.taps import block_qkv, run_block
from ..attention.terms import fmt_num
from ..attention.transforms import pair_scores
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..segment.maps import CosineMap
from ..segment.plan import FORWARDS, AttentionWindow, Forward, ImageRun, Plan
from ..segment.preprocess import window_boxes, window_padding
from ..segment.presence import LINKAGES, Presence, linkage_clusters
from ..segment.windows import window_cosine_map
from ..stages import Needs, Stage

FORWARD = "refocus"
# model.py feat_denoising: sink_channel for ViT-B/16, and the ViT-L/14 list the code leaves in a comment
SINK_CHANNELS = {768: (4, 162, 189, 326, 429, 474, 633, 713), 1024: (250, 261, 437, 650, 720, 779, 936, 1005)}
SIGMA, ALPHA, BETA = 5.0, 0.4, 0.4  # feat_denoising(sigma=5.0, alpha=0.4), feat_enhancing(beta=0.4)
TOP = 2  # custom_segmentor.py _compute_topk_similarities(k=2)


# -- the options ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Denoise:
    """`denoise:SIGMA,ALPHA[,C;C;...]` parsed."""

    sigma: float
    alpha: float
    channels: tuple[int, ...] | None  # None: the published list for the model's width

    @classmethod
    def parse(cls, arg: str) -> "Denoise":
        parts = arg.split(",")
        try:
            sigma, alpha = float(parts[0]), float(parts[1])
            channels = tuple(int(c) for c in parts[2].split(";")) if len(parts) == 3 else None
            if len(parts) in (2, 3) and sigma > 0 and 0 <= alpha <= 1 and math.isfinite(sigma) and (channels is None or (channels and min(channels) >= 0)):
                return cls(sigma, alpha, channels)
        except (ValueError, IndexError):
            pass
        raise UserValueError(f"bad option denoise:{arg}: write denoise:SIGMA,ALPHA[,C;C;...] (SIGMA > 0, 0 <= ALPHA <= 1; "
                             "the sink channels, default RF-CLIP's list for ViT-B/16 or ViT-L/14)")

    def __str__(self) -> str:
        channels = "" if self.channels is None else "," + ";".join(map(str, self.channels))
        return f"{fmt_num(self.sigma)},{fmt_num(self.alpha)}{channels}"

    def sinks(self, width: int) -> tuple[int, ...]:
        if self.channels is not None:
            if max(self.channels) >= width:
                raise UserValueError(f"denoise:{self}: sink channel {max(self.channels)} past this model's width {width}")
            return self.channels
        if width not in SINK_CHANNELS:
            raise UserValueError(f"denoise:{self}: RF-CLIP lists sink channels for widths 768 (ViT-B/16) and 1024 (ViT-L/14), "
                                 f"not {width}; list them: denoise:SIGMA,ALPHA,C;C;...")
        return SINK_CHANNELS[width]


def _beta(arg: str) -> float:
    try:
        value = float(arg)
    except ValueError:
        value = math.nan
    if not -1 <= value <= 1:
        raise UserValueError(f"bad option refocus:{arg}: write refocus:BETA, -1 <= BETA <= 1 (the cosine below which the guide's similarity is 0)")
    return value


def presence_arg(arg: str) -> tuple[Presence, str]:
    """`LINKAGE,W,ALPHA,T[,window]` -> (the adjustment, the global embedding's source: image or window)."""
    parts = arg.split(",")
    try:
        if len(parts) in (4, 5) and parts[0] in LINKAGES and (len(parts) == 4 or parts[4] in ("image", "window")):
            w, a, t = (float(p) for p in parts[1:4])
            if 0 <= w <= 1 and 0 <= a <= 1 and t >= 0:
                return Presence(parts[0], w, a, t, TOP), parts[4] if len(parts) == 5 else "image"
    except ValueError:
        pass
    raise UserValueError(f"bad option presence:{arg}: write presence:LINKAGE,W,ALPHA,T[,window] (LINKAGE {' or '.join(LINKAGES)}; "
                         "0 <= W, ALPHA <= 1; cut distance T >= 0; window: the window's CLS as the global embedding)")


def _presence_text(arg: str) -> str:
    p, source = presence_arg(arg)
    return ",".join([p.linkage, *(fmt_num(x) for x in (p.weight, p.alpha, p.threshold))] + (["window"] if source == "window" else []))


def _needs(option: str):
    return lambda arg: Needs(forward=((FORWARD, f"{option}:{arg}"),))


register_option("denoise", lambda arg: str(Denoise.parse(arg)), needs=_needs("denoise"),
                help="denoise:SIGMA,ALPHA[,C;C;...] (RF-CLIP: after every block, patches whose sink-channel share exceeds SIGMA / width mixed "
                "(1 - ALPHA) x + ALPHA x their 3 x 3 mean; the refocus forward)")
register_option("refocus", lambda arg: fmt_num(_beta(arg)), needs=_needs("refocus"),
                help="refocus:BETA (RF-CLIP: the last block on x_{L-1} and the mean of all blocks, each aggregated by the thresholded cosine of "
                "that mean, attending with the mean of every block's k-k maps; the refocus forward)")
register_option("presence", _presence_text, needs=_needs("presence"),
                help="presence:LINKAGE,W,ALPHA,T[,window] (CASS's text presence adjustment, segment/presence.py; the refocus forward)")

REFOCUS_OPTIONS = ("denoise", "refocus", "presence")


def check_refocus(spec: AttentionSpec | str) -> None:
    """UserValueError unless the refocus forward runs the spec: `kk/NORMALIZER/cls:0/noffn` with `refocus:BETA` and
    optionally `denoise` and `presence`, nothing else."""
    spec = resolve_spec(spec)
    bare = spec.replace(normalizer="softmax", extras=())
    if spec.extra("refocus") is None or bare != AttentionSpec.parse("kk/softmax/cls:0/noffn") or any(n not in REFOCUS_OPTIONS for n, _ in spec.extras):
        raise UserValueError(f"spec {spec}: the refocus forward (RF-CLIP) runs kk/NORMALIZER/cls:0/noffn/refocus:BETA with denoise "
                             "and presence options, nothing else")


# -- the forward ----------------------------------------------------------------------------------------------------------
def denoise_tokens(x: torch.Tensor, grid: tuple[int, int], sinks: tuple[int, ...], sigma: float, alpha: float) -> torch.Tensor:
    """`feat_denoising` on B x (P + h*w) x C tokens (P prefix tokens left as they are), see the module docstring."""
    B, n, C = x.shape
    prefix = n - grid[0] * grid[1]
    f = x[:, prefix:]
    shifted = f - f.amin(-1, keepdim=True)
    share = shifted / shifted.sum(-1, keepdim=True).clamp(min=1e-8)
    sink = share[..., list(sinks)].amax(-1) > sigma / C  # B x N
    plane = f.transpose(1, 2).reshape(B, C, *grid)
    mean = F.avg_pool2d(plane, 3, stride=1, padding=1, count_include_pad=True).flatten(2).transpose(1, 2)
    return torch.cat([x[:, :prefix], (1 - alpha) * f + alpha * torch.where(sink[..., None], mean, f)], dim=1)


@dataclasses.dataclass
class Refocused:
    """One batch of windows through the refocus forward: L2-normalised patch features B x h x w x D, the L2-normalised
    CLS embedding of x_L (B x D), input a's attention (B x H x N x N, patches) when asked for."""

    features: torch.Tensor
    cls: torch.Tensor
    maps: torch.Tensor | None = None


def refocused(clip, crops: torch.Tensor, spec: AttentionSpec, pos_interp: str = "size", maps: bool = False, cls_only: bool = False) -> Refocused:
    """The refocus forward (module docstring) of B CLIP-normalised crops whose sides are whole patches."""
    x, grid = clip._embed(crops, pos_interp)
    blocks = clip.visual.transformer.resblocks
    den = spec.extra("denoise")
    den = Denoise.parse(den) if den is not None else None
    sinks = den.sinks(x.shape[-1]) if den is not None else ()
    prefix = x.shape[1] - grid[0] * grid[1]
    norm = spec.norm

    def kk_map(block, u):
        k = block_qkv(block, block.ln_1(u), grid)[1]
        return normalize(pair_scores(k, k, k.shape[-1] ** -0.5), norm)[..., prefix:, prefix:]

    def step(block, u):
        u = run_block(block, u, grid)
        return denoise_tokens(u, grid, sinks, den.sigma, den.alpha) if den is not None else u

    kk, guide = 0, 0
    for blk in blocks[:-1]:
        if not cls_only:
            kk = kk + kk_map(blk, x)
        x = step(blk, x)
        guide = guide + x
    last = blocks[-1]
    top = step(last, x)
    cls = clip.project(top[:, 0])
    if cls_only:
        return Refocused(torch.empty(0), cls)
    guide = (guide + top) / len(blocks)
    g = F.normalize(guide[:, prefix:].float(), dim=-1)
    sim = g @ g.transpose(-2, -1)
    sim = sim.masked_fill(sim < _beta(spec.extra("refocus")), 0.0).to(x.dtype)
    outs, first = [], None
    for u in (x, guide):
        u = torch.cat([u[:, :prefix], sim @ u[:, prefix:]], dim=1)
        A = (kk + kk_map(last, u)) / len(blocks)
        first = A if first is None else first
        v = block_qkv(last, last.ln_1(u), grid)[2][:, :, prefix:]
        o = (A.to(v.dtype) @ v).transpose(1, 2).flatten(2)
        outs.append(last.ls_1(positive_attention(last.attn).out_proj(o)))
    feats = clip.project((outs[0] + outs[1]) / 2).reshape(x.shape[0], *grid, -1)
    return Refocused(feats, cls, first.float() if maps else None)


def refocus_cosine(run: ImageRun, out_size: tuple[int, int] | None = None) -> CosineMap:
    """The refocus forward's N_names x H x W cosine map (at `out_size`, default the network input's)."""
    clip, s, spec = run.clip, run.settings, run.spec
    text = run.text.to(clip.device)
    H, W = run.pixels.shape[-2:]
    boxes = window_boxes(H, W, s.window, s.stride)
    pad = window_padding(boxes[0], clip.patch_size, s.remainder, not s.window)
    presence = spec.extra("presence")
    if presence is not None:
        presence, source = presence_arg(presence)
        clusters = linkage_clusters(text, presence.linkage, presence.threshold)
        if source == "image" and len(boxes) > 1:
            whole = F.pad(run.pixels, window_padding((0, H, 0, W), clip.patch_size, s.remainder, True))
            image_cls = refocused(clip, whole, spec, s.pos_interp, cls_only=True).cls
    cos = []
    for b0 in range(0, len(boxes), s.batch_size):
        chunk = boxes[b0 : b0 + s.batch_size]
        crops = F.pad(torch.cat([run.pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk]), pad)
        out = refocused(clip, crops, spec, s.pos_interp)
        feats = out.features
        if presence is None:
            cos.append(torch.einsum("bhwd,nd->bhwn", feats, text))
            continue
        g = (image_cls if source == "image" and len(boxes) > 1 else out.cls) @ text.T
        logits = presence.logits(feats.flatten(1, 2), g.expand(len(chunk), -1), text, clusters)
        cos.append(logits.reshape(*feats.shape[:3], -1))
    return window_cosine_map(run, boxes, torch.cat(cos), out_size)


class RefocusForward(Forward):
    """RF-CLIP's forward (`refocus:BETA`, with `denoise` and `presence`): each batch of windows through
    `refocused`, the text adjusted per window when `presence` is set; the windows' maps averaged as usual."""

    name = FORWARD
    kinds = frozenset({"windows", "retrieval"})

    def check(self, plan: Plan) -> None:
        check_refocus(plan.spec)

    def refusal(self, stage: Stage, plan: Plan) -> str:
        return f"stage {stage.name} cannot run in RF-CLIP's refocus forward (spec {plan.spec})"

    def check_model(self, plan: Plan, clip) -> None:
        den = plan.spec.extra("denoise")
        if den is not None:
            Denoise.parse(den).sinks(clip.visual.transformer.width)

    def cosine(self, run: ImageRun) -> CosineMap:
        return refocus_cosine(run, run.out_size)

    @torch.inference_mode()
    def attention(self, run: ImageRun, whole_image: bool = False) -> Iterator[AttentionWindow]:
        """Per window (or one over the whole input) the map input x_{L-1} attends with (heads x N x N, patches)."""
        clip, s = run.clip, run.settings
        H, W = run.pixels.shape[-2:]
        window = 0 if whole_image else s.window
        for box in window_boxes(H, W, window, s.stride):
            pad = window_padding(box, clip.patch_size, s.remainder, not window)
            y1, y2, x1, x2 = box
            crop = F.pad(run.pixels[..., y1:y2, x1:x2], pad)
            out = refocused(clip, crop, run.spec, s.pos_interp, maps=True)
            yield AttentionWindow(box, pad, tuple(out.features.shape[1:3]), out.maps[0])


FORWARDS.register(FORWARD, RefocusForward(), help="RF-CLIP: per-block sink denoising, the last block on two guided inputs with every block's k-k maps (refocus:BETA)")


# -- presets and protocol -------------------------------------------------------------------------------------------------
def _spec(w: float, a: float, t: float, source: str = "") -> str:
    tail = ",window" if source == "window" else ""
    return f"kk/softmax/cls:0/noffn/denoise:{SIGMA:g},{ALPHA:g}/refocus:{BETA:g}/presence:complete,{w:g},{a:g},{t:g}{tail}"


# configs/cfg_*.py: (global_semantics_weight, mean_vector_weight, h_threshold)
CONSTANTS = {
    "voc21": (0.1, 0.03, 0.10), "voc20": (0.4, 0.02, 0.10), "context60": (0.25, 0.04, 0.09), "context59": (0.25, 0.04, 0.09),
    "coco-object": (0.25, 0.01, 0.10), "coco-stuff": (0.2, 0.02, 0.02), "cityscapes": (0.1, 0.03, 0.14), "ade20k": (0.3, 0.05, 0.06),
}  # fmt: skip
RFCLIP = _spec(*CONSTANTS["ade20k"])
RFCLIP_NOTES = (
    "copied: blocks 1..11 ordinary attention (attn_refocusing's default 'vanilla': the paper's redistribution is dead "
    "code), after every block (the last one's normal run too) the patches whose largest share (f - min f) / sum(f - min "
    "f) over channels 4, 162, 189, 326, 429, 474, 633, 713 (ViT-L/14: the code's commented list) exceeds 5 / 768 mixed "
    "0.6 x + 0.4 x their 3 x 3 mean (zero padded, centre included); G = mean of the 12 denoised block outputs (CLS "
    "included); S = cos(G) over the patches, entries < 0.4 set to 0, rows not normalised; the last block on x_11 and "
    "on G, each with its patches replaced by S x its patches: out_proj(A V) on the patches, no residual or FFN, A = "
    "mean over all 12 blocks of softmax(s k k^T) over CLS + patches, patch part, rows not renormalised (block 12's "
    "from the input itself); the two outputs averaged, ln_post, proj; names clustered by complete linkage on cosine "
    "distances cut at h_threshold; per window in each cluster the name with the largest cosine to the global "
    "embedding moved towards the mean of its 2 most similar patches (weight alpha), logits = (1 - w) cos + w g; the "
    "global embedding the CLS of the denoised x_12 of the whole network input (Cityscapes: the window's; a whole-image "
    "run: its own); "
    "fixed: the whole input's global embedding computed once per image (the code re-runs it for every window); "
    "not copied: fp16 on GPU; the ViT-L/14 scale_up branch (off in the configs); the paper's attention redistribution "
    "(not in the released code)"
)
register_preset(
    "rfclip",
    RFCLIP,
    "RF-CLIP (AAAI 2026) as released, ViT-B/16: per-block sink denoising, the last block on x_11 and the mean of all "
    "blocks (thresholded-cosine aggregation) with the mean of every block's k-k maps, CASS's text presence adjustment "
    "(complete linkage; ADE20K's constants: the rfclip protocol sets each dataset's)",
    RFCLIP_NOTES,
)
register_entmax_variant("rfclip")

# configs/cfg_*.py over RF_CLIP's defaults: SCLIP's line (short side 336, Cityscapes 560, COCO-Stuff 336), 224/112
# windows except VOC21 and COCO-Stuff (whole image, slide_crop=0), logit scale 40, prob_thd 0.1 with background, PAMR
# off (eval_all.sh --pamr off); the class files are SCLIP's (README: "following SCLIP"; none in the repository).
PROTOCOL = PROTOCOLS.register(
    "rfclip",
    Protocol(
        name="rfclip",
        attention="rfclip",
        class_names="sclip",
        source="liblacklucy/RF-CLIP@c2b333e configs/cfg_*.py, custom_segmentor.py, eval.py, eval_all.sh",
        defaults=dict(resolution=336, window=224, stride=112, logit_scale=40.0, resize="opencv", pos_interp="scale", remainder="drop"),
        per_dataset={
            "voc21": dict(window=0, bg_threshold=0.1),
            "context60": dict(bg_threshold=0.1),
            "coco-object": dict(bg_threshold=0.1),
            "coco-stuff": dict(window=0),
            "cityscapes": dict(resolution=560),
        },
        attention_per_dataset={ds: _spec(*c, "window" if ds == "cityscapes" else "") for ds, c in CONSTANTS.items()},
    ),
    help="RF-CLIP (AAAI 2026): SCLIP's line (336, Cityscapes 560), VOC21 and COCO-Stuff whole image, its per-dataset "
    "text-adjustment constants, PAMR off",
)
# eval.py --pamr on: PAMR with 10 steps, dilations (8, 16), the paper's "+PAMR" row
PAMR_PROTOCOL = PROTOCOLS.register(
    "rfclip-pamr",
    dataclasses.replace(PROTOCOL, name="rfclip-pamr", defaults={**PROTOCOL.defaults, "pamr": True}),
    help="RF-CLIP with eval.py --pamr on (10 steps, dilations 8, 16): the paper's +PAMR row",
)

# Reported mIoU, OpenAI CLIP ViT-B/16 (the paper's Table 1 as research/peers.md 1 read it; its +PAMR row also in
# ActiveSAM's Table 1). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 64.8, "context60": 36.4, "coco-object": 37.9, "voc20": 87.0, "context59": 39.8,
     "coco-stuff": 26.3, "cityscapes": 41.3, "ade20k": 20.4},
    "RF-CLIP (arXiv 2511.16170) Table 1, second-hand (research/peers.md 1); the released code liblacklucy/RF-CLIP@c2b333e README.md has no table",
    note="the paper's attention redistribution is not in the released code, which this preset follows",
    printed_average=44.2,
)
register_published(
    PAMR_PROTOCOL,
    {"voc21": 67.2, "context60": 37.9, "coco-object": 39.1, "voc20": 87.0, "context59": 41.4,
     "coco-stuff": 27.5, "cityscapes": 43.0, "ade20k": 21.0},
    "RF-CLIP (arXiv 2511.16170) Table 1 (+PAMR), as ActiveSAM's Table 1 reprints it (VILA-Lab/ActiveSAM@41cad43 results/table1.png)",
    note="the paper's attention redistribution is not in the released code, which this preset follows",
    printed_average=45.5,
)  # fmt: skip
