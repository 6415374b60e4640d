"""timm image towers behind the engine's one block contract: the adapter EVA-02 / EVA-01, SigLIP / SigLIP 2
and PE-Core run through (their files: `eva.py`, `siglip.py`, `pe_core.py`), and the timm towers refused.

open_clip builds these image towers as `TimmModel(trunk=timm Eva | VisionTransformer)`, not as its own
`VisionTransformer` of `ResidualAttentionBlock`s with an `nn.MultiheadAttention`. This module is the one
adapter between them and the engine (`attention/`), which reads a block as `attention.contract.Block`:
`ln_1`, `attn` (`num_heads`, `out_proj`), `ls_1`, `ln_2`, `mlp`, `ls_2`; each adapted block is also a
`contract.GridBlock`, whose two methods the engine asks for (`attention.taps.block_qkv` / `run_block`):

- `project_qkv(u, grid)`: q, k, v per head from the block's own weights: separate `q_proj/k_proj/v_proj`
  (EVA-02), fused `qkv` with `q_bias/v_bias` and a zero k bias (EVA-01, PE-Core), fused `qkv` (SigLIP);
  then `q_norm/k_norm`, then 2-D RoPE on the patch tokens exactly where timm's `EvaAttention` /
  `AttentionRope` apply it (after the prefix tokens; on all tokens when the CLS is dropped, `cls:C`; CLS
  copies placed before the tokens, CorrCLIP's `mct:`, count as prefix tokens);
- `forward_grid(x, grid)`: the untouched timm block with the RoPE of that grid.
`out_proj` is the attention's `norm` (EVA-02's inner LayerNorm, `scale_attn_inner`) then `proj`.

Positions at any input size follow each family's own rule, timm's `dynamic_img_size` path: the absolute
embedding resampled by `resample_abs_pos_embed` (bicubic, antialiased; no prefix entries for SigLIP), and
RoPE rebuilt for the grid from the model's bands (`RotaryEmbeddingCat`, coordinates scaled to its
`ref_feat_shape`), which is what a timm model built with `dynamic_img_size=True` computes.

Dense features: the image embedding of SigLIP and PE-Core comes out of an attention-pooling ("MAP") head
(`AttentionPoolLatent`: one latent query, `kv`, `proj`, then `x + mlp(norm(x))`), so each token goes
through that head as MaskCLIP reads CLIP's attention pool: attention of the latent over one token is that
token, so a token's output is `proj(v(x))` and then the head's residual MLP, then `fc_norm` and the
heads. TextRegion (avaxiao/TextRegion@e392cd2, model_semantic.py) reads the same head over region masks
but skips `x + mlp(norm(x))` for SigLIP 2; here it is applied, because the image embedding applies it.
EVA-02 pools its CLS token: per token, `fc_norm` (Identity) and the trunk's `head` (a Linear with bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import precision
from ...attention.spec import AttentionSpec
from ..tower import Family, Match, register_family, timm_model_name

# --- the block interface -----------------------------------------------------------------------------------


class _LayerScale(nn.Module):
    """An EvaBlock's `gamma_i` (None = no layer scale) or a timm Block's `ls_i` module, as `ls_1`/`ls_2`."""

    def __init__(self, block: nn.Module, gamma: str, module: str):
        super().__init__()
        self._block = [block]  # not a submodule: the block owns its parameters
        self._gamma, self._module = gamma, module

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        block = self._block[0]
        ls = getattr(block, self._module, None)
        if ls is not None:
            return ls(y)
        g = getattr(block, self._gamma, None)
        return y if g is None else g * y


class _OutProj(nn.Module):
    """The attention's output path after the heads are concatenated: `norm` (EVA-02's inner LayerNorm;
    Identity elsewhere), then `proj`."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self._attn = [attn]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        a = self._attn[0]
        return a.proj(a.norm(y))


