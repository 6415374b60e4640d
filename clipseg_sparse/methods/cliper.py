"""CLIPer (ICCV 2025, arXiv 2411.13836): every block's input through the last block with the fused attention of the
earlier blocks, per-layer logits, the last layer's propagated by that attention.

Read from linsun449/cliper.code@c05fa41 (`modified_clip/model.py`: `CLIPer.forward_transformer`, `custom_attn`,
`forward`, `forward_slide`, `_resize`, `upsample_pos_emb`, `classifier`; `ovs/pipeline.py`: `Pipeline.forward`,
`refinement`; `diffusion_model/stable_diffusion.py`, `Processor.py`; `ovs/main_ovs.py`; `util/miou.py`: `cam_to_label`; `data/*/cls_*.txt`, `data/*/*_datasets.py`;
`scripts/config/vit-{b-16,l-14}/*.yaml`, `util/args.py`). It runs in its own forward, `fused` below, on the whole
image (and, with a window, on the windows too; B/16 names, x_l the tokens after block l, u_l = ln_1 of block l's
input):

- blocks 1..L-1 run as CLIP runs them; the sum over them of each head's attention map, normalise(s q k^T) over CLS +
  patches, is M (heads x N x N): the spec's normalizer is this slot (`cliper-entmax`: entmax in each of the L-1
  maps; the blocks themselves keep CLIP's softmax);
- the last block runs L times, on u_1 .. u_{L-1} (each through the last block's ln_1 again) and on x_{L-1}: out_proj(A
  V), no residual, no FFN, CLS kept, ln_post, proj: L feature maps. Each run first divides M by its column sums, then
  by its row sums, in place (so the k-th input sees k + 1 such passes), then A = (M + M^T) / 2 minus each column's
  mean, clamped at 0, rows normalised;
- per layer, softmax over [names, background words, the mean of the names] of logit_scale x cosine, the names kept;
  with a window, the windows' logits averaged where they overlap are propagated by their head-mean maps placed on
  the image (overlaps averaged, rows normalised), softmaxed the same way, and averaged half and half with the whole
  image's;
- `fuse:T[,LAYER]` (0.2, -1): the chosen layer's map with entries below T x its class maximum set to 0 (in place:
  the mean below sees it too) is propagated by the head-mean of the last input's A, and the mean over the L layers
  is added;
- `cam:S,B[,norm]` (`cam_to_label`): each name's map resized bilinearly to the image, scaled to its maximum at the
  patch grid; names whose maximum is at most S dropped; with `norm` min-max normalised; entries below B set to 0
  (B = 0: a background channel (1 - max)^2). The forward's map is these scores (the background names': 0, or that
  channel), so the argmax of the labels (bg_threshold 0) is `cam_to_label`'s;
- `bg:N|WORDS`: the first N names of the vocabulary are the background words (VOC21 25, COCO-Object 23, Context60 1),
  or the vocabulary has none and the forward embeds CLIPer's words `voc`, `coco` or `background` with the run's
  templates;
- `fgc:STEP[,SEED]` (FGC, `cliper`; `cliper-nofgc` without it): the map, resized to 64 x 64, multiplied by the chained
  product of the thresholded self-attention maps of Stable Diffusion 2.1-base (diffusers, the optional extra
  `diffusion`) on the image's latent noised to step 45 of 50 (`diffusion_model/`, `ovs/pipeline.py`: 'SFSA'); each
  name's score the mean of its maximum before and after. The two recorded SD softmaxes are normalizer slots too.

Quirks copied, fixed and not copied: `CLIPER_NOTES` (datasets.md, Presets). Grid: `sweeps/grids/cliper.toml`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..attention import AttentionSpec, resolve_spec
from ..attention.contract import positive_attention
from ..attention.normalizers import Normalizer, normalize
from ..attention.presets import register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..attention.taps import block_qkv, run_block
from ..attention.terms import fmt_num
from ..errors import UserValueError
from ..runtime.weights import WeightsUnavailableError, hub_unavailable, require_extra
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..segment.maps import DenseMap
from ..segment.plan import FORWARDS, AttentionWindow, Forward, ImageRun, Plan
from ..segment.preprocess import window_boxes
from ..segment.settings import InferenceSettings
from ..segment.vocabulary import embed_names
from ..stages import Needs, Stage

FORWARD = "fused"
BASE = "qk/softmax/nores/noffn"
OPTIONS = ("fuse", "cam", "bg", "fgc")
EPS_MAX, EPS_NORM = 1e-5, 1e-6  # main_ovs.py: amax + 1e-5; cam_to_label: amax + 1e-6
EPS_COUNT = 1e-5  # forward_slide: count_mat_attns + 1e-5
# data/voc/cls_voc21.txt and data/coco14/cls_coco81.txt, first line (re.split(r"[\s,]+", ...)); the other sets' "background"
BACKGROUND_WORDS = {
    "voc": tuple(re.split(r"[\s,]+", "ground, land, grass, tree, building, wall, sky, lake, water, river, sea, railway, railroad, "
                          "keyboard, helmet, cloud, house, mountain, ocean, road, rock, street, valley, bridge, sign")),
    "coco": tuple(re.split(r"[\s,]+", "ground, land, grass, tree, building, wall, sky, lake, water, river, sea, railway, railroad, "
                           "helmet, cloud, house, mountain, ocean, road, rock, street, valley, bridge")),
    "background": ("background",),
}  # fmt: skip


# -- the options -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fuse:
    """`fuse:T[,LAYER]`: the attention threshold and the layer (counted back, -1 the last) that is propagated."""

    threshold: float
    layer: int = -1

    @classmethod
    def parse(cls, arg: str) -> "Fuse":
        parts = arg.split(",")
        try:
            threshold, layer = float(parts[0]), int(parts[1]) if len(parts) == 2 else -1
            if len(parts) <= 2 and 0 <= threshold <= 1 and layer < 0:
                return cls(threshold, layer)
        except (ValueError, IndexError):
            pass
        raise UserValueError(f"bad option fuse:{arg}: write fuse:T[,LAYER] (0 <= T <= 1, CLIPer's attention_thr; LAYER < 0 the "
                             "layer propagated, counted back from the last, default -1)")

    def __str__(self) -> str:
        return fmt_num(self.threshold) + ("" if self.layer == -1 else f",{self.layer}")


@dataclasses.dataclass(frozen=True)
class Cam:
    """`cam:S,B[,norm]`: `cam_to_label`'s score threshold, background threshold and min-max normalisation."""

    score: float
    background: float
    normalize: bool = False

    @classmethod
    def parse(cls, arg: str) -> "Cam":
        parts = arg.split(",")
        try:
            score, background = float(parts[0]), float(parts[1])
            if len(parts) in (2, 3) and (len(parts) == 2 or parts[2] == "norm") and score >= 0 and 0 <= background <= 1 and math.isfinite(score):
                return cls(score, background, len(parts) == 3)
        except (ValueError, IndexError):
            pass
        raise UserValueError(f"bad option cam:{arg}: write cam:S,B[,norm] (S >= 0 the score a name's maximum must exceed, 0 <= B <= 1 "
                             "the value below which a map is 0; norm: min-max normalised first)")

    def __str__(self) -> str:
        return f"{fmt_num(self.score)},{fmt_num(self.background)}" + (",norm" if self.normalize else "")


