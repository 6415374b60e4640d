"""open_clip's own VisionTransformer: CLIP ViT (OpenAI, LAION, DataComp, MetaCLIP, DFN, ...) and MetaCLIP 2.

The engine runs its `ResidualAttentionBlock`s as they are (`attention.contract.Block`), so this tower only
embeds pixels (conv1, CLS, positional embeddings at any grid, ln_pre) and reads features through ln_post
and proj. The open_clip configurations no tower here runs are refused by what their config says, before
any family is asked: a Hugging Face text encoder, CoCa's captioning pool, a ResNet, CLIPA's pooling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ...attention.precision import fp32_layer_norm
from ...attention.spec import AttentionSpec
from ..tower import Family, register_family, timm_model_name

OPEN_CLIP_VIT = "open_clip VisionTransformer"


@dataclass(eq=False)
class OpenClipViT:
    """The `tower.Tower` of an open_clip `VisionTransformer` (`visual`, the model's own module)."""

    visual: torch.nn.Module
    _pos_cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "OpenClipViT":
        return cls(model.visual)

    @property
    def device(self) -> torch.device:
        return self.visual.proj.device

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.proj.dtype

    @property
    def patch_size(self) -> int:
        return int(self.visual.patch_size[0])

    @property
    def grid_size(self) -> tuple[int, int]:
        return tuple(self.visual.grid_size)

    @property
    def prefix_tokens(self) -> int:
        """The CLS token."""
        return 1

    @property
    def embed_dim(self) -> int:
        return int(self.visual.proj.shape[1])

    def positional_embedding(self, grid: tuple[int, int], rule: str) -> torch.Tensor:
        """Positional embeddings (1 + h*w) x C for a patch grid, bicubic from the native grid by `rule`
        (`DenseCLIP.positional_embedding` says how each rule samples), computed once per grid."""
        pos = self.visual.positional_embedding
        native = self.grid_size
        h, w = grid
        if (h * w == native[0] * native[1]) if rule == "scale" else (tuple(grid) == native):
            return pos
        key = (tuple(grid), rule, pos.dtype, pos.device)
        if key not in self._pos_cache:
            cls, patches = pos[:1], pos[1:]
            patches = patches.reshape(1, *native, -1).permute(0, 3, 1, 2).float()
            if rule == "size":
                patches = F.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
            else:
                factor = ((h + 0.1) / native[0], (w + 0.1) / native[1])
                patches = F.interpolate(patches, scale_factor=factor, mode="bicubic", align_corners=False)
                if tuple(patches.shape[-2:]) != (h, w):  # the published code asserts the same
                    raise ValueError(f"scale-factor interpolation gave {tuple(patches.shape[-2:])}, not {grid}")
            patches = patches.permute(0, 2, 3, 1).reshape(h * w, -1).to(pos.dtype)
            self._pos_cache[key] = torch.cat([cls, patches])
        return self._pos_cache[key]

    def embed(self, pixels: torch.Tensor, rule: str) -> tuple[torch.Tensor, tuple[int, int]]:
        """Tokens B x (1 + h*w) x C after ln_pre, and the patch grid (h, w)."""
        v = self.visual
        ps = self.patch_size
        B, _, H, W = pixels.shape
        grid = (H // ps, W // ps)
        x = v.conv1(pixels).flatten(2).transpose(1, 2)
        cls = v.class_embedding.to(x.dtype).view(1, 1, -1).expand(B, -1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding(grid, rule).to(x.dtype)
        x = v.ln_pre(v.patch_dropout(x))
        if not v.transformer.batch_first:
            raise ValueError("only batch-first open_clip transformers are supported (open_clip >= 2.24 default)")
        return x, grid

    def final_norm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """ln_post as the model runs it; in fp32 for a reduced-precision model (`attention.precision`)."""
        return self.visual.ln_post if self.dtype == torch.float32 else fp32_layer_norm(self.visual.ln_post)

    def features(self, normed: torch.Tensor) -> torch.Tensor:
        """proj and L2 normalisation of tokens after ln_post, in fp32 (for reduced-precision models too)."""
        return F.normalize((normed.float() @ self.visual.proj.float()), dim=-1)

    def dense_and_image(self, normed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last n tokens' features and the CLS token's. One product of every token with proj, the CLS
        rows among them: a product of the B CLS rows alone takes another BLAS path and rounds differently
        (up to 2e-7 in CLIP Surgery's probabilities, whose class weights read the CLS embedding)."""
        x = self.features(normed)
        return x[:, -n:], x[:, 0]

    def refuse(self, spec: AttentionSpec, model_name: str) -> None:
        """Every spec runs on open_clip's blocks."""
        return None


# --- which configurations: the refusals first, then MetaCLIP 2, and any other open_clip ViT last -----------


def _hf_text(name: str, config: dict) -> Family | None:
    if "hf_model_name" in config.get("text_cfg", {}):
        return Family("HF text encoder", "timm" if timm_model_name(config) else "open_clip",
                      "its text tower is a Hugging Face transformers model (mT5, NLLB, RoBERTa), not open_clip's")
    return None


def _coca(name: str, config: dict) -> Family | None:
    if "multimodal_cfg" in config:
        return Family("CoCa", "open_clip", "CoCa pools its image tokens by attention into a captioning decoder; its dense path is not built")
    return None


def _resnet(name: str, config: dict) -> Family | None:
    if isinstance(config.get("vision_cfg", {}).get("layers"), (list, tuple)):
        return Family("ResNet CLIP", "ModifiedResNet", "its image tower is a ResNet (ModifiedResNet), not a ViT; only ViT towers have patch tokens to re-attend")
    return None


def _clipa(name: str, config: dict) -> Family | None:
    vision = config.get("vision_cfg", {})
    if timm_model_name(config) is None and (vision.get("pool_type", "tok") != "tok" or vision.get("attentional_pool") or vision.get("final_ln_after_pool")):
        return Family("CLIPA", "open_clip", "its image tower pools by average after the final norm (CLIPA); its dense path is not built")
    return None


def _metaclip2(name: str, config: dict) -> Family | None:
    if timm_model_name(config) is None and "worldwide" in name:
        return Family("MetaCLIP 2", OPEN_CLIP_VIT, wrap=OpenClipViT.of)
    return None


def _clip_vit(name: str, config: dict) -> Family | None:
    return Family("CLIP ViT", OPEN_CLIP_VIT, wrap=OpenClipViT.of) if timm_model_name(config) is None else None


register_family("HF text encoder", _hf_text, help="refused: a Hugging Face transformers text tower")
register_family("CoCa", _coca, help="refused: CoCa's attention pool into a captioning decoder")
register_family("ResNet CLIP", _resnet, help="refused: a ModifiedResNet image tower")
register_family("CLIPA", _clipa, help="refused: average pooling after the final norm")
register_family("MetaCLIP 2", _metaclip2, help="open_clip VisionTransformer, `worldwide` configurations")
register_family("CLIP ViT", _clip_vit, fallback=True, help="any other open_clip VisionTransformer")
