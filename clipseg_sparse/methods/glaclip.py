"""GLA-CLIP (CVPR 2026, arXiv 2603.23030): ProxyCLIP whose last block attends to the keys and values of every
window of the image.

Read from 2btlFe/GLA-CLIP@ba74915 (`gla_clip_segmentor.py`: `forward_feature`, `forward_kv_expansion`,
`postprocess_result`; `open_clip/transformer.py`: `VisionTransformer.forward`, `Custom_Attn_Model_Type`;
`myutils.py`: `KV_Extension`, `dynamic_beta`, `dynamic_gamma`; `predict.sh`, `eval.py`, `cfg.py`,
`configs/cfg_*.py`). `predict.sh` runs `--CLIP_type ProxyCLIP --token_norm --KV_token_extension --proxy_sim
--mini_iters 2 --dynamic_beta --beta_alpha 0.3 --dynamic_gamma --gamma_alpha 30`. In the engine's axes it is
ProxyCLIP's term (`ext:dino_vitb8`, the cosine of DINO ViT-B/8's last normed tokens, one map for all heads,
`cls:0/noffn` W_o(A V) on CLIP's values resized to the DINO grid) with three options, registered here:

- `kv:image`: the keys (DINO tokens, L2-normalised) and values of every window of the image, concatenated
  (where windows overlap a token is there once per window: duplicates kept, nothing stitched); each window's
  tokens are the queries. It runs in the forward `crosswindow` below (all windows first, then the attention a
  block of rows at a time: `attention/stitched.py`).
- `anchor:I,T`: each query replaced by its proxy anchor, I times: the L2-normalised mean of the keys whose
  cosine with the current query exceeds T (none: the query's own key); the scores are anchor . key.
- `dyn:A,G`: per row, S <- (S - beta max(mean_j S, 0)) gamma with beta = 1 + A ln(1 + windows) and gamma =
  1 + G / (the keys the last anchor step kept).

The term's `pos` support is GLA's cut: entries below min(row max, 0) are dropped (a row with no positive score
keeps its maximum). One normalizer slot (the softmax over all windows' keys): `glaclip-entmax` puts entmax:1.5
there. Quirks copied, fixed and not copied: `GLACLIP_NOTES` (datasets.md, Presets). Grid:
`sweeps/grids/glaclip.toml`.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec
from ..attention.contract import positive_attention
from ..attention.grid import values_to_grid
from ..attention.normalizers import normalize
from ..attention.presets import register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..attention.stitched import blocked_attention
from ..attention.taps import block_qkv, run_block
from ..attention.terms import fmt_num
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..models.proxies import ext_features, proxy_grid, split_ext
from ..segment.maps import CosineMap
from ..segment.plan import FORWARDS, AttentionWindow, Forward, ImageRun, Plan
from ..segment.preprocess import window_boxes, window_padding
from ..segment.windows import window_cosine_map
from ..stages import Needs, Stage

ANCHOR_ITERS, ANCHOR_THRESHOLD = 2, 0.55  # predict.sh --mini_iters 2; eval.py --initial_crit_pos default
BETA_ALPHA, GAMMA_ALPHA = 0.3, 30.0  # predict.sh --beta_alpha 0.3 --gamma_alpha 30
FORWARD = "crosswindow"


# -- the options ---------------------------------------------------------------------------------------------
def _two_numbers(name: str, arg: str, usage: str, integer_first: bool = False) -> tuple[float, float]:
    first, comma, second = arg.partition(",")
    try:
        a, b = float(first), float(second)
        if comma and math.isfinite(a) and math.isfinite(b) and a >= (1 if integer_first else 0) and b >= 0 and (not integer_first or a.is_integer()):
            return a, b
    except ValueError:
        pass
    raise UserValueError(f"bad option {name}:{arg}: write {usage}")


def anchor_arg(arg: str) -> tuple[int, float]:
    iters, threshold = _two_numbers("anchor", arg, "anchor:I,T (I >= 1 proxy-anchor steps, keys with cosine above T averaged)", integer_first=True)
    return int(iters), threshold


def dyn_arg(arg: str) -> tuple[float, float]:
    return _two_numbers("dyn", arg, "dyn:A,G (beta = 1 + A ln(1 + windows), gamma = 1 + G / anchor count; A, G >= 0)")


def _kv_arg(arg: str) -> str:
    if arg != "image":
        raise UserValueError(f"bad option kv:{arg}: write kv:image (the keys and values of every window of the image)")
    return arg


def _needs(option: str):
    return lambda arg: Needs(forward=((FORWARD, f"{option}:{arg}"),))


def _windows_alone(arg: str, weights, values):
    raise UserValueError("kv:image attends over every window of an image: it runs in the crosswindow forward (Segmenter, "
                         "eval); encode_dense and attention_maps encode windows alone")


register_option(
    "kv",
    _kv_arg,
    help="kv:image (GLA-CLIP: the last block's keys and values from every window of the image, duplicates kept; the crosswindow forward)",
    needs=_needs("kv"),
    values=_windows_alone,
)
register_option(
    "anchor",
    lambda arg: "{},{}".format(anchor_arg(arg)[0], fmt_num(anchor_arg(arg)[1])),
    help="anchor:I,T (GLA-CLIP, with kv:image: each query replaced I times by the mean of the keys whose cosine with it exceeds T)",
    needs=_needs("anchor"),
)
register_option(
    "dyn",
    lambda arg: ",".join(fmt_num(x) for x in dyn_arg(arg)),
    help="dyn:A,G (GLA-CLIP, with kv:image and anchor: S <- (S - beta max(row mean, 0)) gamma, beta = 1 + A ln(1 + windows), gamma = 1 + G / anchor count)",
    needs=_needs("dyn"),
)

CROSSWINDOW_OPTIONS = ("kv", "anchor", "dyn")


def check_crosswindow(spec: AttentionSpec | str) -> None:
    """UserValueError unless the crosswindow forward runs the spec: one term `ext:NAME[cos,pos]`, `cls:0/noffn`,
    one edited block in replace mode without aggregation, extra inputs, hooks, gauss, neg or temp, `kv:image`,
    and `dyn` only with `anchor`."""
    spec = resolve_spec(spec)
    terms = spec.terms
    term = terms[0] if len(terms) == 1 else None
    why = None
    if spec.extra("kv") is None:
        why = "kv:image (anchor and dyn act on the attention over every window's keys)"
    elif term is None or term.kind != "ext" or split_ext(term.ref.arg)[1] or spec.groups[0].weight != 1:
        why = "one score term ext:NAME (the backbone's last tokens)"
    elif term.metric != "cos" or term.support != "pos" or term.shift or term.scale != 1 or term.iterate or term.temp is not None:
        why = "the term as ext:NAME[cos,pos] (anchor and dyn set the scores)"
    elif spec.cls_residual != 0 or spec.ffn or spec.layers != 1 or spec.parallel or spec.aggregate_in or spec.aggregate_out or spec.inputs:
        why = "cls:0/noffn, one edited block, no parallel path, aggregation or extra input"
    elif spec.hooks or spec.gauss_sigma is not None or spec.negative or spec.temperature is not None:
        why = "no hook, gauss, neg or temp option"
    elif spec.extra("dyn") is not None and spec.extra("anchor") is None:
        why = "anchor:I,T with dyn:A,G (gamma counts the keys the anchor kept)"
    elif any(name not in CROSSWINDOW_OPTIONS for name, _ in spec.extras):
        why = f"no option but {', '.join(CROSSWINDOW_OPTIONS)}"
    if why:
        raise UserValueError(f"spec {spec}: the crosswindow forward (kv, anchor, dyn; GLA-CLIP) needs {why}")


# -- the attention over every window's keys ---------------------------------------------------------------------
def crosswindow_scores(keys: torch.Tensor, r0: int, r1: int, windows: int, anchor: tuple[int, float] | None,
                       dyn: tuple[float, float] | None) -> torch.Tensor:
    """Rows r0..r1 of the scores over all M keys (M x C, L2-normalised, every window's tokens in order; the
    queries are the keys themselves): (r1 - r0) x M, -inf outside the support (module docstring)."""
    q = keys[r0:r1]
    count = None
    if anchor is not None:
        iters, threshold = anchor
        own = torch.arange(r0, r1, device=keys.device)
        for _ in range(iters):
            kept = (q @ keys.T) > threshold
            kept[own - r0, own] |= ~kept.any(-1)  # a query no key is close to keeps its own
            count = kept.sum(-1, keepdim=True)
            q = F.normalize(kept.to(keys.dtype) @ keys, dim=-1)
    s = q @ keys.T
    if dyn is not None:
        a, g = dyn
        beta = 1 + a * math.log1p(windows)
        s = (s - beta * s.mean(-1, keepdim=True).clamp(min=0)) * (1 + g / count)
    floor = s.amax(-1, keepdim=True).clamp(max=0)
    return s.masked_fill(s < floor, float("-inf"))


def crosswindow_attention(keys: torch.Tensor, values: torch.Tensor, spec: AttentionSpec, windows: int, rows: int | None = None) -> torch.Tensor:
    """normalize(scores) @ values over all M keys (M x C) and values (M x V), a block of rows at a time: M x V."""
    anchor, dyn = (spec.extra(name) for name in ("anchor", "dyn"))
    anchor = anchor_arg(anchor) if anchor is not None else None
    dyn = dyn_arg(dyn) if dyn is not None else None
    return blocked_attention(lambda r0, r1: crosswindow_scores(keys, r0, r1, windows, anchor, dyn), values, spec.norm, rows)


def window_tokens(run: ImageRun, boxes, pad) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Keys (B x M x C, the backbone's last tokens, L2-normalised, fp32), the last block's values on the
    backbone's grid (B x M x H*d, heads concatenated) and that grid, for the windows `boxes` of the run's network
    input, each padded by `pad` (F.pad widths), CLIP's blocks 1..L-1 run as they are."""
    clip, s, spec = run.clip, run.settings, run.spec
    arg = spec.terms[0].ref.arg
    blocks = clip.visual.transformer.resblocks
    last = blocks[-1]
    keys, values = [], []
    for b0 in range(0, len(boxes), s.batch_size):
        crops = F.pad(torch.cat([run.pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in boxes[b0 : b0 + s.batch_size]]), pad)
        x, grid = clip._embed(crops, s.pos_interp)
        for blk in blocks[:-1]:
            x = run_block(blk, x, grid)
        patches = x[:, x.shape[1] - grid[0] * grid[1] :]
        _, _, v = block_qkv(last, last.ln_1(patches), grid)
        dgrid = proxy_grid(arg, tuple(crops.shape[-2:]))
        v = values_to_grid(v, grid, dgrid)
        values.append(v.transpose(1, 2).flatten(2))
        keys.append(F.normalize(ext_features(crops.to(clip.device), arg, run.backbones)[:, 0].float(), dim=-1))
    return torch.cat(keys), torch.cat(values), dgrid


