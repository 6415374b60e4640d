"""Backbone registry and feature extraction (random weights, tiny timm configs, small inputs).

The DINO reference below follows facebookresearch/dino vision_transformer.py (prepare_tokens,
interpolate_pos_encoding, Block, get_intermediate_layers) line by line on the same weights; it shares
no code with clipseg_sparse.models.backbones.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_sam

from clipseg_sparse.models.backbones import BACKBONES, Backbone, BackboneInfo, load_backbone

from clipseg_sparse.runtime.weights import MissingExtraError, require_extra
from clipseg_sparse.runtime.weights import WeightsUnavailableError

ROOT = Path(__file__).resolve().parents[2]


def tiny_vit(**kw):
    import timm.models.vision_transformer as vt

    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True)
    args.update(kw)
    model = vt.VisionTransformer(**args).eval()
    with torch.no_grad():  # random, not the near-zero init, so position interpolation errors show
        model.pos_embed.normal_()
        model.cls_token.normal_()
    return model


def dino_info(rule="dino", patch=8):
    return BackboneInfo("tiny", "vit", "tiny", patch, (0.5,) * 3, (0.25,) * 3, ("tokens", "qkv", "attn"), rule, "test")


def dino_reference(sd: dict, x: torch.Tensor, patch: int, heads: int, depth: int):
    """tokens (after norm), and q, k, attention of the last block, as the DINO repository computes them."""
    B, nc, w, h = x.shape
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch).flatten(2).transpose(1, 2)
    t = torch.cat((sd["cls_token"].expand(B, -1, -1), t), dim=1)
    pos = sd["pos_embed"]
    npatch, N, dim = t.shape[1] - 1, pos.shape[1] - 1, t.shape[-1]
    if npatch == N and w == h:
        pe = pos
    else:
        w0, h0 = w // patch + 0.1, h // patch + 0.1
        pp = torch.nn.functional.interpolate(
            pos[:, 1:].reshape(1, int(math.sqrt(N)), int(math.sqrt(N)), dim).permute(0, 3, 1, 2),
            scale_factor=(w0 / math.sqrt(N), h0 / math.sqrt(N)),
            mode="bicubic",
        )
        assert int(w0) == pp.shape[-2] and int(h0) == pp.shape[-1]
        pe = torch.cat((pos[:, 0].unsqueeze(0), pp.permute(0, 2, 3, 1).view(1, -1, dim)), dim=1)
    t = t + pe
    ln = lambda z, p: F.layer_norm(z, (dim,), sd[p + ".weight"], sd[p + ".bias"], eps=1e-6)  # noqa: E731
    for i in range(depth):
        p = f"blocks.{i}."
        y = ln(t, p + "norm1")
        n = y.shape[1]
        qkv = (y @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]).reshape(B, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5).softmax(dim=-1)
        t = t + ((attn @ v).transpose(1, 2).reshape(B, n, dim) @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"])
        hid = F.gelu(ln(t, p + "norm2") @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"])
        t = t + (hid @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"])
    return ln(t, "norm")[:, 1:], q[:, :, 1:], k[:, :, 1:], attn[:, :, 1:, 1:]


def test_registry_lists_the_published_backbones():
    assert set(BACKBONES.names()) >= {"dino_vitb8", "dino_vitb16", "dinov2_vitb14_reg", "sam_vitb", "sam2_hiera_l"}
    assert BACKBONES.get("dino_vitb8").timm_name == "vit_base_patch8_224.dino"
    assert BACKBONES.get("dino_vitb16").patch_size == 16 and BACKBONES.get("dinov2_vitb14_reg").patch_size == 14
    assert BACKBONES.get("sam_vitb").input_size == 1024
    assert BACKBONES.get("dino_vitb8").mean == (0.485, 0.456, 0.406)


@pytest.mark.parametrize("size", [(32, 32), (48, 48), (40, 56), (56, 40)])
def test_dino_rule_matches_dino_reference(size):
    model = tiny_vit()
    bb = Backbone(dino_info(), model)
    x = torch.randn(2, 3, *size)
    tokens, q, k, attn = dino_reference(model.state_dict(), x, 8, 2, 2)
    f = bb.features(x, want=("tokens", "qkv", "attn"))
    assert f.grid == (size[0] // 8, size[1] // 8)
    torch.testing.assert_close(f.tokens, tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f.q, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f.k, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f.attn, attn, atol=1e-6, rtol=1e-5)


def test_timm_resize_would_differ_from_dino():
    """Why the preset keeps DINO's rule: timm's antialiased exact-size resize gives other tokens."""
    model = tiny_vit()
    x = torch.randn(1, 3, 48, 48)
    tokens = dino_reference(model.state_dict(), x, 8, 2, 2)[0]
    timm_rule = Backbone(dino_info("antialias"), model).features(x).tokens
    assert (timm_rule - tokens).abs().max() > 1e-2


def test_real_dino_vitb8_architecture_matches_reference(tmp_path):
    bb = load_backbone("dino_vitb8", None, device="cpu")
    x = torch.randn(1, 3, 40, 48)
    f = bb.features(x, want=("tokens",))
    tokens = dino_reference(bb.model.state_dict(), x, 8, 12, 12)[0]
    assert f.tokens.shape == (1, 30, 768)
    torch.testing.assert_close(f.tokens, tokens, atol=1e-4, rtol=1e-4)
    assert bb.config() == {"backbone": "dino_vitb8", "timm": "vit_base_patch8_224.dino", "weights": "none", "precision": "fp32"}
    # a local checkpoint in the DINO release's key layout (the same names as timm's) loads through timm
    ckpt = tmp_path / "dino_vitbase8_pretrain.pth"
    torch.save({k: v * 0.5 if k == "pos_embed" else v for k, v in bb.model.state_dict().items()}, ckpt)
    loaded = load_backbone("dino_vitb8", str(ckpt), device="cpu")
    assert loaded.weights == str(ckpt)
    torch.testing.assert_close(loaded.model.pos_embed, bb.model.pos_embed * 0.5)


def test_dinov2_registers_follow_timm_dynamic_resize():
    """DINOv2-reg's hub code resizes exact-size with antialias (interpolate_offset 0), as timm does."""
    model = tiny_vit(img_size=28, patch_size=14, reg_tokens=4, no_embed_class=True, init_values=1e-5, dynamic_img_size=True)
    bb = Backbone(dino_info("antialias", 14), model)
    x = torch.randn(1, 3, 42, 56)
    expected = model.forward_features(x)[:, 5:]  # timm: norm applied, CLS + 4 registers dropped
    torch.testing.assert_close(bb.features(x).tokens, expected, atol=1e-5, rtol=1e-5)


