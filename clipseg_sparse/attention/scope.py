"""Region maps inside the engine (CorrCLIP, research/peers-sota.md 2.8): the `region:EPS` support and
the `mct:BETA` semantic branch.

Each window arrives with its crop of the image's region map (B x H x W integer ids at the crop's pixels,
-1 = unsegmented, padded areas one more region, as the published code pads with 10000). Before any block
runs, `prepare_regions` resizes it (nearest) to the attention grid and, for a `region:EPS` term, merges
regions whose mean features (the term's own, L2-normalised) are linked by DBSCAN (eps EPS, min_samples 1)
on max(sim) - sim (a bare `region` keeps the regions as given); the support then reads these B x M ids from `BlockContext.extra["regions"]`.

`mct:BETA`: one copy of the CLS token per region of the (merged) map resized to CLIP's grid ("mask
class tokens", every id present, the unsegmented one included). In every block MCT r attends to the CLS
token and to the patches of its region only (not to itself or other MCTs), and no original token
attends to an MCT, so the main path is unchanged and the MCTs are computed beside it (`mct_step`, the
block's own weights). After the full last block, each patch of the attention grid takes the output of
the MCT of its region (CLIP grid upsampled nearest): the semantic branch, added with weight BETA after
its own ln_post.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from .contract import Block, grid_block, positive_attention
from .grid import merge_regions, resize_regions
from ..stages import Needs
from .spec import AttentionSpec, register_option
from .terms import Term, parse_number, fmt_num
from .taps import BlockContext, attention_grid


def region_terms(spec: AttentionSpec) -> list[Term]:
    return [t for t in spec.terms if t.support == "region"]


def semantic_weight(spec: AttentionSpec) -> float | None:
    """BETA of `mct:BETA`, or None without a semantic branch."""
    arg = spec.extra("mct")
    return None if arg is None else float(arg)


def needs_regions(spec: AttentionSpec) -> bool:
    """The spec reads region maps (a `region:EPS` support or the `mct:` branch)."""
    return bool(region_terms(spec)) or semantic_weight(spec) is not None


def prepare_regions(spec: AttentionSpec, regions: torch.Tensor | None, pixels: torch.Tensor, grid: tuple[int, int], extra: dict) -> None:
    """Put the B x M region ids of the attention grid (merged for a `region:EPS` term) in
    `extra["regions"]`. regions: B x H x W ids at the crop's pixels; grid: CLIP's patch grid."""
    if regions is None:
        raise UserValueError(f"spec {spec} needs region masks for each image (give regions, e.g. --regions FOLDER or sam2)")
    target = attention_grid(spec, tuple(pixels.shape[-2:]), grid)
    ids = torch.stack([resize_regions(r, target) for r in regions.to(torch.int64)]).flatten(1)
    terms = region_terms(spec)
    if terms:
        if len({t.support_arg for t in terms}) > 1:
            raise UserValueError(f"spec {spec}: region terms with different merge distances")
        term = terms[0]
        if term.support_arg is None:  # bare `region`: no merging (CorrCLIPv2 comments its DBSCAN out)
            terms = []
    if terms:
        if term.kind != "ext":
            raise UserValueError(f"term {term}: the region support needs features from the image alone (an ext:NAME tap)")
        feats, _ = term.ref.tap.features(BlockContext(grid=grid, pixels=pixels, extra=extra), term.ref.arg)
        if feats.shape[1] != 1:
            raise UserValueError(f"term {term}: the region support needs one map for all heads")
        feats = F.normalize(feats[:, 0].float(), dim=-1)
        ids = torch.stack([merge_regions(r.cpu(), f.cpu(), term.support_arg) for r, f in zip(ids, feats)]).to(ids.device)
    extra["regions"] = ids
    extra["regions_grid"] = target


def mask_class_tokens(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MCTs of a batch: x B x (1 + N) x C tokens after ln_pre; ids B x N region ids on CLIP's grid.
    Returns (B x R x C copies of CLS, B x R x (1 + N) allowed keys, B x N index of each patch's MCT);
    R = the most regions of a window (windows with fewer get spare MCTs that attend to CLS only)."""
    B, N = ids.shape
    index = torch.empty_like(ids)
    present = []
    for b in range(B):
        values, index[b] = torch.unique(ids[b], return_inverse=True)
        present.append(len(values))
    R = max(present)
    allowed = torch.zeros(B, R, 1 + N, dtype=torch.bool, device=x.device)
    allowed[:, :, 0] = True
    allowed[:, :, 1:] = index[:, None, :] == torch.arange(R, device=x.device)[None, :, None]
    return x[:, :1].expand(B, R, -1).clone(), allowed, index


def mct_step(block: Block, mct: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """One block for the MCTs (B x R x C): queries from the MCTs, keys and values from the block's input x
    (B x (1 + N) x C, the original tokens on `grid`), restricted to `allowed`; residual and FFN.
    open_clip's block: the q and kv rows of its fused in_proj (as published); a `contract.GridBlock` (timm
    towers, models/families/timm_tower.py): the MCTs project as prefix tokens before x, so like the CLS they
    copy they get no RoPE, and the patches get theirs."""
    attn = positive_attention(block.attn)
    B, R, C = mct.shape
    own = grid_block(block)
    if own is None:
        H = attn.num_heads
        w_q, w_kv = attn.in_proj_weight[:C], attn.in_proj_weight[C:]
        b_q, b_kv = attn.in_proj_bias[:C], attn.in_proj_bias[C:]
        q = F.linear(block.ln_1(mct), w_q, b_q).view(B, R, H, C // H).transpose(1, 2)
        k, v = F.linear(block.ln_1(x), w_kv, b_kv).view(B, -1, 2, H, C // H).permute(2, 0, 3, 1, 4)
    else:
        q, k, v = own.project_qkv(block.ln_1(torch.cat([mct, x], dim=1)), grid)
        q, k, v = q[:, :, :R], k[:, :, R:], v[:, :, R:]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    y = mct + block.ls_1(attn.out_proj(out.transpose(1, 2).reshape(B, R, C)))
    return y + block.ls_2(block.mlp(block.ln_2(y)))


def semantic_tokens(mct: torch.Tensor, index: torch.Tensor, clip_grid: tuple[int, int], target: tuple[int, int]) -> torch.Tensor:
    """B x M x C: each cell of the attention grid takes its region's MCT output (index: B x N on CLIP's
    grid, upsampled nearest to `target`)."""
    B, _, C = mct.shape
    up = torch.stack([resize_regions(i.view(*clip_grid), target) for i in index]).flatten(1)
    return torch.gather(mct, 1, up[..., None].expand(-1, -1, C))


def _check_mct(arg: str) -> str:
    return fmt_num(parse_number(arg, "mct"))


register_option(
    "mct",
    _check_mct,
    help="mct:BETA (CorrCLIP's semantic branch: one CLS copy per region, masked in every block, weight BETA after ln_post)",
    needs=lambda arg: Needs(regions=f"mct:{arg}"),
)