@torch.inference_mode()
def crosswindow_features(run: ImageRun, rows: int | None = None) -> tuple[list, torch.Tensor]:
    """(the windows' boxes, their B x I x J x D L2-normalised features on the backbone's grid) by the crosswindow
    forward: every window's keys and values first, then the last block's attention over all of them, W_o, ln_post,
    proj. rows: rows per block of that attention (default: by memory)."""
    clip, s = run.clip, run.settings
    boxes = window_boxes(*run.pixels.shape[-2:], s.window, s.stride)
    keys, values, dgrid = window_tokens(run, boxes, window_padding(boxes[0], clip.patch_size, s.remainder))
    B, M = keys.shape[:2]
    out = crosswindow_attention(keys.flatten(0, 1), values.flatten(0, 1), run.spec, B, rows)
    last = clip.visual.transformer.resblocks[-1]
    tokens = last.ls_1(positive_attention(last.attn).out_proj(out.to(values.dtype)))
    return boxes, clip.project(tokens).reshape(B, *dgrid, -1)


class CrossWindowForward(Forward):
    """GLA-CLIP's forward (`kv:image`): the sliding windows' keys and values gathered, each window's queries
    attending over all of them; the windows' maps then averaged as usual (windows stages see them first)."""

    name = FORWARD
    kinds = frozenset({"windows", "retrieval"})

    def check(self, plan: Plan) -> None:
        check_crosswindow(plan.spec)
        if not plan.settings.window:
            raise UserValueError(f"spec {plan.spec} couples sliding windows: set a window size (not 0)")

    def refusal(self, stage: Stage, plan: Plan) -> str:
        return f"stage {stage.name} cannot run with spec {plan.spec}, whose windows attend to each other (kv:image)"

    def cosine(self, run: ImageRun) -> CosineMap:
        boxes, feats = crosswindow_features(run)
        cos = torch.einsum("bhwd,nd->bhwn", feats, run.text.to(feats.device))
        return window_cosine_map(run, boxes, cos, run.out_size)

    @torch.inference_mode()
    def attention(self, run: ImageRun, whole_image: bool = False) -> Iterator[AttentionWindow]:
        """One window over the whole network input (explain): its map over its own keys (with one window, the
        forward's attention is square); analyze's per-window maps do not exist here (each row spans every window)."""
        if not whole_image:
            raise UserValueError(f"spec {run.spec}: each window's attention spans every window's keys (kv:image); analyze measures "
                                 "square per-window maps (explain shows one window over the whole image)")
        H, W = run.pixels.shape[-2:]
        box = (0, H, 0, W)
        pad = window_padding(box, run.clip.patch_size, run.settings.remainder, True)
        keys, _, dgrid = window_tokens(run, [box], pad)
        maps = normalize(crosswindow_scores(keys[0], 0, keys.shape[1], 1, *_transforms(run.spec)), run.spec.norm)
        yield AttentionWindow(box, pad, dgrid, maps[None].float())


