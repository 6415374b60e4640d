"""OV-Stitcher (CVPR 2026 Findings, arXiv 2604.08110) as presets of the attention engine.

Read from atw617/OV-Stitcher@91a9489 (`ov_stitcher_segmentor.py`: `forward_feature`, `get_windowed_imgs`,
`stitch_features_from_batch`, `postprocess_result`, `generate_category_embeddings`; `open_clip/transformer.py`:
`VisionTransformer.forward`) and its configs @2bb6586 (`configs/base_config.py`, `configs/cfg_*.py`);
research/peers-2026.md 2.1. OV-Stitcher is CorrCLIP (`methods/corrclip.py`) with the windows stitched into
image-wide attention. In the engine's axes: `stitch:56` (windows zero-padded centred to a multiple of 56,
stitched onto the image grid: the forward `stitched` below; `attention/stitched.py`); `ext:dino_vitb8.out[cos,scale:4,
region:0.2]`, the scope of the last block built once per image from DINO ViT-B/8's last block re-run over the
stitched image (cosine x tau 4, CorrCLIP's region scope after DBSCAN merging, eps 0.2), one map for all
heads, the spec's normalizer; `cls:0/noffn` W_o(A V); `in:mean@6-10` the spatial branch (blocks 6..10 re-run
over the stitched image, mean, weight 1.0; ViT-L/14: blocks 11..22, the code's NUM_SPATIAL 12); `mct:0.5` the
semantic branch (mask class tokens per window, stitched, weight 0.5); the map correction is CorrCLIP's
`regionvote` labels stage, which the `ovstitcher` protocol turns on. Per-class description prompts (the
code's `class_biased_template.json`) are `--prompts FILE`, for any preset. Quirks: `OVSTITCHER_NOTES`.

The stitched forward (registered as `stitched`; `get_windowed_imgs`, `stitch_features_from_batch`,
`forward_feature`, `VisionTransformer.forward`): a spec with `stitch:M` runs its windows as usual (mmseg's sliding windows, each zero-padded centred to a
multiple of M), then puts their tokens on the image-wide grid (`StitchLayout.stitch`: padded patches dropped,
window corner at (y1 // patch, x1 // patch), overlaps averaged) and runs these steps over the whole image:

- the proxy (`ext:NAME.out`): its last block re-run on the stitched q, k, v and penultimate tokens
  (per head softmax(scale q k^T) v, residual from the penultimate tokens after the final norm, MLP),
  L2-normalised: the features of the scope;
- the `in:` blocks (spatial branch): each re-run on the stitched inputs and q, k, v of the windows;
- the last block: one region-scoped map over the proxy grid (the term's scale and `region:EPS` support,
  the spec's normalizer), applied to the stitched last-block values and to the spatial branch's, W_o(A V);
- `mct:BETA`: the mask class tokens run per window (`attention/scope.py`), painted on each window's proxy
  grid and stitched.

Every image-wide attention is computed a block of rows at a time (`attention/stitched.py`).

Quirks copied: the floor-division placement (a window corner that is not on the patch grid, e.g. the last
column shifted back to x1 = W - window, is placed up to patch - 1 pixels off); the proxy block's residual is
the penultimate tokens after DINO's final norm (what `get_intermediate_layers(n=2)[0]` gives), with no layer
scale; the spatial blocks attend with all heads as one (q k^T over all C channels, scale head_dim^-1/2; the
mask the code adds there is all zeros); the region map is resized nearest to the proxy grid, merged there,
and that merged map (resized nearest to the input, cropped like the windows, resized nearest to each
window's CLIP grid) gives the mask class tokens. Fixed: unsegmented = id -1 (the code takes each image's
smallest id), padded window pixels are unsegmented (the code pads the masks with 0, which is its unsegmented
id when the map's minimum is 0); a padded window keeps (y2 - y1) // patch rows on both grids (the code's
DINO stitch keeps ceil(padded / 8) - ceil(pad / 8) per side, and fails its coverage assert where the two differ);
fp32 (the code: fp16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec, stitch_multiple
from ..attention.grid import merge_regions, region_rows_support, resize_regions, values_to_grid
from ..attention.normalizers import normalize
from ..attention.presets import register_entmax_variant, register_preset
from ..attention.scope import mask_class_tokens, mct_step, semantic_tokens, semantic_weight
from ..attention.stitched import blocked_attention, global_attention
from ..attention.taps import run_block
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..models.proxies import split_ext
from ..segment.maps import CosineMap, grid_cosine
from ..segment.plan import FORWARDS, AttentionWindow, Forward, ImageRun, Plan
from ..segment.preprocess import window_boxes, window_padding
from ..segment.windows import GridSum
from ..stages import Stage
from . import corrclip

OVSTITCHER = "ext:dino_vitb8.out[cos,scale:{tau},region:0.2]/softmax/cls:0/noffn/in:mean@{first}-{last}/mct:0.5/stitch:56"

OVSTITCHER_NOTES = (
    "copied: mmseg's sliding windows, each zero-padded centred to a multiple of 56; tokens stitched onto the image "
    "grid with the window corner at (y1 // patch, x1 // patch) (floor: the last row/column of windows, shifted back "
    "to H - window, lands up to patch - 1 pixels off), padded patches dropped, overlaps averaged; DINO ViT-B/8's "
    "last-block q, k, v and penultimate tokens (after DINO's final norm) stitched, its last block re-run over the "
    "image (per head softmax(q k^T / 8) v, residual from those normed penultimate tokens, proj, MLP), L2-normalised; "
    "the region map resized nearest to that grid, merged there (DBSCAN eps 0.2 on region means), scope = same merged "
    "region, or either token unsegmented and S > mean(S) over the image; softmax(4 S) one N x N map for all heads; "
    "blocks 6..10 (ViT-L/14: 11..22) re-run over the image from the stitched inputs and q, k, v with all heads as one "
    "(q k^T over all channels x head_dim^-1/2), residual and MLP, mean = the spatial branch; last block: the "
    "stitched windows' values and the spatial branch's values, bilinear to the DINO grid, W_o(A V); mask class "
    "tokens per window from the merged map (resized nearest to the input, cropped, resized to the window's CLIP "
    "grid), their last-block outputs painted on each window's DINO grid and stitched; ln_post on each branch, "
    "weights 1.0 / 0.5; cosine on the DINO grid, bilinear to the network input, then to the original size; "
    "logit scale 40, prob_thd per dataset, the map correction (regionvote) on the original regions; "
    "fixed: unsegmented = id -1 (the code: each image's smallest id); padded window pixels unsegmented; a padded "
    "window keeps (y2 - y1) // patch cells on both grids (the code's DINO stitch fails its coverage assert where its "
    "count differs); "
    "every image-wide attention a block of rows at a time (the code holds the whole N x N map: 2.3 GB fp16 at "
    "560 x 1120); fp32 (the code: fp16); "
    "not copied: the paper's MetaCLIP rows need --model ViT-B-16-quickgelu --pretrained metaclip_fullcc (the "
    "default CLIP is OpenAI's); its class files ('; '-separated); its prompt file is given with --prompts"
)

for _name, _first, _last, _what in (("ovstitcher", 6, 10, "ViT-B/16 block indices"), ("ovstitcher-l14", 11, 22, "ViT-L/14 block indices")):
    register_preset(
        _name,
        OVSTITCHER.format(tau=4, first=_first, last=_last),
        f"OV-Stitcher (CVPR 2026 Findings), {_what}: CorrCLIP with the windows stitched into image-wide attention "
        f"(DINO ViT-B/8's last block re-run over the image for the region-scoped map, blocks {_first}..{_last} re-run "
        f"over the image for the spatial branch); needs region masks (--regions)",
        OVSTITCHER_NOTES,
    )
    register_entmax_variant(_name)


# configs/cfg_*.py @2bb6586: short side 448 (Cityscapes 560), long side <= 2048, 336/112 windows (Cityscapes
# 224/112, COCO-Stuff 336/224), prob_thd 0.1 (VOC21, Context60), 0.2 (COCO-Object), else 0; logit scale 40 (the segmentor's
# default); mmseg's Resize (cv2 on uint8) and the (n + 0.1) / native positional-embedding scale of its open_clip
# fork; the map correction after the labels; region masks from --regions.
PROTOCOL = PROTOCOLS.register(
    "ovstitcher",
    Protocol(
        name="ovstitcher",
        attention="ovstitcher",
        class_names=corrclip.PROTOCOL.class_names,
        source="atw617/OV-Stitcher@2bb6586 configs/base_config.py, configs/cfg_*.py; @91a9489 ov_stitcher_segmentor.py",
        defaults=dict(resolution=448, window=336, stride=112, logit_scale=40.0, resize="opencv", pos_interp="scale", stages=("regionvote",)),
        per_dataset={
            "cityscapes": dict(resolution=560, window=224),
            "coco-stuff": dict(stride=224),
            "voc21": dict(bg_threshold=0.1),
            "context60": dict(bg_threshold=0.1),
            "coco-object": dict(bg_threshold=0.2),
        },
    ),
    help="OV-Stitcher (CVPR 2026): short side 448 (Cityscapes 560), 336/112 windows (Cityscapes 224/112, COCO-Stuff "
    "336/224), logit scale 40, "
    "the map correction (regionvote); needs --regions; its description prompts with --prompts",
)


# -- the stitched forward ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StitchLayout:
    """The windows of one H x W network input: boxes (y1, y2, x1, x2) as mmseg slides them, and the
    padding (left, right, top, bottom) that brings every window to a multiple of `multiple` (centred, as
    OV-Stitcher's `compute_padsize`; the same for all windows)."""

    size: tuple[int, int]
    boxes: tuple[tuple[int, int, int, int], ...]
    padding: tuple[int, int, int, int]

    @classmethod
    def of(cls, height: int, width: int, window: int, stride: int, multiple: int) -> "StitchLayout":
        boxes = tuple(window_boxes(height, width, window, stride))
        return cls((height, width), boxes, window_padding(boxes[0], multiple, "centre"))

    def crops(self, image: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """... x H x W (pixels 1 x 3 x H x W, or a region map H x W) -> the padded windows, stacked on dim 0."""
        windows = [image[..., y1:y2, x1:x2] for y1, y2, x1, x2 in self.boxes]
        out = [F.pad(w, self.padding, value=fill) for w in windows]
        return torch.cat(out) if image.dim() == 4 else torch.stack(out)

    def grid(self, patch: int) -> tuple[int, int]:
        """The image grid of a `patch`-pixel backbone: (H // patch, W // patch)."""
        return self.size[0] // patch, self.size[1] // patch

    def corners(self, patch: int) -> list[tuple[int, int]]:
        """Each window's top-left cell on that grid: (y1 // patch, x1 // patch), the published floor."""
        return [(y1 // patch, x1 // patch) for y1, _, x1, _ in self.boxes]

    def valid(self, feats: torch.Tensor, patch: int) -> torch.Tensor:
        """B x h x w x C window tokens (on the padded window's grid) -> the cells of the window itself:
        ceil(pad / patch) cells dropped before, (y2 - y1) // patch kept."""
        left, _, top, _ = self.padding
        y1, y2, x1, x2 = self.boxes[0]
        t, l = math.ceil(top / patch), math.ceil(left / patch)
        return feats[:, t : t + (y2 - y1) // patch, l : l + (x2 - x1) // patch]

    def stitch(self, feats: torch.Tensor, patch: int) -> torch.Tensor:
        """All windows' B x h x w x C tokens -> Gh x Gw x C on the image grid, overlaps averaged."""
        total = GridSum(self.grid(patch))
        total.add(self.valid(feats, patch), self.corners(patch))
        return total.mean()


def check_stitched(spec: AttentionSpec | str, depth: int | None = None) -> None:
    """UserValueError unless the spec is one the stitched forward runs: one `ext:NAME.out[cos,scale:T,region:EPS]`
    term, `cls:0/noffn`, one edited block in replace mode, optional `in:` branches (blocks before the last of
    a `depth`-block model), `mct:BETA` and retrieval hooks (`hook:retrieve`: they fuse the bank's support
    into the finished image-wide map at the network input's size, which the stitched forward makes too)."""
    spec = resolve_spec(spec)
    late = [inp.last for inp in spec.block_inputs if depth is not None and inp.last >= depth]
    if late:
        raise UserValueError(f"spec {spec}: in: re-runs block {late[0]}, but the model has {depth} blocks (the last one is the edited block)")
    terms = spec.terms
    hooks = [st.name for st in spec.stages if st.kind != "retrieval"]
    why = None
    if len(terms) != 1 or terms[0].kind != "ext" or split_ext(terms[0].ref.arg)[1] != "out":
        why = "one score term ext:NAME.out"
    elif terms[0].metric != "cos" or terms[0].support != "region" or terms[0].shift or terms[0].iterate or terms[0].temp is not None:
        why = "the term as ext:NAME.out[cos,scale:T,region:EPS]"
    elif spec.cls_residual != 0 or spec.ffn or spec.layers != 1 or spec.parallel or spec.aggregate_in or spec.aggregate_out:
        why = "cls:0/noffn, one edited block, no parallel path or aggregation"
    elif hooks:
        why = f"no hook but retrieval ones (got hook:{hooks[0]})"
    elif spec.gauss_sigma is not None or spec.negative or spec.temperature is not None:
        why = "no gauss, neg or temp option"
    if why:
        raise UserValueError(f"spec {spec}: stitch:M needs {why} (OV-Stitcher)")


@dataclass
class _Scope:
    """The image-wide region-scoped scores of the last block (module docstring): the proxy's features
    re-run over the image (M x C, L2-normalised), the merged region ids on its grid, scores(r0, r1) for a block
    of rows (tau x S, -inf outside the scope)."""

    layout: StitchLayout
    crops: torch.Tensor
    patch: int  # the proxy's
    feat: torch.Tensor
    ids: torch.Tensor
    scores: Callable[[int, int], torch.Tensor]


def _scope(run: ImageRun, rows: int | None) -> _Scope:
    clip, s, spec = run.clip, run.settings, run.spec
    term = spec.terms[0]
    backbone = run.backbone(split_ext(term.ref.arg)[0])
    layout = StitchLayout.of(*run.pixels.shape[-2:], s.window, s.stride, stitch_multiple(spec))
    crops = layout.crops(run.pixels)
    feat = _proxy_global(backbone, backbone.from_clip_pixels(crops, clip.mean, clip.std), layout, s.batch_size, rows)
    ids = resize_regions(run.regions.to(torch.int64).cpu(), layout.grid(backbone.info.patch_size)).flatten()
    ids = merge_regions(ids, feat.cpu(), term.support_arg).to(feat.device)
    total = feat.sum(0)
    mean = (total @ total) / feat.shape[0] ** 2  # mean(S) of S = F F^T, without S
    tau = term.scale

    def scores(r0: int, r1: int) -> torch.Tensor:
        sim = feat[r0:r1] @ feat.T
        return (tau * sim).masked_fill(~region_rows_support(sim, ids[r0:r1], ids, mean), float("-inf"))

    return _Scope(layout, crops, backbone.info.patch_size, feat, ids, scores)


@torch.inference_mode()
def stitched_features(run: ImageRun, rows: int | None = None) -> torch.Tensor:
    """L2-normalised features Gh x Gw x D on the proxy's image grid (H // p) x (W // p) of the run's 1 x 3 x H x W
    network input, by the stitched forward (module docstring); the run's regions: H x W ids at the input's size
    (-1 unsegmented). rows: rows per block of every image-wide attention (default: by memory)."""
    clip, s, spec = run.clip, run.settings, run.spec
    scope = _scope(run, rows)
    layout, crops, feat, ids = scope.layout, scope.crops, scope.feat, scope.ids
    dp, cp = scope.patch, clip.patch_size
    # mask class tokens: the merged map back at the input's size, cropped like the windows (padding unsegmented)
    window_ids = layout.crops(resize_regions(ids.view(layout.grid(dp)), layout.size), fill=-1)
    beta = semantic_weight(spec)
    blocks = clip.visual.transformer.resblocks
    spatial = {i for inp in spec.block_inputs for i in range(inp.first, inp.last + 1)}
    sums = {(i, part): GridSum(layout.grid(cp)) for i in spatial for part in "xqkv"}
    v_main, semantic = GridSum(layout.grid(cp)), GridSum(layout.grid(dp))
    last = blocks[-1]
    C = last.attn.embed_dim
    for b0 in range(0, len(layout.boxes), s.batch_size):
        x, grid = clip._embed(crops[b0 : b0 + s.batch_size], s.pos_interp)
        corners = layout.corners(cp)[b0 : b0 + s.batch_size]
        cells = lambda t: layout.valid(t[:, 1:].reshape(t.shape[0], *grid, -1), cp)  # noqa: E731
        if beta is not None:
            win = torch.stack([resize_regions(r, grid) for r in window_ids[b0 : b0 + s.batch_size]]).flatten(1)
            mct, allowed, index = mask_class_tokens(x, win.to(x.device))
        for i, blk in enumerate(blocks[:-1], start=1):
            if i in spatial:  # this block also runs image-wide: its windows' inputs and q, k, v, stitched
                q, k, v = F.linear(blk.ln_1(x), blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, dim=-1)
                for part, t in zip("xqkv", (x, q, k, v)):
                    sums[(i, part)].add(cells(t), corners)
            if beta is not None:
                mct = mct_step(blk, mct, x, allowed, grid)
            x = run_block(blk, x, grid)
        v_main.add(cells(F.linear(last.ln_1(x), last.attn.in_proj_weight[2 * C :], last.attn.in_proj_bias[2 * C :])), corners)
        if beta is not None:
            mct = mct_step(last, mct, x, allowed, grid)
            target = tuple(side // dp for side in crops.shape[-2:])
            painted = semantic_tokens(mct, index, grid, target).reshape(mct.shape[0], *target, C)
            semantic.add(layout.valid(painted, dp), layout.corners(dp)[b0 : b0 + s.batch_size])

    values = [v_main.mean()]
    branch_weights = []
    for inp in spec.block_inputs:
        outs = [_clip_global(blocks[i - 1], *(sums[(i, part)].mean() for part in "xqkv"), rows) for i in range(inp.first, inp.last + 1)]
        y = sum(outs[1:], outs[0].clone()) if inp.kind == "sum" else torch.stack(outs).mean(0)
        values.append(F.linear(last.ln_1(y), last.attn.in_proj_weight[2 * C :], last.attn.in_proj_bias[2 * C :]))
        branch_weights.append(inp.weight)
    cgrid, dgrid = layout.grid(cp), layout.grid(dp)
    v = torch.cat([values_to_grid(t.reshape(1, 1, -1, C), cgrid, dgrid)[0, 0] for t in values], dim=-1)
    out = blocked_attention(scope.scores, v.to(feat.dtype), spec.normalizer, rows)
    ln_post = clip.visual.ln_post
    branches = [ln_post(last.ls_1(last.attn.out_proj(o.to(v.dtype)))) for o in out.split(C, dim=-1)]
    x = branches[0]
    for weight, y in zip(branch_weights, branches[1:]):
        x = x + (y if weight == 1.0 else weight * y)
    if beta is not None:
        x = x + beta * ln_post(semantic.mean().reshape(-1, C))
    return clip._features(x).reshape(*dgrid, -1)


def _proxy_global(backbone, crops: torch.Tensor, layout: StitchLayout, batch_size: int, rows: int | None) -> torch.Tensor:
    """The proxy's last block re-run over the image: its windows' last-block q, k, v and penultimate tokens
    (after the final norm) stitched on its grid, then per head softmax(scale q k^T) v, residual from the
    penultimate tokens, proj, MLP; L2-normalised, M x C (M = the grid's cells, row-major)."""
    parts = {name: GridSum(layout.grid(backbone.info.patch_size)) for name in ("q", "k", "v", "penult")}
    p = backbone.info.patch_size
    for b0 in range(0, crops.shape[0], batch_size):
        f = backbone.features(crops[b0 : b0 + batch_size], want=("qkv", "penult"))
        B, heads, M, d = f.q.shape
        corners = layout.corners(p)[b0 : b0 + batch_size]
        for name, t in (("q", f.q), ("k", f.k), ("v", f.v)):
            parts[name].add(layout.valid(t.transpose(1, 2).reshape(B, *f.grid, heads * d), p), corners)
        parts["penult"].add(layout.valid(f.penult.reshape(B, *f.grid, -1), p), corners)
    blk = backbone.model.blocks[-1]
    heads = blk.attn.num_heads
    q, k, v = (parts[n].mean().reshape(-1, heads, d).transpose(0, 1) for n in "qkv")
    o = global_attention(q, k, v, blk.attn.scale, "softmax", rows).transpose(0, 1).reshape(q.shape[1], -1)
    x = parts["penult"].mean().reshape(q.shape[1], -1) + blk.attn.proj(o)
    x = x + blk.mlp(blk.norm2(x))
    return F.normalize(x.float(), dim=-1)


def _clip_global(block: torch.nn.Module, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int | None) -> torch.Tensor:
    """One CLIP block re-run over the image from its windows' stitched input x and q, k, v (Gh x Gw x C):
    attention with all heads as one (softmax(q k^T head_dim^-1/2) over all C channels, as the code), W_o,
    residual, then the MLP; N x C."""
    C = x.shape[-1]
    q, k, v, x = (t.reshape(-1, C) for t in (q, k, v, x))
    o = global_attention(q, k, v, (C // block.attn.num_heads) ** -0.5, "softmax", rows)
    y = x + block.ls_1(block.attn.out_proj(o))
    return y + block.ls_2(block.mlp(block.ln_2(y)))


class StitchedForward(Forward):
    """OV-Stitcher's forward (`stitch:M`): the windows stitched, the last block's region-scoped map over the
    whole image; its attention, what analyze and explain read, is that image-wide map (one for all heads)."""

    name = "stitched"
    kinds = frozenset({"retrieval"})
    image_wide = True

    def check(self, plan: Plan) -> None:
        check_stitched(plan.spec)
        if not plan.settings.window:
            raise UserValueError(f"spec {plan.spec} stitches sliding windows: set a window size (not 0)")

    def refusal(self, stage: Stage, plan: Plan) -> str:
        return f"stage {stage.name} cannot run with spec {plan.spec}, whose windows are stitched"

    def check_model(self, plan: Plan, clip) -> None:
        check_stitched(plan.spec, clip.depth)

    def cosine(self, run: ImageRun) -> CosineMap:
        return grid_cosine(stitched_features(run), run.text, run.out_size, via=run.size)

    @torch.inference_mode()
    def attention(self, run: ImageRun, whole_image: bool = False) -> Iterator[AttentionWindow]:
        scope = _scope(run, None)
        grid, p = scope.layout.grid(scope.patch), scope.patch
        maps = normalize(scope.scores(0, scope.feat.shape[0]), run.spec.norm)[None]  # 1 x N x N: one map for all heads
        yield AttentionWindow((0, grid[0] * p, 0, grid[1] * p), (0, 0, 0, 0), grid, maps.float())


FORWARDS.register("stitched", StitchedForward(), help="OV-Stitcher: windows stitched on the image grid, the last block's map image-wide (stitch:M)")

# The paper's Table 1 (OpenAI B/16), from the repository's results image. Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 75.7, "context60": 43.9, "coco-object": 42.6, "voc20": 89.8, "context59": 48.8, "coco-stuff": 31.8,
     "cityscapes": 48.1, "ade20k": 24.7},
    "atw617/OV-Stitcher@270b85a assets/quantitative.png (OV-Stitcher, OpenAI B/16)",
    printed_average=50.7,
    note="with the SAM-mask post-processing (48.9 without); region masks as input (--regions)",
)  # fmt: skip
