"""Trident against its published code (YuHengsss/Trident@a93b346), transcribed here in plain torch.

Each `published_*` function below copies one published function line for line (names kept), with only
what has to change to run here: `seg_utils/utils.py` `preprocess_image` and `sam_refinement` (with
`split_connected_regions`, `map_refinement_coarse`, `map_failed_regions`; skimage's `measure.label(...,
connectivity=2)` is cv2's 8-connected labelling, as skimage is not installed), `open_clip/transformer.py`
`get_sam_sim`, and SAM's image encoder (segment_anything's own `ImageEncoderViT`, run with the weights our
timm `sam_vitb` gets, as Trident's `get_sam_feat` reads it).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from clipseg_sparse.models.backbones import BACKBONES, Backbone
from clipseg_sparse.segment.preprocess import prepare, rounded_size

ROOT = Path(__file__).resolve().parents[1]


# -- published: seg_utils/utils.py ---------------------------------------------------------------------
def published_preprocess_image(image, stride=16, slide_crop=336):
    longer_side = max(image.shape[2:])
    h, w = image.shape[2:]
    if h % stride == 0 and w % stride == 0:
        return image
    if longer_side % stride != 0:
        dst_longer = (longer_side // stride + 1) * stride
    else:
        dst_longer = longer_side
    new_h = int(h * dst_longer / longer_side)
    new_w = int(w * dst_longer / longer_side)
    if new_h % stride != 0:
        new_h = (new_h // stride + 1) * stride
    if new_w % stride != 0:
        new_w = (new_w // stride + 1) * stride
    new_h, new_w = max(new_h, slide_crop), max(new_w, slide_crop)
    return torch.nn.functional.interpolate(image, (new_h, new_w), mode="bilinear", align_corners=False)


# -- item 1: the network input's size ------------------------------------------------------------------
@pytest.mark.parametrize("size", [(448, 597), (597, 448), (448, 448), (336, 500), (375, 500), (448, 683), (512, 683), (688, 1376), (400, 401)])
def test_size_rule_longer_is_preprocess_image(size):
    x = torch.randn(1, 3, *size)
    want = published_preprocess_image(x)
    got = rounded_size(*size, 16, 336, "longer")
    assert got == tuple(want.shape[-2:])
    from clipseg_sparse.segment.preprocess import round_up_pixels

    torch.testing.assert_close(round_up_pixels(x, 16, 336, "longer"), want, atol=0, rtol=0)


def test_size_rules_differ_where_the_issue_says():
    assert rounded_size(448, 597, 16, 336, "longer") == (464, 608)
    assert rounded_size(448, 597, 16, 336, "each") == (448, 608)
    with pytest.raises(ValueError, match="unknown size rule"):
        rounded_size(448, 597, 16, 336, "both")


def test_trident_protocol_prepares_the_published_network_input(tiny_clip):
    """`prepare` under the trident protocol: mmseg's keep-ratio Resize (2048, 448) by cv2 on the uint8
    image, CLIP's normalisation (the data preprocessor), then preprocess_image."""
    import cv2

    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    settings = PROTOCOLS.get("trident").settings("voc21")
    assert (settings.size_rule, settings.resize, settings.pos_interp) == ("longer", "opencv", "scale")
    img = np.random.default_rng(0).integers(0, 256, (375, 500, 3), dtype=np.uint8)  # VOC's most common size
    resized = cv2.resize(img, (597, 448), interpolation=cv2.INTER_LINEAR)  # mmcv: scale = 448 / 375
    mean, std = torch.tensor(tiny_clip.mean).view(1, 3, 1, 1) * 255, torch.tensor(tiny_clip.std).view(1, 3, 1, 1) * 255
    src = (torch.from_numpy(resized).permute(2, 0, 1)[None].float() - mean) / std
    want = published_preprocess_image(src)
    got = prepare(img, tiny_clip, settings, splices=True)
    assert tuple(got.shape[-2:]) == (464, 608)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# -- item 2: SAM's image encoder and the backbones' LayerNorm eps ---------------------------------------
def published_sam_encoder(img_size=128, window_size=4):
    """segment_anything's ImageEncoderViT as build_sam builds it (LayerNorm eps 1e-6), tiny: 2 blocks of
    width 32, the second global; random weights with relative positions drawn so they matter and a small
    patch embedding, so the token norms are small and LayerNorm's eps shows."""
    from segment_anything.modeling import ImageEncoderViT

    torch.manual_seed(0)
    enc = ImageEncoderViT(
        img_size=img_size, patch_size=16, embed_dim=32, depth=2, num_heads=2, out_chans=16, qkv_bias=True,
        norm_layer=partial(nn.LayerNorm, eps=1e-6), use_rel_pos=True, window_size=window_size, global_attn_indexes=(1,),
    ).eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "rel_pos" in name:
                p.normal_()
            if name.startswith("patch_embed") or name == "pos_embed":
                p.mul_(0.01)
    return enc


