"""Plain-torch transcriptions of the code the SCLIP line of repositories shares verbatim, for the tests of SFP,
DiH-CLIP, CASS, RF-CLIP and GLA-CLIP (each test file holds its method's own transcription), and the engine's side
of the same pipeline.

Transcribed (batch 1, tokens N x C, CLS at row 0) from Kimsure/SFP@2804f5b `SFP_ICCV/clip/model.py`
(`interpolate_pos_encoding`, the block forward) and `SFP_ICCV/SFP_segmentor.py` (`forward_slide`,
`postprocess_result`), which SCLIP, DiH-CLIP, CASS and RF-CLIP carry unchanged; the DINO helpers from
facebookresearch/dino `vision_transformer.py` (`prepare_tokens`, `interpolate_pos_encoding`, `get_intermediate_*`).
A model's blocks are read through `ln_1`, `attn.in_proj_*`, `attn.out_proj`, `ln_2`, `mlp` only.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from conftest import window_run


def sclip_pos_embed(visual, rows: int, cols: int) -> torch.Tensor:
    """`interpolate_pos_encoding`: bicubic with scale factor ((rows + 0.1) / sqrt(N), (cols + 0.1) / sqrt(N))."""
    pos = visual.positional_embedding
    N = pos.shape[0] - 1
    if rows * cols == N and rows == cols:
        return pos
    side, dim = int(math.sqrt(N)), pos.shape[-1]
    patch = F.interpolate(pos[1:].reshape(1, side, side, dim).permute(0, 3, 1, 2),
                          scale_factor=((rows + 0.1) / math.sqrt(N), (cols + 0.1) / math.sqrt(N)), mode="bicubic")
    return torch.cat([pos[:1], patch.permute(0, 2, 3, 1).reshape(-1, dim)], dim=0)


def embed(visual, img: torch.Tensor):
    """conv1, CLS, positional embedding (interpolated only when the token count differs), ln_pre: (x N x C, rows, cols)."""
    x = visual.conv1(img)
    rows, cols = x.shape[-2:]
    x = torch.cat([visual.class_embedding.view(1, -1).to(x.dtype), x.reshape(x.shape[1], -1).T], dim=0)
    pos = visual.positional_embedding if x.shape[0] == visual.positional_embedding.shape[0] else sclip_pos_embed(visual, rows, cols)
    return visual.ln_pre(x + pos.to(x.dtype)), rows, cols


def heads(attn, u: torch.Tensor):
    """q, k, v per head (H x N x d) of an nn.MultiheadAttention on an ln_1 state u (N x C)."""
    N, C = u.shape
    H = attn.num_heads
    q, k, v = F.linear(u, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    return [t.reshape(N, H, C // H).transpose(0, 1) for t in (q, k, v)]


def merge(attn, o: torch.Tensor) -> torch.Tensor:
    """H x N x d head outputs -> out_proj (N x C)."""
    H, N, d = o.shape
    return attn.out_proj(o.transpose(0, 1).reshape(N, H * d))


def block(blk, x: torch.Tensor, want: bool = False):
    """An ordinary block; with `want` also its per-head softmax(q k^T / sqrt(d)) map (need_weights=True,
    average_attn_weights=False)."""
    q, k, v = heads(blk.attn, blk.ln_1(x))
    a = torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(1, 2), dim=-1)
    x = x + merge(blk.attn, a @ v)
    x = x + blk.mlp(blk.ln_2(x))
    return (x, a) if want else x


def slide_inference(forward_feature, img: torch.Tensor, crop: int = 224, stride: int = 112) -> torch.Tensor:
    """`forward_slide` before its final resize: windows shifted back inside, logits summed / counted."""
    _, _, h_img, w_img = img.shape
    h_grids = max(h_img - crop + stride - 1, 0) // stride + 1
    w_grids = max(w_img - crop + stride - 1, 0) // stride + 1
    preds, count = None, img.new_zeros((1, 1, h_img, w_img))
    for hi in range(h_grids):
        for wi in range(w_grids):
            y1, x1 = hi * stride, wi * stride
            y2, x2 = min(y1 + crop, h_img), min(x1 + crop, w_img)
            y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
            logit = forward_feature(img[:, :, y1:y2, x1:x2])
            if preds is None:
                preds = img.new_zeros((1, logit.shape[1], h_img, w_img))
            preds += F.pad(logit, (int(x1), int(w_img - x2), int(y1), int(h_img - y2)))
            count[:, :, y1:y2, x1:x2] += 1
    return preds / count


def sclip_postprocess(seg_logits: torch.Tensor, query_idx, logit_scale: float, prob_thd: float = 0.0, area_thd=None):
    """`postprocess_result` (batch 1): x logit scale, softmax over names, max over synonyms, area_thd, prob_thd.
    Returns (class probabilities C x H x W, labels H x W)."""
    seg = (seg_logits * logit_scale).softmax(0)
    qi = torch.tensor(query_idx)
    num_cls, num_q = int(qi.max()) + 1, len(query_idx)
    if num_cls != num_q:
        seg = (seg.unsqueeze(0) * F.one_hot(qi).T.view(num_cls, num_q, 1, 1)).max(1)[0]
    if area_thd is not None:
        pred = F.one_hot(seg.argmax(0), num_cls).to(seg.dtype)
        area = pred[:, :, 1:].sum((0, 1), keepdim=True)
        seg[1:] *= (area > area_thd * area.sum()).to(seg.dtype).transpose(0, -1)
    pred = seg.argmax(0, keepdim=True)
    pred[seg.max(0, keepdim=True)[0] < prob_thd] = 0
    return seg, pred[0]


def window_logits(feats: torch.Tensor, text: torch.Tensor, crop: torch.Tensor, patch: int = 16) -> torch.Tensor:
    """`forward_feature`'s tail: L2-normalised hw x D features against the text, bilinear to the crop: 1 x Q x H x W."""
    logits = F.normalize(feats, dim=-1) @ text.T
    logits = logits.T.reshape(1, -1, crop.shape[-2] // patch, crop.shape[-1] // patch)
    return F.interpolate(logits, size=crop.shape[-2:], mode="bilinear", align_corners=False)


def structured(n: int, size: tuple[int, int], seed: int) -> torch.Tensor:
    """Smooth regions plus noise, so the thresholds, aggregations and outlier repairs matter on random weights."""
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.randn(n, 3, 4, 4, generator=g), size=size, mode="bilinear") + 0.3 * torch.randn(n, 3, *size, generator=g)