def test_sam_features_match_timm_and_attention_reproduces_the_block():
    torch.manual_seed(0)
    model = tiny_sam(64, window_size=2)
    info = BackboneInfo("tinysam", "samvit", "tiny", 16, (0.5,) * 3, (0.25,) * 3, ("tokens", "qkv", "attn"), "fixed", "test", 64)
    bb = Backbone(info, model)
    x = torch.randn(1, 3, 64, 64)
    f = bb.features(x, want=("tokens", "qkv", "attn"))
    torch.testing.assert_close(f.tokens, model.forward_features(x).flatten(2).transpose(1, 2), atol=1e-5, rtol=1e-5)
    # the last block's own attention output equals proj(attn @ v) from the exposed maps
    with torch.no_grad():
        h = model.patch_embed(x) + model.pos_embed
        h = model.blocks[0](h)
        last = model.blocks[1]
        direct = last.attn(last.norm1(h))
    ours = last.attn.proj((f.attn @ f.v).transpose(1, 2).reshape(1, 16, 32)).view(1, 4, 4, 32)
    torch.testing.assert_close(ours, direct, atol=1e-5, rtol=1e-5)


def test_sam_windows_are_encoded_one_at_a_time_with_the_batchs_features(monkeypatch):
    """Memory: SAM's global blocks hold a window's 4096^2 scores per head, so windows go through one by one; each
    window's features equal its own forward (timm's batched forward_features)."""
    import clipseg_sparse.models.backbones as backbones

    torch.manual_seed(0)
    model = tiny_sam(64, window_size=2)
    info = BackboneInfo("tinysam", "samvit", "tiny", 16, (0.5,) * 3, (0.25,) * 3, ("tokens", "qkv", "attn"), "fixed", "test", 64)
    x = torch.randn(3, 3, 64, 64)
    sizes = []
    run = Backbone._sam_features
    monkeypatch.setattr(Backbone, "_sam_features", lambda self, px, want: sizes.append(len(px)) or run(self, px, want))
    f = Backbone(info, model).features(x, want=("tokens", "qkv", "attn"))
    assert sizes == [backbones.SAM_WINDOWS] * 3 and f.attn.shape[0] == f.q.shape[0] == f.tokens.shape[0] == 3 and f.penult is None
    torch.testing.assert_close(f.tokens, model.forward_features(x).flatten(2).transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_from_clip_pixels_renormalises_and_resizes_sam_input():
    bb = Backbone(dino_info(), tiny_vit())
    raw = torch.rand(1, 3, 8, 8)
    clip_mean, clip_std = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)
    clip_px = (raw - torch.tensor(clip_mean).view(1, 3, 1, 1)) / torch.tensor(clip_std).view(1, 3, 1, 1)
    torch.testing.assert_close(bb.from_clip_pixels(clip_px, clip_mean, clip_std), (raw - 0.5) / 0.25)


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(WeightsUnavailableError) as e:
        load_backbone("dino_vitb16", str(tmp_path / "nope.pth"), device="cpu")
    assert "\n" not in str(e.value) and "nope.pth" in str(e.value)