def _transforms(spec: AttentionSpec) -> tuple:
    anchor, dyn = spec.extra("anchor"), spec.extra("dyn")
    return (anchor_arg(anchor) if anchor is not None else None, dyn_arg(dyn) if dyn is not None else None)


FORWARDS.register(FORWARD, CrossWindowForward(), help="GLA-CLIP: every window's queries attend to the keys and values of all windows (kv:image)")


# -- preset and protocol -------------------------------------------------------------------------------------------
GLACLIP = f"ext:dino_vitb8[cos,pos]/softmax/cls:0/noffn/kv:image/anchor:{ANCHOR_ITERS},{ANCHOR_THRESHOLD}/dyn:{BETA_ALPHA},{GAMMA_ALPHA:g}"
GLACLIP_NOTES = (
    "copied: all windows of an image in one pass (mmseg's sliding windows); CLIP blocks 1..11 as they are, the last "
    "block's values of the patch tokens bilinearly resized to DINO ViT-B/8's grid (28 x 28 for 224); keys = DINO's last "
    "normed patch tokens of every window, concatenated and L2-normalised (overlapping windows give duplicates); 2 proxy-"
    "anchor steps: keys with cosine > 0.55 to the current query averaged and L2-normalised (none: the query's own key); "
    "S = anchor . key; per row S <- (S - beta max(mean_j S, 0)) gamma, beta = 1 + 0.3 ln(1 + windows), gamma = 1 + 30 / "
    "(keys the last step kept); entries below min(row max, 0) dropped; one softmax map for all heads over every window's "
    "values; W_o(A V), no residual, FFN or CLS; ln_post, proj; each window's map on the DINO grid bilinearly upsampled, "
    "windows averaged; the crit 0.55 is eval.py's default (predict.sh sets a shell variable 0.6 it never passes); "
    "fixed: a window whose side is not a multiple of 56 (none at the benchmarks' 224) is padded by the remainder rule and "
    "its map upsampled to the padded size before the crop (the code upsamples to the unpadded size, then crops); the "
    "attention a block of rows at a time (the code holds every window's S x M map); "
    "not copied: fp16 (CLIP and DINO), the unused smoothing/cutting_hp/temperature paths, the ';'-separated class files "
    "(the same names as SCLIP's files)"
)
register_preset(
    "glaclip",
    GLACLIP,
    "GLA-CLIP (CVPR 2026), ViT-B/16 + DINO ViT-B/8: ProxyCLIP's last block over the keys and values of every window "
    "(kv:image), proxy anchors (2 steps, 0.55), window- and count-dependent beta / gamma",
    GLACLIP_NOTES,
)
register_entmax_variant("glaclip")