class TowerAttention(nn.Module):
    """What the engine reads of a timm attention module: `num_heads`, `out_proj`, and the q/k/v projection."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        if getattr(attn, "gate", None) is not None:
            raise ValueError(f"{type(attn).__name__} gates its output per token; the engine has no gate")
        self._attn = [attn]
        self.num_heads = int(attn.num_heads)
        self.out_proj = _OutProj(attn)

    def qkv(self, u: torch.Tensor, rope: torch.Tensor | None, prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B x H x N x d) of u (B x N x C) as timm's forward computes them; RoPE (N' x 2d', sin
        then cos, `apply_rot_embed_cat`) on the tokens after the first `prefix`."""
        from timm.layers.pos_embed_sincos import apply_rot_embed_cat

        a = self._attn[0]
        B, N, _ = u.shape
        H = self.num_heads
        if getattr(a, "qkv", None) is not None:
            q_bias = getattr(a, "q_bias", None)
            if q_bias is not None:  # EvaAttention fused: q and v biases, k bias zero
                qkv = F.linear(u, a.qkv.weight, torch.cat((q_bias, a.k_bias, a.v_bias)))
            else:
                qkv = a.qkv(u)
            q, k, v = qkv.reshape(B, N, 3, H, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            kv_heads = int(getattr(a, "num_kv_heads", H))
            q = a.q_proj(u).reshape(B, N, H, -1).transpose(1, 2)
            k = a.k_proj(u).reshape(B, N, kv_heads, -1).transpose(1, 2)
            v = a.v_proj(u).reshape(B, N, kv_heads, -1).transpose(1, 2)
        q, k = a.q_norm(q), a.k_norm(k)
        if rope is not None:
            half = getattr(a, "rotate_half", False)
            q = torch.cat([q[:, :, :prefix], apply_rot_embed_cat(q[:, :, prefix:], rope, half=half)], dim=2).type_as(v)
            k = torch.cat([k[:, :, :prefix], apply_rot_embed_cat(k[:, :, prefix:], rope, half=half)], dim=2).type_as(v)
        groups = int(getattr(a, "num_kv_groups", 1))
        if groups > 1:  # grouped-query attention: as AttentionRope, after norm and rope
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v


class TowerBlock(nn.Module):
    """A timm `Block` / `EvaBlock` seen as open_clip's ResidualAttentionBlock (`ln_1`, `attn`, `ls_1`,
    `ln_2`, `mlp`, `ls_2`) plus `project_qkv` and `forward_grid` (RoPE needs the patch grid)."""

    def __init__(self, block: nn.Module, tower: "TimmTower"):
        super().__init__()
        kind = type(block).__name__
        if kind not in ("Block", "EvaBlock"):
            raise ValueError(f"timm block {kind} is not a pre-norm ViT block (Block, EvaBlock); the engine cannot edit it")
        self.block = block
        self._tower = [tower]
        self.ln_1, self.ln_2, self.mlp = block.norm1, block.norm2, block.mlp
        self.attn = TowerAttention(block.attn)
        self.ls_1 = _LayerScale(block, "gamma_1", "ls1")
        self.ls_2 = _LayerScale(block, "gamma_2", "ls2")
        self._rope = kind == "EvaBlock"

    def project_qkv(self, u: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ln_1 state u (B x N x C): the last h*w tokens are the patches (RoPE), any before them
        prefix tokens (the model's CLS; none when `cls:C` drops it; CorrCLIP's CLS copies before it, `mct:`)."""
        prefix = u.shape[1] - grid[0] * grid[1]
        if prefix < 0:
            raise ValueError(f"{u.shape[1]} tokens are fewer than the {grid[0]}x{grid[1]} patch grid")
        return self.attn.qkv(u, self._tower[0].rope(grid, u), prefix)

    def forward_grid(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """timm's block on x; in reduced precision on CPUs where the fused attention kernel is the slower
        path (`precision.explicit_attention_is_faster`) with timm's own explicit attention (q * scale, q k^T,
        softmax, product), as open_clip's blocks run there; fp32 keeps the block's setting."""
        attn = self.block.attn
        fused = getattr(attn, "fused_attn", None)
        if fused and precision.is_reduced(x) and precision.explicit_attention_is_faster(x.device):
            attn.fused_attn = False
            try:
                return self._forward(x, grid)
            finally:
                attn.fused_attn = fused
        return self._forward(x, grid)

    def _forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        if self._rope:
            return self.block(x, rope=self._tower[0].rope(grid, x))
        return self.block(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - the engine calls forward_grid
        raise TypeError("an adapted timm block needs its patch grid: call forward_grid(x, grid)")


@dataclass(eq=False)
class TimmTower:
    """The `tower.Tower` of an open_clip `TimmModel` (`module`: `.trunk` a timm Eva or VisionTransformer,
    `.head` its projection). It is its own `visual`: it has what the engine and the rest of the package read
    of open_clip's VisionTransformer, `transformer.resblocks` (TowerBlocks), `ln_post` (the trunk's final
    `norm`) and `preprocess_cfg`, plus `dense_head` and `pooled`.

    prefix_tokens: the prefix tokens before the patches (1 = CLS for EVA and PE-Core; 0 for SigLIP).
    """

    module: nn.Module
    _ropes: dict = field(default_factory=dict, repr=False)
    _out_dim: int | None = field(default=None, repr=False)

    @classmethod
    def of(cls, model: nn.Module) -> "TimmTower":
        return cls(model.visual)

    def __post_init__(self) -> None:
        trunk = self.trunk
        if getattr(trunk, "reg_token", None) is not None:
            raise ValueError("register tokens are not supported by the tower adapter")
        pe = trunk.patch_embed
        if type(pe).__name__ != "PatchEmbed" or getattr(pe, "dynamic_img_pad", False):
            raise ValueError(f"{type(pe).__name__}: only timm's plain PatchEmbed is supported")
        ap = getattr(trunk, "attn_pool", None)
        if ap is not None and getattr(ap, "pos_embed", None) is not None:
            raise ValueError("an attention-pooling head with its own positional embedding is not supported")
        if getattr(trunk, "rope_mixed", False):
            raise ValueError("mixed (per-block) RoPE is not supported by the tower adapter")
        self.prefix_tokens = int(trunk.num_prefix_tokens)
        self.transformer = SimpleNamespace(resblocks=nn.ModuleList([TowerBlock(b, self) for b in trunk.blocks]), batch_first=True)
        self.ln_post = trunk.norm

    @property
    def visual(self) -> "TimmTower":
        return self

    @property
    def device(self) -> torch.device:
        return self.trunk.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.trunk.patch_embed.proj.weight.dtype

    @property
    def embed_dim(self) -> int:
        """The width of the heads' output, read once from a probe token."""
        if self._out_dim is None:
            probe = torch.zeros(1, 1, self.trunk.embed_dim, device=self.device, dtype=self.dtype)
            with torch.inference_mode():
                self._out_dim = int(self.dense_head(probe).shape[-1])
        return self._out_dim

    @property
    def trunk(self) -> nn.Module:
        return self.module.trunk

    @property
    def preprocess_cfg(self) -> dict:
        return self.module.preprocess_cfg

    @property
    def patch_size(self) -> int:
        return int(self.trunk.patch_embed.patch_size[0])

    @property
    def grid_size(self) -> tuple[int, int]:
        return tuple(int(g) for g in self.trunk.patch_embed.grid_size)

    def rope(self, grid: tuple[int, int], like: torch.Tensor) -> torch.Tensor | None:
        """(h*w) x 2d RoPE table of `grid` (None without RoPE): the model's cached table at its native
        grid, else rebuilt from its bands as timm's dynamic-size path does (`get_embed(shape)`)."""
        rope = getattr(self.trunk, "rope", None)
        if rope is None:
            return None
        key = (tuple(grid), like.device)
        if key not in self._ropes:
            if getattr(rope, "feat_shape", None) is not None and tuple(rope.feat_shape) == tuple(grid):
                table = rope.get_embed()
            elif getattr(rope, "_use_cached_embed", False):  # fixed-size model: build this grid's table from the bands
                table = rope._build_embed_cat(list(grid), rope.bands)
            else:
                table = rope.get_embed(shape=list(grid))
            if len(self._ropes) > 16:  # window grids are few; bound the cache anyway
                self._ropes.clear()
            self._ropes[key] = table.to(like.device)
        return self._ropes[key]

    def positional_embedding(self, grid: tuple[int, int], rule: str) -> torch.Tensor | None:
        """1 x (P + h*w) x C absolute positions for `grid` (P = the prefix entries the model keeps, 0 for
        SigLIP), None without them. rule "size": timm's `resample_abs_pos_embed` to exactly `grid`
        (bicubic, antialiased); rule "scale": the published OVSS repositories' `(n + 0.1) / native` scale
        factor (bicubic), as for open_clip ViTs (`openclip_vit.OpenClipViT.positional_embedding`)."""
        from timm.layers import resample_abs_pos_embed

        trunk = self.trunk
        pos = trunk.pos_embed
        if pos is None:
            return None
        keep = 0 if trunk.no_embed_class else self.prefix_tokens
        native = self.grid_size
        if rule == "size":
            return resample_abs_pos_embed(pos, new_size=list(grid), old_size=list(native), num_prefix_tokens=keep)
        h, w = grid
        if h * w == native[0] * native[1]:
            return pos
        patches = pos[:, keep:].reshape(1, *native, -1).permute(0, 3, 1, 2).float()
        patches = F.interpolate(patches, scale_factor=((h + 0.1) / native[0], (w + 0.1) / native[1]), mode="bicubic", align_corners=False)
        if tuple(patches.shape[-2:]) != (h, w):
            raise ValueError(f"scale-factor interpolation gave {tuple(patches.shape[-2:])}, not {grid}")
        return torch.cat([pos[:, :keep], patches.permute(0, 2, 3, 1).reshape(1, h * w, -1).to(pos.dtype)], dim=1)

    def embed(self, pixels: torch.Tensor, rule: str = "size") -> tuple[torch.Tensor, tuple[int, int]]:
        """Tokens B x (P + h*w) x C entering the first block (timm's patch_embed, `_pos_embed`, norm_pre)
        and the grid (h, w); pixels B x 3 x H x W, H and W multiples of the patch size."""
        trunk = self.trunk
        pe = trunk.patch_embed
        x = pe.proj(pixels)
        grid = (int(x.shape[-2]), int(x.shape[-1]))
        x = pe.norm(x.flatten(2).transpose(1, 2))
        pos = self.positional_embedding(grid, rule)
        B = x.shape[0]
        cls = [] if getattr(trunk, "cls_token", None) is None else [trunk.cls_token.expand(B, -1, -1)]
        if pos is not None and trunk.no_embed_class:
            x = x + pos.to(x.dtype)
        if cls:
            x = torch.cat(cls + [x], dim=1)
        if pos is not None and not trunk.no_embed_class:
            x = x + pos.to(x.dtype)
        return trunk.norm_pre(x), grid

    def forward_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """The trunk's `forward_features` at any input size: tokens after the final norm (B x N x C)."""
        x, grid = self.embed(pixels)
        for blk in self.transformer.resblocks:
            x = blk.forward_grid(x, grid)
        return self.ln_post(x)

    def dense_head(self, normed: torch.Tensor) -> torch.Tensor:
        """Per-token image embeddings B x N x D (unnormalised) of tokens after the final norm: the MAP
        head's value path per token (`proj(v)`, then `x + mlp(norm(x))`), or the token itself for token or
        average pooling; then `fc_norm`, the trunk's `head` and open_clip's `head`."""
        trunk = self.trunk
        y = normed
        ap = getattr(trunk, "attn_pool", None)
        if ap is not None:
            C = y.shape[-1]
            bias = None if ap.kv.bias is None else ap.kv.bias[C:]
            y = ap.proj(F.linear(y, ap.kv.weight[C:], bias))  # attention of the latent over one token is 1
            if ap.mlp is not None:
                y = y + ap.mlp(ap.norm(y))
        y = trunk.head(trunk.head_drop(trunk.fc_norm(y)))
        return self.module.head(y)

    def pooled(self, normed: torch.Tensor) -> torch.Tensor:
        """The image embedding B x D (unnormalised) of tokens after the final norm: the trunk's own
        `forward_head` (MAP head, CLS token or average) and open_clip's head: `encode_image`'s."""
        return self.module.head(self.trunk.forward_head(normed))



    def final_norm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The trunk's final norm in the model's dtype: the pooling heads after it run in that dtype."""
        return self.ln_post

    def features(self, normed: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.dense_head(normed).float(), dim=-1)

    def dense_and_image(self, normed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last n tokens' features and the trunk's pooled embedding of all tokens: for MAP towers in
        parallel mode (GEM, CLIP Surgery) that pools the edited patch tokens, not CLIP's own image embedding."""
        return self.features(normed[:, -n:]), F.normalize(self.pooled(normed).float(), dim=-1)

    def refuse(self, spec: AttentionSpec, model_name: str) -> str | None:
        """DnA (`dna:PATH`: adapters are converted from open_clip's packed attention) and, on a tower without
        a CLS token (SigLIP), CorrCLIP's `mct:BETA` (copies of the CLS token) and `cls:C` for C != 0 (`cls:0`
        runs: no residual)."""
        if spec.extra("dna") is not None:
            return (
                f"dna:PATH adapters are converted from and trained on open_clip's packed "
                f"nn.MultiheadAttention (dna train); {model_name} has a timm tower (its own q/k/v, q/k norms, RoPE), "
                f"for which no DnA converter exists yet"
            )
        if spec.extra("mct") is not None and self.prefix_tokens == 0:
            return f"mct:BETA copies the CLS token once per region, and {model_name} has none"
        if spec.cls_residual and self.prefix_tokens == 0:
            return f"cls:C adds C x the CLS token, and {model_name} has none (cls:0 runs)"
        return None