def background_arg(arg: str) -> int | str:
    """`bg:N` -> N (the vocabulary's first N names are background words), `bg:WORDS` -> the key of CLIPer's words."""
    if arg.isdigit():
        return int(arg)
    if arg in BACKGROUND_WORDS:
        return arg
    raise UserValueError(f"bad option bg:{arg}: write bg:N (the first N names are the background words) or bg:WORDS, one of "
                         f"{', '.join(BACKGROUND_WORDS)} (CLIPer's words, embedded with the run's templates)")


def _needs(option: str):
    return lambda arg: Needs(forward=((FORWARD, f"{option}:{arg}"),))


register_option("fuse", lambda arg: str(Fuse.parse(arg)), needs=_needs("fuse"),
                help="fuse:T[,LAYER] (CLIPer: every block's input through the last block with the fused attention of the earlier "
                "blocks, per-layer logits, the layer's map thresholded at T x its maximum propagated; the fused forward)")
register_option("cam", lambda arg: str(Cam.parse(arg)), needs=_needs("cam"),
                help="cam:S,B[,norm] (CLIPer's cam_to_label: names scoring at most S dropped, maps below B zeroed, norm: min-max first; "
                "the fused forward)")
register_option("bg", lambda arg: str(background_arg(arg)), needs=_needs("bg"),
                help="bg:N|voc|coco|background (CLIPer: the first N names are background words, or CLIPer's words embedded; the fused forward)")
register_option("fgc", lambda arg: str(Fgc.parse(arg)), needs=lambda arg: _needs("fgc")(arg) | Needs(models=(SD_NAME,)),
                help="fgc:STEP[,SEED] (CLIPer's FGC: the map refined by Stable Diffusion 2.1-base's self-attention, the image's latent noised "
                "to step STEP of 50 with seeded noise; needs diffusers; the fused forward)")


def check_fused(spec: AttentionSpec | str) -> None:
    """UserValueError unless the fused forward runs the spec: `qk/NORMALIZER/nores/noffn` with `fuse`, and `cam`, `bg`, `fgc`."""
    spec = resolve_spec(spec)
    if spec.extra("fuse") is None or spec.replace(normalizer="softmax", extras=()) != AttentionSpec.parse(BASE) or any(n not in OPTIONS for n, _ in spec.extras):
        raise UserValueError(f"spec {spec}: the fused forward (CLIPer) runs {BASE.replace('softmax', 'NORMALIZER')}/fuse:T with the "
                             "options cam, bg and fgc, nothing else")


# -- the forward ---------------------------------------------------------------------------------------------------------
def cliper_size(height: int, width: int, short: int, patch: int) -> tuple[int, int]:
    """`CLIPer._resize`: the short side to `short` (0: kept), each side rounded to the nearest multiple of the patch."""
    ratio = short / min(height, width) if short else 1.0
    return int(height * ratio / patch + 0.5) * patch, int(width * ratio / patch + 0.5) * patch