# configs/cfg_*.py over cfg.ModelConfig and eval.py's defaults: short side 336 (Cityscapes 560; COCO-Stuff 336, not
# SCLIP's 448), 224/112 windows on every set (VOC21 too), logit scale 40, prob_thd 0.1 on VOC21, Context60 and
# COCO-Object, no area threshold, no PAMR; windows padded centred (compute_padsize), SCLIP's class names ('; ').
PROTOCOL = PROTOCOLS.register(
    "glaclip",
    Protocol(
        name="glaclip",
        attention="glaclip",
        class_names="sclip",
        source="2btlFe/GLA-CLIP@ba74915 configs/cfg_*.py, cfg.py, eval.py, predict.sh, gla_clip_segmentor.py",
        defaults=dict(resolution=336, window=224, stride=112, logit_scale=40.0, resize="opencv", pos_interp="scale", remainder="centre"),
        per_dataset={
            "cityscapes": dict(resolution=560),
            "voc21": dict(bg_threshold=0.1),
            "context60": dict(bg_threshold=0.1),
            "coco-object": dict(bg_threshold=0.1),
        },
    ),
    help="GLA-CLIP (CVPR 2026): short side 336 (Cityscapes 560), 224/112 windows, logit scale 40, prob_thd 0.1 with background",
)

# Reported mIoU, OpenAI CLIP ViT-B/16 + DINO ViT-B/8 ("ProxyCLIP + GLA-CLIP", no per-dataset knobs; the table's
# "Best" row with per-dataset (u, w) reaches 44.3). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 66.3, "context60": 36.1, "coco-object": 37.7, "voc20": 84.2, "context59": 39.9,
     "coco-stuff": 26.9, "cityscapes": 40.8, "ade20k": 20.0},
    "GLA-CLIP (arXiv 2603.23030) Table 1, the table image of its project page (2btlFe/GLA-CLIP@bf2baa6 static/images/Main Table.png)",
    printed_average=44.0,
)  # fmt: skip
