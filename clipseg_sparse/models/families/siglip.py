"""SigLIP and SigLIP 2 (timm `VisionTransformer`s named `*siglip*`): no CLS token, absolute positions without
prefix entries, and an attention-pooling ("MAP") head that each dense feature goes through per token, as
MaskCLIP reads CLIP's attention pool. Runs through the timm adapter (`timm_tower.py`); without a CLS token
it refuses `mct:BETA` and `cls:C` for C != 0 (`cls:0` runs), and DnA as every timm tower does."""

from __future__ import annotations

from ..tower import register_family
from .timm_tower import timm_family

register_family("SigLIP 2", timm_family("SigLIP 2", lambda timm_name, name: "siglip" in timm_name and "SigLIP2" in name), help="timm VisionTransformer with a MAP head (SigLIP 2)")
register_family("SigLIP", timm_family("SigLIP", lambda timm_name, name: "siglip" in timm_name), help="timm VisionTransformer with a MAP head (SigLIP)")