def timm_sam_from(sam_state: dict, img_size: int, window_size: int, neck: int, **kwargs) -> torch.nn.Module:
    """timm's SAM encoder with the registered `sam_vitb` construction (its timm_kwargs), loaded from a
    segment_anything state dict (`image_encoder.` keys) by timm's own converter."""
    import timm.models.vision_transformer_sam as vs

    kwargs = {**BACKBONES.get("sam_vitb").timm_kwargs(), **kwargs}
    model = vs.VisionTransformerSAM(
        img_size=img_size, patch_size=16, embed_dim=32, depth=2, num_heads=2, window_size=window_size, global_attn_indexes=(1,),
        use_rel_pos=True, neck_chans=neck, num_classes=0, **kwargs,
    ).eval()
    model.load_state_dict(vs.checkpoint_filter_fn(sam_state, model), strict=True)
    return model


def test_sam_vitb_equals_segment_anythings_encoder():
    """Neck output, and the last block's softmax attention and values as Trident's patched SAM returns
    them (`last_attn`, `last_v`: SAM's own `add_decomposed_rel_pos`), from the same weights."""
    from segment_anything.modeling.image_encoder import add_decomposed_rel_pos

    enc = published_sam_encoder()
    state = {f"image_encoder.{k}": v for k, v in enc.state_dict().items()}
    info = dataclasses.replace(BACKBONES.get("sam_vitb"), input_size=128)
    x = torch.randn(1, 3, 128, 128)
    captured = {}
    hook = enc.blocks[-1].attn.qkv.register_forward_hook(lambda m, i, o: captured.setdefault("qkv", o))
    with torch.no_grad():
        neck = enc(x)
    hook.remove()
    a = enc.blocks[-1].attn
    B, H, W, _ = captured["qkv"].shape
    q, k, v = captured["qkv"].reshape(B, H * W, 3, a.num_heads, -1).permute(2, 0, 3, 1, 4).reshape(3, B * a.num_heads, H * W, -1).unbind(0)
    attn = add_decomposed_rel_pos((q * a.scale) @ k.transpose(-2, -1), q, a.rel_pos_h, a.rel_pos_w, (H, W), (H, W)).softmax(-1)

    ours = Backbone(info, timm_sam_from(state, 128, 4, 16)).features(x, want=("tokens", "qkv", "attn"))
    torch.testing.assert_close(ours.tokens, neck.flatten(2).transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.attn[0], attn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.v[0], v, atol=1e-5, rtol=1e-5)
    # timm's default (torch's eps 1e-5) is what the test catches: far off on these small tokens
    default = Backbone(info, timm_sam_from(state, 128, 4, 16, norm_layer=nn.LayerNorm)).features(x)
    assert (default.tokens - neck.flatten(2).transpose(1, 2)).abs().max() > 0.1


# the published LayerNorm eps per registered backbone: DINO `vision_transformer.py` vit_base
# (facebookresearch/dino@04c0ad9: norm_layer=partial(nn.LayerNorm, eps=1e-6)), DINOv2
# `DinoVisionTransformer` (facebookresearch/dinov2@027a9ac: norm_layer = partial(nn.LayerNorm, eps=1e-6)),
# SAM `build_sam._build_sam` (norm_layer=partial(torch.nn.LayerNorm, eps=1e-6); LayerNorm2d 1e-6 in its neck)
PUBLISHED_EPS = {"dino_vitb8": 1e-6, "dino_vitb16": 1e-6, "dinov2_vitb14_reg": 1e-6, "sam_vitb": 1e-6}


@pytest.mark.parametrize("name", sorted(PUBLISHED_EPS))
def test_backbones_are_built_with_the_published_layernorm_eps(name):
    import timm

    info = BACKBONES.get(name)
    model = timm.create_model(info.timm_name, pretrained=False, num_classes=0, device="meta", **info.timm_kwargs())
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm) or type(m).__name__ == "LayerNorm2d"}
    assert eps == {PUBLISHED_EPS[name]}


# -- item 5: encode_dense with ext: taps on a fresh CLIP -------------------------------------------------
def test_encode_dense_with_a_proxy_needs_no_earlier_segmenter(tmp_path):
    """In a fresh interpreter, offline: a random CLIP's `encode_dense(x, "proxyclip")` runs DINO with random
    weights (its own weights decide "auto"), and weights pinned on the CLIP that are missing give the
    one-line error, before any Segmenter exists."""
    code = (
        "import torch\n"
        "from clipseg_sparse import load_clip\n"
        "from clipseg_sparse.runtime.weights import WeightsUnavailableError\n"
        f"clip = load_clip({str(ROOT / 'tests' / 'data' / 'tiny-vit.json')!r}, pretrained=None, device='cpu')\n"
        "print('SHAPE', tuple(clip.encode_dense(torch.randn(1, 3, 64, 64), 'proxyclip').shape))\n"
        f"clip.proxy_weights = 'dino_vitb8={tmp_path / 'dino.pth'}'\n"
        "try:\n    clip.encode_dense(torch.randn(1, 3, 64, 64), 'proxyclip')\n"
        "except WeightsUnavailableError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[0] == "SHAPE (1, 8, 8, 64)", out.stdout + out.stderr
    assert len(lines) == 2 and lines[1].startswith("ERR ") and "dino.pth: backbone checkpoint file not found" in lines[1]
