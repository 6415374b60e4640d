"""DiH-CLIP (ICCV 2025): SC-CLIP without outlier repair, its attention applied through a few selected heads.

Read from duan-song/DiH-CLIP@775b609 (`clip/model.py`: `VisionTransformer.forward`, `custom_attn`,
`vanilla_attn`, `adaptively_aggregate`; `clip_segmentor.py`; `configs/cfg_*.py`). In the engine's axes it is
`scclip` (`methods/scclip.py`) without the `lof` stage, with:

- the option `heads:K,D` (`ExtraOption.values`): the K heads whose attention map has the lowest entropy
  (-sum p log2(p + 1e-6) over the whole N x N map) are kept, and each kept head's map multiplies *every*
  head's values (each token's full C-d value, not its own d-d slice); the products are summed and divided by
  D (4 heads, / 12 in the last block and in the multi-level branch, which selects from its own maps);
- the mid map and the input aggregation read the tap `sha@9:4`: the hidden state after block 9 plus block 9's
  "SHA" output, out_proj(sum over the 4 heads of lowest qk-map entropy of softmax(kk) x all values), summed,
  not divided (the code keeps x_9 + SHA_9 aside; the residual stream goes on without it).

The released segmentor does not run: `clip_segmentor.py:70` unpacks two values from `encode_image`, which returns
one (fix: take the one), `prompts/` and `eval.py` are not in the repository (SCLIP's 80 templates and
evaluation, which its configs follow), `demo.py` imports a renamed module. What is implemented is what the code
means with those fixed. Normalizer slots: softmax(mid) and softmax(kk) of the last block (main and branch);
`dihclip-entmax` puts entmax:1.5 there. SHA_9's two softmaxes build block 9's features (a feature tap has no
normalizer slot) and stay softmax. Quirks copied and fixed: `DIHCLIP_NOTES` (docs/datasets.md, Presets). Grid:
`sweeps/grids/dihclip.toml`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..attention.contract import positive_attention
from ..attention.presets import register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..attention.taps import TAPS, BlockContext, Tap, block_qkv
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS
from ..evaluation.published import register_published
from ..attention.terms import fmt_num
from . import scclip

TOP_HEADS, LAST_DIVISOR = 4, 12  # model.py: topk_SHA 4; custom_attn divides by num_heads


# -- head selection ---------------------------------------------------------------------------------------------
def lowest_entropy_heads(maps: torch.Tensor, top: int) -> torch.Tensor:
    """B x H boolean: the heads of B x H x N x N maps whose entropy -sum p log2(p + 1e-6) over the whole map is
    among the `top` lowest values (DiH-CLIP's `metrics[i] in sorted_metrics`: ties at the last value all kept)."""
    p = maps.float().flatten(2)
    entropy = -(p * torch.log2(p + 1e-6)).sum(-1)
    kth = entropy.sort(dim=-1).values[:, min(top, entropy.shape[-1]) - 1 :][:, :1]
    return entropy <= kth


def full_value_heads(maps: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, divisor: float) -> torch.Tensor:
    """sum over kept heads h of maps[h] @ V_full / divisor, where V_full (B x N x H*d) is every token's value with
    all heads concatenated; returned in the B x H x N x d layout whose heads out_proj concatenates back."""
    B, H, N, d = v.shape
    summed = (maps * keep[..., None, None].to(maps.dtype)).sum(1)
    full = v.transpose(1, 2).reshape(B, N, H * d)
    out = summed.to(full.dtype) @ full
    return (out / divisor if divisor != 1 else out).reshape(B, N, H, d).transpose(1, 2)


def _heads_arg(arg: str) -> tuple[int, float]:
    top, comma, divisor = arg.partition(",")
    try:
        if top.isdigit() and int(top) >= 1 and comma and float(divisor) > 0:
            return int(top), float(divisor)
    except ValueError:
        pass
    raise UserValueError(f"bad option heads:{arg}: write heads:K,D (the K lowest-entropy heads on every head's values, sum / D)")


register_option(
    "heads",
    lambda arg: "{},{}".format(_heads_arg(arg)[0], fmt_num(_heads_arg(arg)[1])),
    help="heads:K,D (DiH-CLIP: the K heads whose attention has the lowest entropy, each applied to all heads' values, sum / D)",
    values=lambda arg, weights, v: full_value_heads(weights, v, lowest_entropy_heads(weights, _heads_arg(arg)[0]), _heads_arg(arg)[1]),
)


# -- block L's output plus its SHA output -------------------------------------------------------------------------
def _sha_arg(arg: str) -> tuple[int, int]:
    layer, colon, top = arg.partition(":")
    if layer.isdigit() and int(layer) >= 2 and (not colon or (top.isdigit() and int(top) >= 1)):
        return int(layer), int(top) if colon else TOP_HEADS
    raise UserValueError(f"tap sha@{arg}: write sha@L[:K] (block L >= 2 plus its K lowest-entropy heads on all values)")


def sha_state(ctx: BlockContext, arg: str) -> torch.Tensor:
    """B x N x C: x_L + out_proj(sum over the K heads of lowest qk-map entropy of softmax(kk) @ V_full), q/k/v from
    ln_1 of x_{L-1} with block L's weights (`vanilla_attn`), over the attended tokens."""
    layer, top = _sha_arg(arg)
    block = ctx.blocks[layer - 1]
    attn = positive_attention(block.attn)
    if not isinstance(attn, torch.nn.MultiheadAttention):
        raise UserValueError(f"tap sha@{arg} reads open_clip's nn.MultiheadAttention blocks")
    q, k, v = block_qkv(block, block.ln_1(ctx.hidden[layer - 1]), ctx.grid)
    scale = q.shape[-1] ** -0.5
    keep = lowest_entropy_heads(torch.softmax((q @ k.transpose(-2, -1)).float() * scale, dim=-1), top)
    kk = torch.softmax((k @ k.transpose(-2, -1)).float() * scale, dim=-1)
    out = full_value_heads(kk, v.float(), keep, 1)
    B, H, N, d = out.shape
    sha = attn.out_proj(out.transpose(1, 2).reshape(B, N, H * d).to(v.dtype))
    return (ctx.hidden[layer] + sha)[:, ctx.offset :]


TAPS.register(
    "sha",
    Tap(
        features=lambda ctx, arg: (sha_state(ctx, arg)[:, None],) * 2,
        check=lambda arg: _sha_arg(arg) and None,
        hidden=lambda arg: {_sha_arg(arg)[0] - 1, _sha_arg(arg)[0]},
    ),
    help="sha@L[:K] (hidden state after block L plus DiH-CLIP's SHA output of block L, K heads, default 4)",
)


# -- presets and protocol ---------------------------------------------------------------------------------------
DIHCLIP = (
    f"sha@9:{TOP_HEADS}[cos,shift:1,scale:3,pos]+kk/softmax/cls:0.3/noffn/avg/aggin:sha@9:{TOP_HEADS}[cos,thresh:0.4]"
    f"/aggout:x@4[cos,thresh:0.4]/in:sum@4-10/heads:{TOP_HEADS},{LAST_DIVISOR}"
)
DIHCLIP_NOTES = (
    "copied: no outlier repair; block 9's SHA output (the 4 heads whose qk map has the lowest entropy over the "
    "whole map, their softmax(kk) maps each applied to all heads' values, summed, out_proj with bias) added to "
    "x_9 for the mid map and the input aggregation only; in the last block (and the multi-level branch, from its "
    "own maps) the 4 heads of lowest entropy of (softmax(mid) + softmax(kk)) / 2 applied to all heads' values, "
    "summed and divided by 12; the rest as SC-CLIP (mid map mean over the whole map, '< 0.4 -> 0' aggregation, "
    "residual 0.3 x CLS); fixed: the segmentor's unpacking of encode_image (l.70), SCLIP's templates and eval "
    "for the missing prompts/ and eval.py, the mid-map mean and head entropies per window (the code runs batch "
    "1); not copied: SHA computed in blocks 1-8, 10, 11 (never read), the unused agg_conv, fp16 on GPU"
)
register_preset(
    "dihclip",
    DIHCLIP,
    "DiH-CLIP (ICCV 2025), ViT-B/16: SC-CLIP without LOF, mid map from block 9 plus its selected-head output, the "
    "4 lowest-entropy heads of the last block applied to all heads' values (/ 12)",
    DIHCLIP_NOTES,
)
register_entmax_variant("dihclip")

# configs/cfg_*.py are SC-CLIP's (336 short side, Cityscapes 560, 224/112 windows, VOC21 logit 50 / 0.15 / 0.1,
# Context60 0.15, COCO-Object 55 / 0.35, PAMR off) and its class files are SCLIP's.
PROTOCOL = PROTOCOLS.register(
    "dihclip",
    dataclasses.replace(
        scclip.PROTOCOL, name="dihclip", attention="dihclip", source="duan-song/DiH-CLIP@775b609 configs/cfg_*.py, clip_segmentor.py"
    ),
    help="DiH-CLIP (ICCV 2025): SC-CLIP's settings",
)

# Reported mIoU, OpenAI CLIP ViT-B/16 (the repository's img/results.png, the paper's Table 1). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 64.2, "context60": 36.0, "coco-object": 37.4, "voc20": 84.9, "context59": 39.7,
     "coco-stuff": 26.7, "cityscapes": 40.2, "ade20k": 19.6},
    "duan-song/DiH-CLIP@775b609 img/results.png (paper Table 1)",
    printed_average=43.6,
)  # fmt: skip