@pytest.mark.parametrize("name", ["dino_vitb16", "c_radio_v3_l"])
def test_offline_hub_weights_fail_fast_with_one_line(tmp_path, name):
    code = (
        "from clipseg_sparse.models.backbones import load_backbone\n"
        "from clipseg_sparse.models.clip import WeightsUnavailableError\n"
        f"try:\n    load_backbone({name!r}, 'hub', device='cpu')\n"
        "except WeightsUnavailableError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith(f"ERR could not obtain weights 'hub' for backbone {name}")
    assert "HF_HUB_OFFLINE" in lines[0]


def test_missing_extra_is_one_line():
    with pytest.raises(MissingExtraError) as e:
        require_extra("clipseg_sparse_no_such_package", "SAM2 region masks")
    assert "\n" not in str(e.value) and 'pip install -e ".[proxy]"' in str(e.value)


def test_missing_weights_reads_the_hub_cache_and_checkpoint_files_only(tmp_path, monkeypatch):
    """What the demo leaves out: Hub weights in the cache (its real layout) are there, others are missing
    while offline; a checkpoint file must exist; random weights always are. No network: HF_HUB_OFFLINE."""
    from types import SimpleNamespace

    from huggingface_hub import constants

    from clipseg_sparse.models.proxies import missing_weights

    repo = tmp_path / "models--timm--vit_base_patch8_224.dino"  # huggingface_hub's folder for timm/vit_base_patch8_224.dino
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "model.safetensors").write_bytes(b"weights")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = lambda weights: SimpleNamespace(pretrained="openai", proxy_weights=weights)  # noqa: E731

    missing = missing_weights(["dino_vitb8", "sam_vitb"], real("auto"))
    assert list(missing) == ["sam_vitb"]
    assert "timm/samvit_base_patch16.sa1b" in missing["sam_vitb"] and "HF_HUB_OFFLINE is set" in missing["sam_vitb"]
    sam = tmp_path / "sam_vit_b.pth"
    assert str(sam) in missing_weights(["dino_vitb8", "sam_vitb"], real(f"sam_vitb={sam}"))["sam_vitb"]
    sam.write_bytes(b"weights")
    assert missing_weights(["dino_vitb8", "sam_vitb"], real(f"sam_vitb={sam}")) == {}
    assert missing_weights(["dino_vitb8", "sam_vitb"], SimpleNamespace(pretrained="none", proxy_weights="auto")) == {}
    assert missing_weights(["dino_vitb8", "sam_vitb"], real("none")) == {}


def test_proxy_weights_from_the_hub_offline_use_the_fast_probe(monkeypatch, tmp_path):
    """Unreachable Hub: the download runs in huggingface_hub's offline mode (fails at once from the cache)
    instead of retrying for about a minute, and the message says the host is unreachable. A closed local
    port stands in for the Hub, so nothing is downloaded anywhere."""
    import huggingface_hub
    from huggingface_hub import constants

    from clipseg_sparse.models.backbones import BACKBONES, create_backbone_model
    from clipseg_sparse.runtime.weights import WeightsUnavailableError

    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")
    offline = []

    def download(*_a, **_k):
        offline.append(constants.HF_HUB_OFFLINE)
        raise OSError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(WeightsUnavailableError, match=r"127\.0\.0\.1 is unreachable .*--proxy-weights"):
        create_backbone_model(BACKBONES.get("dino_vitb16"), "hub", cache_dir=str(tmp_path))
    assert offline and all(offline)