# -- DINO (facebookresearch/dino vision_transformer.py) on a timm ViT ----------------------------------------------
def dino_pos_embed(dino, rows: int, cols: int) -> torch.Tensor:
    pos = dino.pos_embed
    N = pos.shape[1] - 1
    if rows * cols == N and rows == cols:
        return pos
    side, dim = int(math.sqrt(N)), pos.shape[-1]
    patch = F.interpolate(pos[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2),
                          scale_factor=((rows + 0.1) / math.sqrt(N), (cols + 0.1) / math.sqrt(N)), mode="bicubic")
    return torch.cat([pos[:, :1], patch.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)


def dino_tokens(dino, img: torch.Tensor) -> torch.Tensor:
    """`prepare_tokens` then every block but the last: B x (1 + N) x D."""
    x = dino.patch_embed.proj(img)
    rows, cols = x.shape[-2:]
    x = torch.cat([dino.cls_token.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)], dim=1)
    x = x + dino_pos_embed(dino, rows, cols)
    for blk in dino.blocks[:-1]:
        x = blk(x)
    return x


def dino_last_qkv(dino, img: torch.Tensor) -> torch.Tensor:
    """`get_intermediate_feat`: the last block's qkv, 3 x B x H x N x d."""
    x = dino_tokens(dino, img)
    blk = dino.blocks[-1]
    B, N, C = x.shape
    return blk.attn.qkv(blk.norm1(x)).reshape(B, N, 3, blk.attn.num_heads, -1).permute(2, 0, 3, 1, 4)


def dino_last_features(dino, img: torch.Tensor) -> torch.Tensor:
    """`get_intermediate_layers(x)[0]`: the last block's output after the final norm, B x (1 + N) x D."""
    return dino.norm(dino.blocks[-1](dino_tokens(dino, img)))


# -- the engine's side ---------------------------------------------------------------------------------------------
def engine_pipeline(clip, pixels, spec, text, name_to_class, out_size, logit_scale=40.0, bg_threshold=0.0,
                    area_threshold=0.0, **settings):
    """The engine's cosine (N x H x W at `out_size`), class probabilities (C x H x W, as results save them) and
    labels of CLIP-normalised pixels, with the SCLIP line's window rules (224 / 112, the patch convolution's
    remainder, the (n + 0.1) positional rule) unless `settings` say otherwise."""
    from clipseg_sparse.segment.labels import ClassMaps
    from clipseg_sparse.segment.windows import dense_cosine

    rules = dict(window=224, stride=112, remainder="drop", pos_interp="scale", logit_scale=logit_scale)
    run = window_run(clip, pixels, spec, text, **{**rules, **settings})
    with torch.inference_mode():
        cos = dense_cosine(run, out_size)
        maps = ClassMaps(cos, name_to_class, max(name_to_class) + 1, logit_scale, area_threshold=area_threshold)
        probs = np.concatenate([band for _, _, band in maps.numpy_bands()], axis=1)
        return cos.rows(0, out_size[0]), torch.from_numpy(probs), torch.from_numpy(maps.labels(bg_threshold, area_threshold))


def labels_off_ties(probs: torch.Tensor, gap: float = 1e-3) -> torch.Tensor:
    """H x W: True where the two largest class probabilities differ by more than `gap` (a label is not a near-tie)."""
    top2 = probs.topk(2, dim=0).values
    return (top2[0] - top2[1]) > gap