def embed(clip, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """`forward_visual` up to ln_pre: B x (1 + h*w) x C tokens and the grid (h, w). The positional embeddings are
    resized bilinearly to the grid and rounded to fp16 (`upsample_pos_emb`, on every device)."""
    v = clip.visual
    x = v.conv1(pixels.to(device=clip.device, dtype=clip.dtype))
    grid = tuple(x.shape[-2:])
    x = x.flatten(2).transpose(1, 2)
    pos = v.positional_embedding
    side = int(math.isqrt(pos.shape[0] - 1))
    patches = pos[1:].T.reshape(1, -1, side, side).float()
    patches = F.interpolate(patches, size=grid, mode="bilinear", align_corners=False).reshape(pos.shape[1], -1).T
    pos = torch.cat([pos[:1].float(), patches]).half().to(x.dtype)
    cls = v.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
    return v.ln_pre(torch.cat([cls, x], dim=1) + pos), grid


def fused_attention(M: torch.Tensor) -> torch.Tensor:
    """`custom_attn`'s 'fused-attn' map of the summed maps M (B x H x N x N), which it normalises in place: columns,
    then rows (the next call starts from there); then symmetrised, each column's mean subtracted, clamped at 0, rows
    normalised."""
    M /= M.sum(-2, keepdim=True)
    M /= M.sum(-1, keepdim=True)
    A = (M + M.transpose(-2, -1)) / 2
    A = (A - A.mean(-2, keepdim=True)).clamp_(min=0)
    return A / A.sum(-1, keepdim=True)


@torch.inference_mode()
def fused_features(clip, crops: torch.Tensor, normalizer: str | Normalizer = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_transformer` on B crops: (L x B x N x D L2-normalised features of the L inputs, CLS first; B x H x N x N
    the fused map the last input attended with)."""
    x, grid = embed(clip, crops)
    blocks = clip.visual.transformer.resblocks
    M, inputs = 0, []
    for blk in blocks[:-1]:
        u = blk.ln_1(x)
        q, k, _ = block_qkv(blk, u, grid)
        M = M + normalize(torch.matmul(q.float() * q.shape[-1] ** -0.5, k.float().transpose(-2, -1)), normalizer)
        inputs.append(u)
        x = run_block(blk, x, grid)
    inputs.append(x)
    last = blocks[-1]
    out_proj = positive_attention(last.attn).out_proj
    outs = []
    for u in inputs:
        A = fused_attention(M)
        v = block_qkv(last, last.ln_1(u), grid)[2]
        outs.append(last.ls_1(out_proj((A.to(v.dtype) @ v).transpose(1, 2).flatten(2))))
    return clip.project(torch.stack(outs)), A


def text_rows(run: ImageRun, bg: int | str) -> tuple[torch.Tensor, int]:
    """(T x D rows the softmax runs over: the names, the background words, the names' mean; the number of names, the
    rows kept)."""
    text = run.text.to(run.clip.device).float()
    if isinstance(bg, int) and bg >= len(text):
        raise UserValueError(f"bg:{bg}: the vocabulary has {len(text)} names, so none would be left after the {bg} background words")
    if isinstance(bg, int):
        names, words = text[bg:], text[:bg]
    else:
        names, words = text, _embedded_words(run.clip, BACKGROUND_WORDS[bg], tuple(run.templates or ())).to(text)
    return torch.cat([names, words, F.normalize(names.mean(0, keepdim=True), dim=-1)]), len(names)


_WORDS: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}  # (id(clip), words, templates) -> (the clip, embeddings)


def _embedded_words(clip, words: tuple[str, ...], templates: tuple[str, ...]) -> torch.Tensor:
    """The words' embeddings (`embed_names`, the run's templates; openai's when it has none), once per model."""
    key = (id(clip), words, templates)
    ref, emb = _WORDS.get(key, (None, None))
    if ref is None or ref() is not clip:
        emb = embed_names(clip, words, templates or "openai")
        for gone in [k for k, (r, _) in _WORDS.items() if r() is None]:
            del _WORDS[gone]
        _WORDS[key] = (weakref.ref(clip), emb)
    return emb


def layer_logits(feats: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """`classify`: L x B x n x D features -> L x B x T x n logits."""
    return (scale * feats @ rows.T).transpose(-2, -1)


def slide_logits(clip, pixels: torch.Tensor, rows: torch.Tensor, settings: InferenceSettings, normalizer) -> torch.Tensor:
    """`forward_slide`: the windows' logits (L x T x h x w, averaged where they overlap) propagated by their head-mean
    fused maps placed on the image's patch grid (overlaps averaged with 1e-5 in the count, rows normalised)."""
    ps = clip.patch_size
    H, W = pixels.shape[-2:]
    h, w = H // ps, W // ps
    boxes = window_boxes(H, W, settings.window, settings.stride)
    preds = pixels.new_zeros(len(clip.visual.transformer.resblocks), rows.shape[0], h, w)
    count = pixels.new_zeros(h, w)
    attns = pixels.new_zeros(h, w, h, w)
    count_attns = torch.zeros_like(attns)
    for b0 in range(0, len(boxes), settings.batch_size):
        chunk = boxes[b0 : b0 + settings.batch_size]
        feats, A = fused_features(clip, torch.cat([pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk]), normalizer)
        logits = layer_logits(feats[:, :, 1:], rows, settings.logit_scale)
        maps = A.mean(1)[:, 1:, 1:].float()
        for i, (y1, y2, x1, x2) in enumerate(chunk):
            a, b, c, d = y1 // ps, y2 // ps, x1 // ps, x2 // ps
            preds[..., a:b, c:d] += logits[:, i].reshape(*logits.shape[:1], -1, b - a, d - c)
            count[a:b, c:d] += 1
            attns[a:b, c:d, a:b, c:d] += maps[i].reshape(b - a, d - c, b - a, d - c)
            count_attns[a:b, c:d, a:b, c:d] += 1
    preds /= count
    attns /= count_attns + EPS_COUNT
    attns = attns.reshape(h * w, h * w)
    attns /= attns.sum(-1, keepdim=True)
    return (preds.flatten(-2) @ attns).unflatten(-1, (h, w))


@torch.inference_mode()
def cliper_seg(run: ImageRun) -> tuple[torch.Tensor, torch.Tensor]:
    """`CLIPer.forward`: (names x h x w seg, heads x N x N the whole image's fused map of the last input)."""
    clip, s, spec = run.clip, run.settings, run.spec
    fuse, bg = Fuse.parse(spec.extra("fuse")), background_arg(spec.extra("bg") or "background")
    rows, n = text_rows(run, bg)
    h, w = (side // clip.patch_size for side in run.pixels.shape[-2:])
    feats, A = fused_features(clip, run.pixels, spec.norm)
    seg = layer_logits(feats[:, 0, 1:], rows, s.logit_scale).reshape(-1, rows.shape[0], h, w).float().softmax(-3)[:, :n]
    if s.window:
        slide = slide_logits(clip, run.pixels.to(clip.device, clip.dtype), rows, s, spec.norm).float().softmax(-3)[:, :n]
        seg = slide * 0.5 + seg * 0.5
    chosen = seg[fuse.layer]  # a view: the threshold below reaches seg's mean too (copied)
    chosen[chosen < chosen.amax((-1, -2), keepdim=True) * fuse.threshold] = 0
    propagated = chosen.flatten(-2) @ A[0].mean(0)[1:, 1:].float()
    return propagated.unflatten(-1, (h, w)) + seg.mean(0), A[0]


def cam_scores(seg: torch.Tensor, final: torch.Tensor, out_size: tuple[int, int], cam: Cam) -> tuple[torch.Tensor, torch.Tensor]:
    """`main_ovs.py` and `cam_to_label` on names x h x w maps with their scores `final`: (names x H x W valid maps,
    H x W background channel: 0, or (1 - max)^2 when B = 0)."""
    pred = F.interpolate(seg[None], size=out_size, mode="bilinear", align_corners=False)[0]
    pred = pred / (pred.amax((-1, -2), keepdim=True) + EPS_MAX) * final[:, None, None]
    if cam.normalize:
        pred = pred - pred.amin((-1, -2), keepdim=True)
        pred = pred / (pred.amax((-1, -2), keepdim=True) + EPS_NORM)
    if cam.background > 0:
        pred = pred.masked_fill(pred < cam.background, 0)
    valid = pred * (final > cam.score)[:, None, None]
    bg = torch.zeros(out_size, dtype=valid.dtype, device=valid.device) if cam.background > 0 else (1 - valid.amax(0)).pow(2)
    return valid, bg


# -- FGC: Stable Diffusion's self-attention refines the map (`fgc:STEP[,SEED]`) ------------------------------------------
SD_HUB = "stabilityai/stable-diffusion-2-1-base"  # stable_diffusion.py, sd_version v2.1 (util/args.py's default)
SD_NAME = "Stable Diffusion 2.1-base (diffusers)"  # what `ls presets` says FGC needs
SD_SIZE, SD_STEPS = 512, 50  # preprocess(img, height=512, width=512); scheduler.set_timesteps(50)
# attention_layers_to_use [-4, -6] of Processor.py's DIFFUSION_LAYERS, concatenated in that order
SD_LAYERS = ("up_blocks.3.attentions.1.transformer_blocks.0.attn1", "up_blocks.3.attentions.0.transformer_blocks.0.attn1")
EPS_SD = 1e-5  # refinement: amax + 1e-5, sum + 1e-5


@dataclasses.dataclass(frozen=True)
class Fgc:
    """`fgc:STEP[,SEED]`: the scheduler step index the latent is noised to (45 of 50) and the noise's seed (the code
    draws it unseeded)."""

    step: int = 45
    seed: int = 0

    @classmethod
    def parse(cls, arg: str) -> "Fgc":
        parts = arg.split(",")
        if len(parts) in (1, 2) and all(p.isdigit() for p in parts) and int(parts[0]) < SD_STEPS:
            return cls(*map(int, parts))
        raise UserValueError(f"bad option fgc:{arg}: write fgc:STEP[,SEED] (0 <= STEP < {SD_STEPS}, the step of {SD_STEPS} the image's latent "
                             "is noised to, CLIPer's 45; SEED >= 0 the noise's, default 0)")

    def __str__(self) -> str:
        return f"{self.step},{self.seed}"


class _Captured(Exception):
    """Raised once the last map is recorded: the rest of the UNet is not needed."""


class _Recorder:
    """Processor.py's `AttnProcessorForCallBack` on one self-attention layer, its softmax the spec's normalizer:
    records the first image's heads x T x T map in `maps[name]`."""

    def __init__(self, maps: dict, name: str, normalizer: Normalizer, last: bool) -> None:
        self.maps, self.name, self.normalizer, self.last = maps, name, normalizer, last

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        query, key, value = (attn.head_to_batch_dim(t) for t in (query, attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)))
        if self.normalizer.kind == "softmax":
            probs = attn.get_attention_scores(query, key, attention_mask)
        else:
            scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * attn.scale
            probs = normalize(scores if attention_mask is None else scores + attention_mask, self.normalizer).to(query.dtype)
        self.maps[self.name] = probs.reshape(-1, attn.heads, *probs.shape[1:])[0]
        if self.last:
            raise _Captured
        hidden_states = attn.batch_to_head_dim(torch.bmm(probs, value))
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


@torch.inference_mode()
def sd_self_attention(pipe, image: np.ndarray, fgc: Fgc, normalizer: str | Normalizer = "softmax") -> torch.Tensor:
    """`diffusion.forward` with the empty prompt on an H x W x 3 uint8 image: the heads of SD_LAYERS' self-attention
    maps, (layers x heads) x T x T (T = 64 x 64 at 512 px), float32. The image is resized to 512 x 512 by the pipeline's
    processor (nearest, aspect not kept), its latent noised to step `fgc.step` with noise from a generator seeded
    `fgc.seed`, one UNet pass, stopped once the maps are read."""
    from diffusers.utils.torch_utils import randn_tensor

    norm = normalizer if isinstance(normalizer, Normalizer) else Normalizer.parse(normalizer)
    device, dtype = pipe.unet.device, pipe.unet.dtype
    img = torch.from_numpy(np.ascontiguousarray(image)).float().permute(2, 0, 1)[None] / 255
    latent = pipe.image_processor.preprocess(img, height=SD_SIZE, width=SD_SIZE).to(device, dtype)
    latent = pipe.vae.encode(latent)[0].mean * pipe.vae.config.scaling_factor
    pipe.scheduler.set_timesteps(SD_STEPS, device=device)
    t = pipe.scheduler.timesteps[fgc.step]
    noise = randn_tensor(latent.shape, generator=torch.Generator().manual_seed(fgc.seed), device=latent.device, dtype=latent.dtype)
    latents = pipe.scheduler.add_noise(latent, noise, t)
    embeds, _ = pipe.encode_prompt("", device, 1, do_classifier_free_guidance=False)
    maps: dict[str, torch.Tensor] = {}
    layers = {name: pipe.unet.get_submodule(name) for name in SD_LAYERS}
    before = {name: layer.processor for name, layer in layers.items()}
    for name, layer in layers.items():
        layer.set_processor(_Recorder(maps, name, norm, last=name == SD_LAYERS[0]))  # attentions[1] runs after [0]
    try:
        pipe.unet(latents, t, encoder_hidden_states=embeds, return_dict=False)
    except _Captured:
        pass
    finally:
        for name, layer in layers.items():
            layer.set_processor(before[name])
    return torch.cat([maps[name] for name in SD_LAYERS]).float()


def fgc_refine(seg: torch.Tensor, maps: torch.Tensor, threshold: float) -> torch.Tensor:
    """`Pipeline.refinement` ('SFSA'): names x h x w resized bilinearly to the maps' g x g grid, then multiplied by the
    chained product of every map (each divided by its column maxima + 1e-5, entries below `threshold` set to 0, rows
    divided by their sums + 1e-5): eye @ S_1 @ ... @ S_n @ seg, applied right to left on the names' columns (the same
    product; the code forms the n - 1 products of T x T maps first). -> names x g x g."""
    g = math.isqrt(maps.shape[-1])
    out = F.interpolate(seg[None].float(), size=(g, g), mode="bilinear", align_corners=False)[0].flatten(-2).T
    for S in reversed(maps):
        S = S / (S.amax(-2, keepdim=True) + EPS_SD)
        S = S.masked_fill(S < threshold, 0)
        out = (S / (S.sum(-1, keepdim=True) + EPS_SD)) @ out
    return out.T.reshape(-1, g, g)


_PIPELINES: dict[str, object] = {}  # str(device) -> the StableDiffusionPipeline FGC runs there


def use_diffusion(pipe, device: torch.device | str = "cpu") -> None:
    """Run FGC on `device` with this diffusers StableDiffusionPipeline (other weights, or a small one in tests)."""
    _PIPELINES[str(torch.device(device))] = pipe


def check_diffusion(device: torch.device | str) -> None:
    """Before any image: diffusers is installed and SD 2.1-base can be had (in the Hugging Face cache, or the Hub
    reachable), else the one-line error; nothing is loaded."""
    if str(torch.device(device)) in _PIPELINES:
        return
    require_extra("diffusers", "CLIPer's FGC (Stable Diffusion 2.1-base's self-attention)", extra="diffusion")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(SD_HUB, "model_index.json"), str):
        offline = hub_unavailable(SD_HUB)
        if offline:
            raise WeightsUnavailableError(_sd_help(f"they are not in the Hugging Face cache and {offline}"))


def _sd_help(why: str) -> str:
    return (f"CLIPer's FGC needs Stable Diffusion 2.1-base ({SD_HUB}): {why}. It is downloaded from the Hugging Face Hub on first "
            "use and then read from its cache ($HF_HOME); offline, copy the cache from a machine that has it, or run the preset "
            "cliper-nofgc (no FGC).")


def diffusion_pipeline(device: torch.device | str):
    """The StableDiffusionPipeline FGC runs on `device` (SD 2.1-base, fp16 on CUDA as published, else fp32), loaded once."""
    key = str(torch.device(device))
    if key not in _PIPELINES:
        diffusers = require_extra("diffusers", "CLIPer's FGC (Stable Diffusion 2.1-base's self-attention)", extra="diffusion")
        dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
        offline = hub_unavailable(SD_HUB)
        try:
            pipe = diffusers.StableDiffusionPipeline.from_pretrained(SD_HUB, torch_dtype=dtype, safety_checker=None, local_files_only=offline is not None)
        except Exception as e:  # not cached offline, or not a pipeline
            why = f"they are not in the Hugging Face cache and {offline}" if offline else (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise WeightsUnavailableError(_sd_help(why)) from None
        pipe.set_progress_bar_config(disable=True)
        _PIPELINES[key] = pipe.to(device)
    return _PIPELINES[key]


# -- the map ----------------------------------------------------------------------------------------------------------
def fused_scores(run: ImageRun, out_size: tuple[int, int] | None = None) -> DenseMap:
    """The fused forward's N_names x H x W map (at `out_size`, default the image's): the background names' channel,
    then the names' valid maps, so that its argmax is `cam_to_label`'s labels. With `fgc`, the map refined by Stable
    Diffusion's self-attention first, each name's score the mean of its maximum before and after (`Pipeline.forward`)."""
    spec = run.spec
    seg, _ = cliper_seg(run)
    final = seg.amax((-1, -2))
    if spec.extra("fgc") is not None:
        maps = sd_self_attention(diffusion_pipeline(run.clip.device), run.image, Fgc.parse(spec.extra("fgc")), spec.norm)
        seg = fgc_refine(seg, maps.to(seg.device), Fuse.parse(spec.extra("fuse")).threshold)
        final = seg.amax((-1, -2)) * 0.5 + final * 0.5
    valid, bg = cam_scores(seg, final, out_size or tuple(run.image.shape[:2]), Cam.parse(spec.extra("cam") or "0.3,0.3"))
    lead = background_arg(spec.extra("bg") or "background")
    lead = lead if isinstance(lead, int) else 0
    return DenseMap(torch.cat([bg.expand(lead, -1, -1), valid]))


class FusedForward(Forward):
    """CLIPer's forward (`fuse:T`, with `cam` and `bg`): see the module docstring. Its pixels are CLIPer's resize
    (PIL bicubic, sides rounded to the nearest patch multiple); with a window, the windows join the whole image."""

    name = FORWARD
    kinds = frozenset()

    def check(self, plan: Plan) -> None:
        check_fused(plan.spec)

    def refusal(self, stage: Stage, plan: Plan) -> str:
        return f"stage {stage.name} cannot run in CLIPer's fused forward (spec {plan.spec})"

    def check_model(self, plan: Plan, clip) -> None:
        depth = len(getattr(getattr(clip.visual, "transformer", None), "resblocks", ()))
        if not hasattr(clip.visual, "conv1") or clip.prefix_tokens != 1:
            raise UserValueError(f"spec {plan.spec}: CLIPer's fused forward runs open_clip ViTs with a CLS token")
        if -Fuse.parse(plan.spec.extra("fuse")).layer > depth:
            raise UserValueError(f"spec {plan.spec}: fuse's layer is past this model's {depth} blocks")
        if plan.spec.extra("fgc") is not None:
            check_diffusion(clip.device)

    def pixels(self, image: np.ndarray, clip, settings: InferenceSettings) -> torch.Tensor:
        H, W = image.shape[:2]
        h, w = cliper_size(H, W, settings.resolution, clip.patch_size)
        rgb = np.asarray(Image.fromarray(np.ascontiguousarray(image)).resize((w, h), Image.BICUBIC), dtype=np.float32) / 255
        mean, std = (torch.tensor(v).view(3, 1, 1) for v in (clip.mean, clip.std))
        return ((torch.from_numpy(rgb).permute(2, 0, 1) - mean) / std)[None]

    def cosine(self, run: ImageRun) -> DenseMap:
        return fused_scores(run, run.out_size)

    @torch.inference_mode()
    def attention(self, run: ImageRun, whole_image: bool = False) -> Iterator[AttentionWindow]:
        """One window over the whole input: the fused map its last input attended with (heads x N x N, CLS first)."""
        H, W = run.pixels.shape[-2:]
        _, A = fused_features(run.clip, run.pixels, run.spec.norm)
        ps = run.clip.patch_size
        yield AttentionWindow((0, H, 0, W), (0, 0, 0, 0), (H // ps, W // ps), A[0].float())


FORWARDS.register(FORWARD, FusedForward(), help="CLIPer: every block's input through the last block with the fused early attention, "
                  "per-layer logits, propagation, cam_to_label's scores (fuse:T, cam, bg)")


# -- presets and protocols -------------------------------------------------------------------------------------------
def _spec(threshold: float, score: float, background: float, norm: bool, bg: int | str, layer: int = -1, fgc: bool = True) -> str:
    cam = Cam(score, background, norm)
    return f"{BASE}/fuse:{Fuse(threshold, layer)}/cam:{cam}/bg:{bg}" + (f"/fgc:{Fgc()}" if fgc else "")


# scripts/config/vit-b-16/*.yaml: (attention_thr, score_threshold, bkg_thre, is_normalize, background, select_layer), the
# logit scale and the sliding crop of the commented-out (or shipped) sliding line; the background words of data/*/cls_*.txt's
# first line (the leading names of the `cliper` class files, or the words the forward embeds on sets without a background class)
B16 = {
    "voc21": ((0.1, 0.7, 0.6, True, 25), 100.0, 336), "context60": ((0.2, 0.45, 0.45, False, 1), 100.0, 224),
    "coco-object": ((0.2, 0.3, 0.3, False, 23), 50.0, 224), "voc20": ((0.1, 0.0, 0.001, False, "voc"), 100.0, 336),
    "context59": ((0.2, 0.3, 0.3, False, "background"), 100.0, 224), "coco-stuff": ((0.2, 0.1, 0.1, False, "background"), 50.0, 224),
    "ade20k": ((0.2, 0.3, 0.3, False, "background"), 100.0, 224), "cityscapes": ((0.35, 0.0, 0.0001, False, "background"), 100.0, 224),
}  # fmt: skip
# scripts/config/vit-l-14/*.yaml, the same fields
L14 = {
    "voc21": ((0.1, 0.5, 0.4, True, 25, -2), 50.0, 336), "context60": ((0.2, 0.3, 0.3, False, 1, -2), 50.0, 224),
    "coco-object": ((0.1, 0.5, 0.5, False, 23, -2), 50.0, 224), "voc20": ((0.2, 0.1, 0.0001, False, "voc"), 70.0, 336),
    "context59": ((0.2, 0.45, 0.45, False, "background", -2), 100.0, 224), "coco-stuff": ((0.2, 0.2, 0.2, False, "background", -2), 50.0, 224),
    "ade20k": ((0.2, 0.2, 0.2, False, "background"), 50.0, 224), "cityscapes": ((0.35, 0.0, 0.0001, False, "background"), 100.0, 224),
}  # fmt: skip
RESOLUTION = {"B16": {"cityscapes": 560}, "L14": {"cityscapes": 448}}  # size: 336, Cityscapes 560 (L/14 448)
# semantic_templates: template/car_template.txt (15 sentences, shipped as data/templates/cliper_car.txt) or
# openai_template.txt (the 80 OpenAI ImageNet templates, the engine's `openai`)
CAR_TEMPLATES = str(Path(__file__).resolve().parent.parent / "data" / "templates" / "cliper_car.txt")
TEMPLATES = {
    "B16": {"coco-object": "openai", "cityscapes": "openai"},  # else car
    "L14": {"context60": "openai", "coco-object": "openai", "coco-stuff": "openai", "ade20k": "openai"},
}

CLIPER = _spec(*B16["ade20k"][0])
NOFGC = _spec(*B16["ade20k"][0], fgc=False)
CLIPER_NOTES = (
    "copied: blocks 1..11 as they are, each head's softmax(s q k^T) over CLS + patches summed over them (M); the last "
    "block run on ln_1 of every block's input (ln_1 of the last block applied again: a double LayerNorm) and on x_11, "
    "each as out_proj(A V), CLS kept, no residual or FFN, ln_post, proj; A = M divided by its column sums, then its row "
    "sums, in place (input k sees k + 1 such passes), symmetrised, minus each column's mean, clamped at 0, rows "
    "normalised; per layer softmax(logit_scale cos) over the names, the background words and the normalised mean of "
    "the names, names kept; with a window, 224 or 336 windows at stride 112: their logits averaged and propagated by "
    "their head-mean maps placed on the image's grid (1e-5 added to the overlap count, rows normalised), softmaxed, "
    "half and half with the whole image's; the chosen layer (-1; some L/14 sets -2) thresholded at attention_thr x its "
    "class maximum in place (so the layer mean sees the threshold too), propagated by the head-mean of the last input's "
    "A (p @ A), plus the mean of the 12 layers; FGC: the image resized to 512 x 512 by diffusers' processor (nearest, "
    "aspect not kept), its SD 2.1-base latent noised to step 45 of 50, one UNet pass with the empty prompt, the self-"
    "attention maps of up_blocks[3].attentions[1] and [0] (every head), each divided by its column maxima + 1e-5, "
    "entries below attention_thr 0, rows divided by their sums + 1e-5, their chained product applied to the map "
    "resized bilinearly to 64 x 64; each name's score the mean of its maximum before and after; resized bilinearly "
    "to the image, divided by its maximum + 1e-5 and times its score; cam_to_label: names whose score is <= "
    "score_threshold dropped, min-max normalised (VOC21), below bkg_thre 0, argmax or background; the short side "
    "resized to 336 (Cityscapes 560) with PIL's bicubic, each side rounded to the nearest multiple of 16; positional "
    "embeddings resized bilinearly and rounded to fp16; logit scale 100 (COCO-Object and COCO-Stuff 50); the names "
    "embedded with the configs' templates (B/16: the 15 car_template.txt sentences, COCO-Object and Cityscapes the 80 "
    "OpenAI ones; L/14 per its configs); "
    "fixed: FGC's noise is drawn from a generator seeded by fgc's SEED (0; the code's randn_tensor is unseeded, so its "
    "numbers vary run to run); the chained product is applied right to left to the map's columns (the same product, "
    "without the code's 4096 x 4096 intermediate products) and the UNet stops once the two maps are read; a pixel "
    "whose names all score 0 on a set without a background class is the first class here (the code's label 0, scored "
    "wrong); a line with commas (VOC21's `person with clothes, people, human`) is three names here, one prompt there; "
    "not copied: fp16 for CLIP on GPU (SD runs fp16 on CUDA as published, fp32 elsewhere)"
)
register_preset(
    "cliper",
    CLIPER,
    "CLIPer (ICCV 2025), ViT-B/16: every block's input through the last block with the fused attention of blocks "
    "1..11, per-layer logits, the last layer's propagated, refined by Stable Diffusion 2.1-base's self-attention (FGC, "
    "needs diffusers; ADE20K's constants: the cliper protocols set each dataset's)",
    CLIPER_NOTES,
)
register_entmax_variant("cliper")
register_preset(
    "cliper-nofgc",
    NOFGC,
    "CLIPer (ICCV 2025) without FGC (the README's values in parentheses), ViT-B/16: cliper without the Stable "
    "Diffusion refinement",
    CLIPER_NOTES,
)
register_entmax_variant("cliper-nofgc")

SOURCE = "linsun449/cliper.code@c05fa41 scripts/config/{}/*.yaml, modified_clip/model.py, ovs/, diffusion_model/, util/miou.py"


def _protocol(name: str, preset: str, table: dict, resolution: dict, templates: dict, sliding: bool, help: str, model: str | None = None) -> Protocol:
    per_dataset = {ds: dict(logit_scale=scale, window=crop if sliding else 0) for ds, (_, scale, crop) in table.items()}
    for ds, side in resolution.items():
        per_dataset[ds]["resolution"] = side
    fgc = preset == "cliper"
    protocol = Protocol(
        name=name,
        attention=preset,
        class_names="cliper",
        source=SOURCE.format("vit-l-14" if model else "vit-b-16"),
        defaults=dict(resolution=336, window=0, stride=112, logit_scale=100.0),
        per_dataset=per_dataset,
        attention_per_dataset={ds: _spec(*c, fgc=fgc) for ds, (c, _, _) in table.items()},
        model=model,
        pretrained="openai" if model else None,
        templates=CAR_TEMPLATES,
        templates_per_dataset=templates,
    )
    return PROTOCOLS.register(name, protocol, help=help)


# name -> (preset, table, resolutions, sliding, model, README row with FGC, without (in parentheses)); README order: VOC,
# Context, Object, VOC20, Context59, Stuff, ADE, City (B16's keys)
_ROWS = {
    "B16": ((66.4, 37.5, 39.2, 85.5, 41.6, 27.6, 21.5, 37.0), (60.7, 34.7, 36.3, 84.3, 38.4, 25.4, 19.8, 35.9)),
    "B16*": ((66.5, 38.3, 40.0, 86.0, 42.4, 28.6, 22.0, 38.7), (62.1, 35.7, 37.5, 85.0, 39.6, 26.4, 20.6, 38.3)),
    "L14": ((71.6, 39.0, 44.4, 90.3, 44.0, 29.7, 24.5, 41.6), (62.5, 34.8, 40.4, 88.7, 39.6, 26.3, 22.1, 37.9)),
    "L14*": ((72.2, 39.5, 44.7, 89.8, 44.6, 30.4, 25.0, 42.5), (64.0, 35.7, 41.4, 89.0, 40.9, 27.1, 22.9, 39.4)),
}  # fmt: skip
# the README prints no average: these are its cells' (B/16 44.5, sliding 45.3, L/14 48.1 / 48.6; without FGC 41.9)
_AVERAGES = {"B16": (44.5, 41.9), "B16*": (45.3, 43.2), "L14": (48.1, 44.0), "L14*": (48.6, 45.1)}
_README = "linsun449/cliper.code@c05fa41 ReadMe.md (Results)"
_NOTE = "VOC21's comma line is three names here; FGC's noise seeded; CLIP in fp32"
PROTOCOL_OF: dict[tuple[str, str], Protocol] = {}
for row, (table, model) in {"B16": (B16, None), "B16*": (B16, None), "L14": (L14, "ViT-L-14"), "L14*": (L14, "ViT-L-14")}.items():
    res, templates = RESOLUTION[row[:3]], TEMPLATES[row[:3]]
    sliding = row.endswith("*")
    suffix = ("-l14" if model else "") + ("-sliding" if sliding else "")
    what = f"ViT-{'L/14 (OpenAI)' if model else 'B/16'}, whole image" + (" and 224 windows (VOC 336) at stride 112, half and half" if sliding else "")
    for i, preset in enumerate(("cliper", "cliper-nofgc")):
        protocol = _protocol(preset + suffix, preset, table, res, templates, sliding, f"CLIPer{' without FGC' if i else ''}, {what}: short side 336 "
                             f"(Cityscapes {res['cityscapes']}), its per-dataset thresholds and logit scales", model=model)
        PROTOCOL_OF[preset, row] = protocol
        register_published(protocol, dict(zip(B16, _ROWS[row][i])), f"{_README}, row ViT-{row[0]}/{row[1:3]}{row[3:]}"
                           + (" (values in parentheses: without FGC)" if i else ""), note=_NOTE, printed_average=_AVERAGES[row][i])
PROTOCOL = PROTOCOL_OF["cliper", "B16"]
