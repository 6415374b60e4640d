"""Shared fixtures: small random-init open_clip models (no weights can be downloaded in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Never let a test wait on the network for weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).parent / "data"
TINY_CONFIG = str(DATA / "tiny-vit.json")


@pytest.fixture(scope="session")
def tiny_clip():
    """A 3-block, width-96 ViT/16 with a 64x64 native grid of 4x4 patches, random weights."""
    from clipseg_sparse import load_clip

    torch.manual_seed(0)
    return load_clip(TINY_CONFIG, pretrained=None, device="cpu")


@pytest.fixture(scope="session")
def vit_b16():
    from clipseg_sparse import load_clip

    torch.manual_seed(0)
    return load_clip("ViT-B-16", pretrained=None, device="cpu")


@pytest.fixture
def forward_inputs(monkeypatch):
    """A list of (pixels, pos_interp) that every image forward of DenseCLIP then receives (`_embed` is
    where encode_dense, dense_tokens and attention_maps all start)."""
    from clipseg_sparse.models.clip import DenseCLIP

    seen, real = [], DenseCLIP._embed

    def spy(self, pixels, pos_interp="size"):
        seen.append((pixels.clone(), pos_interp))
        return real(self, pixels, pos_interp)

    monkeypatch.setattr(DenseCLIP, "_embed", spy)
    return seen


def tiny_sam(img_size: int, window_size: int):
    """A 2-block, width-32 timm SAM image encoder (the second block global, relative positions drawn at
    random so they matter), random weights from the current RNG state, in eval mode; SAM's LayerNorm eps
    1e-6, as `sam_vitb` is built."""
    import timm.models.vision_transformer_sam as vs

    from clipseg_sparse.models.backbones import BACKBONES

    model = vs.VisionTransformerSAM(
        img_size=img_size, patch_size=16, embed_dim=32, depth=2, num_heads=2, window_size=window_size, global_attn_indexes=(1,),
        use_rel_pos=True, neck_chans=16, num_classes=0, **BACKBONES.get("sam_vitb").timm_kwargs(),
    ).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.rel_pos_h.normal_()
            blk.attn.rel_pos_w.normal_()
    return model
