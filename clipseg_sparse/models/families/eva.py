"""EVA-02 and EVA-01 (timm `Eva`): CLS pooling, 2-D RoPE on the patch tokens, SwiGLU MLPs; EVA-02 projects
q, k, v separately and normalises inside its attention (`scale_attn_inner`), EVA-01 packs them with q and v
biases. Both run through the timm adapter (`timm_tower.py`); every spec but DnA's runs on them."""

from __future__ import annotations

from ..tower import register_family
from .timm_tower import timm_family

register_family("EVA-02", timm_family("EVA-02", lambda timm_name, name: timm_name.startswith("eva02_")), help="timm Eva (EVA-02)")
register_family("EVA-01", timm_family("EVA-01", lambda timm_name, name: timm_name.startswith("eva_")), help="timm Eva (EVA-01)")
