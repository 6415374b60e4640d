"""PE-Core (Perception Encoder, timm `vit_pe_core_*`): a CLS token, 2-D RoPE, packed q/k/v with q and v
biases, and an attention-pooling head that each dense feature goes through per token. Runs through the timm
adapter (`timm_tower.py`); every spec but DnA's runs on it."""

from __future__ import annotations

from ..tower import register_family
from .timm_tower import timm_family

register_family("PE-Core", timm_family("PE-Core", lambda timm_name, name: timm_name.startswith("vit_pe_core_")), help="timm Eva (PE-Core)")