# --- which timm towers: the refused ones by name fragment; EVA, PE-Core and SigLIP in their own files; any
# other timm ViT through the adapter; any other timm tower refused (both after every other family) -----------

_REFUSED = (  # (fragment of the timm model name, family, reason)
    ("vitamin", "ViTamin", "its image tower is a hybrid (MbConv stages before the ViT), it has no plain patch tokens to re-attend"),
    ("convnext", "ConvNeXt", "its image tower is a ConvNeXt CNN, not a ViT"),
    ("fastvit", "MobileCLIP (FastViT)", "its image tower is a FastViT hybrid CNN, not a ViT"),
    ("_mci", "MobileCLIP (ViT-MCi)", "its ViT has a convolutional stem (MobileCLIP's MCi), not a patch embedding"),
    ("swin", "Swin", "its image tower is a Swin transformer (shifted windows), not a global-attention ViT"),
    ("relpos", "timm ViT (rel-pos)", "its blocks add relative-position biases, which the engine does not carry"),
)


def timm_family(family: str, matches: Callable[[str, str], bool]) -> Match:
    """The `match` of a family run by this adapter: `matches(timm_name, name)` on configurations with a
    timm image tower."""

    def match(name: str, config: dict) -> Family | None:
        timm_name = timm_model_name(config)
        if timm_name is not None and matches(timm_name, name):
            return Family(family, f"timm {timm_name}", wrap=TimmTower.of)
        return None

    return match


def _refused(fragment: str, family: str, reason: str) -> Match:
    def match(name: str, config: dict) -> Family | None:
        timm_name = timm_model_name(config)
        return Family(family, f"timm {timm_name}", reason) if timm_name is not None and fragment in timm_name else None

    return match


def _unknown(name: str, config: dict) -> Family | None:
    timm_name = timm_model_name(config)
    if timm_name is None:
        return None
    return Family("timm", f"timm {timm_name}", f"its image tower is timm's {timm_name}, which the tower adapter does not know")


for _fragment, _family, _reason in _REFUSED:
    register_family(_family, _refused(_fragment, _family, _reason), help=f"refused: {_reason}")
register_family("timm ViT", timm_family("timm ViT", lambda timm_name, name: timm_name.startswith("vit_")), fallback=True,
                help="any other timm VisionTransformer")
register_family("timm", _unknown, fallback=True, help="refused: any other timm image tower")
