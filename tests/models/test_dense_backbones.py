"""Dense foundation backbones (C-RADIOv3, DINOv3, DINOv2-L) and whole-image proxy features (CorrCLIPv2).

Tiny random timm models of the registered architectures stand in for the real ones (no weights here); the
expected values follow the published extraction (zdk258/CorrCLIP@103bc18 CorrCLIPv2/vfms/factory.py
`extract_dense`, NVlabs/RADIO radio/radio_model.py `forward` and `get_nearest_supported_resolution`) written
with timm's `forward_features`, a different path from the code under test (`forward_intermediates`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import window_run
from clipseg_sparse.models.backbones import BACKBONES, Backbone, load_backbone
from clipseg_sparse.models.proxies import split_ext, window_image_features
from clipseg_sparse.segment.windows import iter_window_features

def tiny_radio() -> Backbone:
    """A 2-block NaFlexViT in C-RADIOv3's layout (CLS + registers, CPE positions, no final norm)."""
    import timm.models.naflexvit as nf

    torch.manual_seed(1)
    model = nf.NaFlexVit(cfg=nf._radio_vit_cfg(embed_dim=32, depth=2, num_heads=2, reg_tokens=3), num_classes=0)
    return Backbone(BACKBONES.get("c_radio_v3_l"), model)


def tiny_dinov3() -> Backbone:
    import timm

    torch.manual_seed(2)
    model = timm.create_model("vit_small_patch16_dinov3", pretrained=False, num_classes=0, dynamic_img_size=True, embed_dim=32, depth=2, num_heads=2)
    return Backbone(BACKBONES.get("dinov3_vitl16"), model)


def published_extract_dense(backbone: Backbone, rgb: np.ndarray) -> torch.Tensor:
    """extract_dense transcribed: RADIO [0, 1] -> nearest supported size (round(H / 16) * 16) -> conditioner
    (mean/std) -> patch tokens of forward_features without the prefix; DINO: ToTensor + Normalize, resize to
    the nearest patch multiple, get_intermediate_layers (final norm) reshaped. 1 x C x h x w."""
    m, info = backbone.model, backbone.info
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255.0
    H, W = x.shape[-2:]
    step = info.patch_size
    size = (max(int(round(H / step) * step), step), max(int(round(W / step) * step), step))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (info.mean, info.std))
    if info.name.startswith("c_radio"):
        x = (F.interpolate(x, size, mode="bilinear", align_corners=False) - mean) / std
    else:
        x = F.interpolate((x - mean) / std, size, mode="bilinear", align_corners=False)
    with torch.no_grad():
        y = m.forward_features(x)  # RADIO: model.norm is Identity (its final norm is dropped); DINOv3: normed
    grid = (size[0] // step, size[1] // step)
    return y[:, m.num_prefix_tokens :].transpose(1, 2).reshape(1, -1, *grid)


def test_ls_backbones_lists_radio_dinov3_and_dinov2_large():
    names = set(BACKBONES.names())
    assert {"c_radio_v3_b", "c_radio_v3_l", "c_radio_v3_h", "dinov3_vits16", "dinov3_vitb16", "dinov3_vitl16", "dinov2_vitl14_reg"} <= names
    radio, dino = BACKBONES.get("c_radio_v3_l"), BACKBONES.get("dinov3_vitl16")
    assert radio.timm_name == "naflexvit_large_patch16_radio_v3.c_radio" and radio.mean == (0.48145466, 0.4578275, 0.40821073)
    assert dino.timm_name == "vit_large_patch16_dinov3.lvd1689m" and dino.final_norm and not radio.final_norm
    from typer.testing import CliRunner

    from clipseg_sparse.cli import app

    out = CliRunner().invoke(app, ["ls", "backbones"], env={"COLUMNS": "300"})
    assert out.exit_code == 0 and "c_radio_v3_l" in out.output and "dinov3_vitl16" in out.output


@pytest.mark.parametrize("make", [tiny_radio, tiny_dinov3])
@pytest.mark.parametrize("shape", [(37, 53), (64, 48), (8, 90)])
def test_whole_image_features_equal_the_published_extraction(make, shape):
    backbone = make()
    rgb = np.random.default_rng(3).integers(0, 256, (*shape, 3), dtype=np.uint8)
    size = (48, 72)
    got = backbone.image_features(torch.from_numpy(rgb), size)
    expected = F.normalize(F.interpolate(published_extract_dense(backbone, rgb), size, mode="bilinear", align_corners=False), dim=1)
    assert got.shape == (1, 32, *size)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_supported_size_rounds_like_radio():
    bb = tiny_radio()
    assert bb.supported_size(375, 500) == (368, 496)  # 23.4 -> 23, 31.25 -> 31
    assert bb.supported_size(8, 7) == (16, 16)  # at least one patch
    assert bb.supported_size(24, 40) == (32, 32)  # Python's round: 1.5 -> 2, 2.5 -> 2


def test_random_weights_build_the_registered_architectures():
    bb = load_backbone("dinov3_vits16", None, device="cpu")
    feats = bb.feature_map(torch.zeros(1, 3, 48, 80))
    assert feats.shape == (1, 384, 3, 5)
    assert bb.features(torch.zeros(1, 3, 48, 80)).tokens.shape == (1, 15, 384)


def test_image_feature_tap_needs_a_dense_backbone():
    assert split_ext("c_radio_v3_l.image") == ("c_radio_v3_l", "image")
    with pytest.raises(ValueError, match="dense backbone"):
        split_ext("dino_vitb8.image")
    with pytest.raises(ValueError, match="no last-block q/k"):
        split_ext("c_radio_v3_l.qk")


def published_window_features(raw: torch.Tensor, size, box, pad, grid) -> torch.Tensor:
    """CorrCLIPv2's forward_slide on the whole-image features, transcribed: the raw map resized to the input and
    L2-normalised, the window's crop (negative pads cut, positive ones replicate the border), resized to the grid
    and L2-normalised: M x C."""
    y1, y2, x1, x2 = box
    full = F.normalize(F.interpolate(raw, size=size, mode="bilinear", align_corners=False), dim=1)
    crop = F.pad(full[..., y1:y2, x1:x2], tuple(min(p, 0) for p in pad))
    if max(pad) > 0:
        crop = F.pad(crop, tuple(max(p, 0) for p in pad), mode="replicate")
    return F.normalize(F.interpolate(crop, grid, mode="bilinear", align_corners=False).flatten(2).transpose(1, 2), dim=-1)[0]


@pytest.mark.parametrize(
    "size, box, pad, grid",
    [
        ((448, 597), (0, 336, 112, 448), (0, 0, 0, 0), (42, 42)),  # CorrCLIPv2's 336 windows at short side 448, 2 x 21
        ((448, 597), (112, 448, 261, 597), (0, 0, 0, 0), (42, 42)),
        ((40, 72), (18, 40, 36, 72), (0, 12, 0, 26), (6, 6)),  # padded bottom / right to whole patches
        ((40, 72), (4, 40, 0, 36), (-2, -3, -1, -4), (5, 4)),  # remainder drop: cut
        ((40, 72), (0, 40, 0, 72), (3, 1, 2, 5), (7, 9)),  # upsampling, padding on every side
    ],
)
def test_window_features_read_only_the_pixels_their_grid_needs(size, box, pad, grid):
    """`ext:NAME.image` without the C x H x W map at the input size (C-RADIOv3-L: 1.1 GB) or its crops: each
    window's grid computed from the input-size pixels its bilinear taps read equals the published path."""
    from clipseg_sparse.models.proxies import WholeImageFeatures

    raw = torch.randn(1, 16, max(size[0] // 16, 3), max(size[1] // 16, 4), generator=torch.Generator().manual_seed(sum(box)))
    got = WholeImageFeatures(raw, size).windows([box], pad).at(grid)
    assert got.shape == (1, 1, grid[0] * grid[1], 16)
    torch.testing.assert_close(got[0, 0], published_window_features(raw, size, box, pad, grid), atol=2e-6, rtol=0)
    if pad == (0, 0, 0, 0):  # the crop given as a tensor (`attention_maps`' context) reads the same
        y1, y2, x1, x2 = box
        crop = F.normalize(F.interpolate(raw, size=size, mode="bilinear", align_corners=False), dim=1)[..., y1:y2, x1:x2]
        torch.testing.assert_close(window_image_features(crop, grid), got, atol=2e-6, rtol=0)


def test_windows_forward_hands_each_batch_its_crops(tiny_clip, monkeypatch):
    """Each batch of windows gets its boxes of the whole-image features and the padding of its crops (bottom /
    right to whole patches, replicating the border as the published forward_slide)."""
    from clipseg_sparse.attention import resolve_spec
    from clipseg_sparse.models.proxies import WholeImageFeatures

    whole = WholeImageFeatures(torch.randn(1, 5, 10, 18), (40, 72))
    pixels = torch.randn(1, 3, 40, 72)
    captured = []
    encode_dense = type(tiny_clip).encode_dense

    def spy(self, crops, spec, *args, context=None, regions=None, **kw):
        captured.append(context["image_features"]["x"])
        return encode_dense(self, crops, spec, *args, context=context, regions=regions, **kw)

    monkeypatch.setattr(type(tiny_clip), "encode_dense", spy)
    windows = iter_window_features(window_run(tiny_clip, pixels, resolve_spec("sclip"), image_features={"x": whole}, window=36, stride=18, batch_size=2))
    boxes = [b for chunk, _ in windows for b in chunk]
    assert len(boxes) == 6 and [b for c in captured for b in c.boxes] == boxes
    assert all(c.source is whole and c.pad == (0, 12, 0, 12) for c in captured)  # 36 x 36 windows, padded to 48 x 48
    for (y1, y2, x1, x2), feats in zip(boxes, torch.cat([c.at((6, 6)) for c in captured])):
        expected = published_window_features(whole.raw, (40, 72), (y1, y2, x1, x2), (0, 48 - (x2 - x1), 0, 48 - (y2 - y1)), (6, 6))
        torch.testing.assert_close(feats[0], expected, atol=2e-6, rtol=0)
