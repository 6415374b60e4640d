"""ProxyCLIP through the engine (`ext:` tap): equals a transcription of the published forward.

A tiny random CLIP (tests/data/tiny-vit.json, patch 16) and a tiny random DINO-layout ViT (patch 8)
stand in for ViT-B/16 and DINO ViT-B/8; the backbone is installed with `conftest.installed_backbones`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from conftest import TINY_CONFIG, installed_backbones, window_run
from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.models.backbones import BACKBONES, Backbone
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.windows import dense_cosine
from clipseg_sparse.models.proxies import proxy_grid

TINY_TEXT = "ext:dino_vitb8[cos,shift:1.2,scale:3,pos]/{}/cls:0/noffn"


def installed_tiny_dino(clip):
    """A tiny DINO-layout backbone (patch 8) registered as dino_vitb8 on the CPU for `clip`, removed after
    (a generator for fixtures: yields (clip, backbone))."""
    import timm.models.vision_transformer as vt

    torch.manual_seed(0)
    model = vt.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True)
    backbone = Backbone(BACKBONES.get("dino_vitb8"), model, weights="none")
    with installed_backbones(backbone, clips=[clip]):
        yield clip, backbone


@pytest.fixture(scope="module")
def proxy(tiny_clip):
    """tiny CLIP + a tiny DINO-layout backbone registered as dino_vitb8 on the CPU (removed after)."""
    yield from installed_tiny_dino(tiny_clip)


def published_proxyclip(clip, backbone, pixels: torch.Tensor, beta=1.2, gamma=3.0) -> torch.Tensor:
    """ProxyCLIP's VisionTransformer.forward with ex_feats (mc-lan/ProxyCLIP open_clip/transformer.py),
    one image: B x I x J x D normalised features. Written with plain torch ops, batch 1."""
    v = clip.visual
    p = 16
    _, _, H, W = pixels.shape
    mean, std = torch.tensor(clip.mean).view(1, 3, 1, 1), torch.tensor(clip.std).view(1, 3, 1, 1)
    imgs_norm = ((pixels * std + mean) - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    feat = backbone.features(imgs_norm).tokens  # DINO get_intermediate_layers(x)[0][:, 1:] (checked in test_backbones)
    I, J = H // 8, W // 8
    ex_feats = feat.reshape(1, I, J, -1).permute(0, 3, 1, 2)
    x = v.conv1(pixels).reshape(1, v.conv1.out_channels, -1).permute(0, 2, 1)
    x = torch.cat([v.class_embedding.view(1, 1, -1), x], dim=1) + v.positional_embedding  # native 64 x 64 grid
    x = v.ln_pre(x)
    for blk in v.transformer.resblocks[:-1]:
        x = blk(x)
    blk = v.transformer.resblocks[-1]
    y = blk.ln_1(x)[0]  # L x C
    C = y.shape[-1]
    heads = blk.attn.num_heads
    q_k = F.normalize(ex_feats.flatten(2, 3), dim=1)
    similarity = torch.einsum("b c m, b c n -> b m n", q_k, q_k)
    similarity = (similarity - similarity.mean(dim=(1, 2), keepdim=True) * beta) * gamma
    similarity[similarity < 0.0] = float("-inf")
    attn_weights = F.softmax(similarity, dim=-1).repeat(heads, 1, 1)
    val = (y @ blk.attn.in_proj_weight[2 * C :].T + blk.attn.in_proj_bias[2 * C :]).view(-1, heads, C // heads).transpose(0, 1)
    val = val[:, 1:, :].reshape(heads, H // p, W // p, C // heads).permute(0, 3, 1, 2)
    val = F.interpolate(val, size=(I, J), mode="bilinear", align_corners=False).permute(0, 2, 3, 1).reshape(heads, I * J, -1)
    out = torch.bmm(attn_weights, val).transpose(0, 1).reshape(I * J, C)
    out = blk.attn.out_proj(out)
    out = v.ln_post(out) @ v.proj
    return F.normalize(out, dim=-1).reshape(1, I, J, -1)


def test_proxyclip_preset_equals_the_published_forward(proxy):
    clip, backbone = proxy
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, 64, 64)
    got = clip.encode_dense(pixels, "proxyclip")
    assert got.shape == (1, 8, 8, clip.embed_dim)  # the DINO grid, not CLIP's 4 x 4
    with torch.no_grad():
        expected = published_proxyclip(clip, backbone, pixels)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_attention_equals_the_formula_by_hand(proxy):
    clip, backbone = proxy
    torch.manual_seed(2)
    pixels = torch.randn(1, 3, 32, 32)
    maps = clip.attention_maps(pixels, "proxyclip")  # B x heads x M x M
    feats = backbone.features(backbone.from_clip_pixels(pixels, clip.mean, clip.std)).tokens[0].tolist()
    M = len(feats)
    cos = [[sum(a * b for a, b in zip(feats[i], feats[j])) / math.sqrt(sum(a * a for a in feats[i]) * sum(b * b for b in feats[j])) for j in range(M)] for i in range(M)]
    mean = sum(map(sum, cos)) / M**2
    for i in range(M):
        row = [(c - 1.2 * mean) * 3 for c in cos[i]]
        e = [math.exp(r) if r >= 0 else 0.0 for r in row]
        expected = torch.tensor([x / sum(e) for x in e])
        for h in range(maps.shape[1]):
            torch.testing.assert_close(maps[0, h, i], expected, atol=1e-6, rtol=1e-4)


def test_entmax_to_one_equals_proxyclip_and_keeps_the_support(proxy):
    clip, _ = proxy
    torch.manual_seed(3)
    pixels = torch.randn(2, 3, 32, 48)
    soft = clip.attention_maps(pixels, "proxyclip")
    torch.testing.assert_close(clip.attention_maps(pixels, TINY_TEXT.format("entmax:1.0005")), soft, atol=1e-3, rtol=0)
    torch.testing.assert_close(clip.encode_dense(pixels, TINY_TEXT.format("entmax:1.0005")), clip.encode_dense(pixels, "proxyclip"), atol=2e-3, rtol=0)
    sparse = clip.attention_maps(pixels, "proxyclip-entmax")
    assert ((sparse > 0) <= (soft > 0)).all() and (sparse == 0).sum() > (soft == 0).sum()
    torch.testing.assert_close(sparse.sum(-1), torch.ones_like(sparse[..., 0]))


def test_qk_tap_is_the_cosine_of_q_plus_k(proxy):
    """ext:NAME.qk (CorrCLIP's features): q + k of the backbone's last block, heads concatenated."""
    clip, backbone = proxy
    torch.manual_seed(6)
    pixels = torch.randn(1, 3, 32, 32)
    maps = clip.attention_maps(pixels, "ext:dino_vitb8.qk[cos,scale:4]/softmax/cls:0/noffn")
    f = backbone.features(backbone.from_clip_pixels(pixels, clip.mean, clip.std), want=("qkv",))
    qk = (f.q + f.k)[0].transpose(0, 1).reshape(16, -1)  # M x (heads * d)
    expected = torch.softmax(4 * F.normalize(qk, dim=-1) @ F.normalize(qk, dim=-1).T, dim=-1)
    torch.testing.assert_close(maps[0, 0], expected, atol=1e-6, rtol=1e-5)


def test_window_batching_does_not_change_results(proxy):
    clip, _ = proxy
    torch.manual_seed(4)
    crops = torch.randn(3, 3, 48, 48) + torch.tensor([0.0, 0.5, -0.5]).view(3, 1, 1, 1)
    batched = clip.encode_dense(crops, "proxyclip")
    for i in range(3):
        torch.testing.assert_close(batched[i : i + 1], clip.encode_dense(crops[i : i + 1], "proxyclip"), atol=1e-6, rtol=1e-5)


def test_sliding_windows_on_the_proxy_grid(proxy):
    """dense_cosine places each window's 2x finer map like a by-hand upsample-place-average."""
    clip, _ = proxy
    torch.manual_seed(5)
    pixels = torch.randn(1, 3, 64, 96)
    text = F.normalize(torch.randn(3, clip.embed_dim), dim=-1)
    got = dense_cosine(window_run(clip, pixels, "proxyclip", text, window=64, stride=32)).rows(0, 64)
    total, count = torch.zeros(3, 64, 96), torch.zeros(1, 64, 96)
    for x1 in (0, 32):
        feats = clip.encode_dense(pixels[..., x1 : x1 + 64], "proxyclip")[0]  # 8 x 8 x D
        cos = torch.einsum("hwd,nd->nhw", feats, text)
        total[:, :, x1 : x1 + 64] += F.interpolate(cos[None], size=(64, 64), mode="bilinear", align_corners=False)[0]
        count[:, :, x1 : x1 + 64] += 1
    torch.testing.assert_close(got, total / count, atol=1e-5, rtol=1e-4)


def test_proxy_grids_follow_each_backbone():
    assert proxy_grid("dino_vitb8", (336, 336)) == (42, 42)
    assert proxy_grid("dino_vitb16", (336, 224)) == (21, 14)
    assert proxy_grid("dinov2_vitb14_reg", (336, 336)) == (24, 24)
    assert proxy_grid("sam_vitb", (336, 336)) == (64, 64)
    assert proxy_grid("dino_vitb8.qk", (64, 64)) == (8, 8)


def test_bad_ext_specs_are_one_line_errors(proxy):
    clip, _ = proxy
    for text, message in [
        ("ext:nope[cos]/softmax/cls:0", "unknown backbone 'nope'"),
        ("ext:sam2_hiera_l[cos]/softmax/cls:0", "makes region masks"),
        ("ext:dino_vitb8.v[cos]/softmax/cls:0", "unknown feature 'v'"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            AttentionSpec.parse(text)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="need cls:C"):
        clip.encode_dense(torch.randn(1, 3, 32, 32), "ext:dino_vitb8[cos,shift:1.2,scale:3,pos]/softmax/nores/noffn")
    with pytest.raises(ValueError, match="mixes terms on different token grids"):
        clip.encode_dense(torch.randn(1, 3, 32, 32), "ext:dino_vitb8[cos]+kk/softmax/cls:0/noffn")


def test_segmenter_records_the_backbone_and_segment_cli_accepts_the_preset(proxy, tmp_path):
    from clipseg_sparse.cli.app import app

    clip, _ = proxy
    seg = Segmenter(clip, "cat,dog", spec="proxyclip-entmax", settings=InferenceSettings(resolution=0, window=64, stride=32), templates="single")
    result = seg.predict(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    assert result.labels.shape == (64, 96)
    assert seg.config()["proxy_backbones"] == {"dino_vitb8": {"timm": "vit_base_patch8_224.dino", "weights": "none", "precision": "fp32"}}
    assert "proxy_backbones" not in Segmenter(clip, "cat,dog", spec="sclip", templates="single").config()

    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    res = CliRunner().invoke(app, [
        "segment", str(tmp_path / "a.png"), "--classes", "cat,dog", "--preset", "proxyclip-entmax", "--model", TINY_CONFIG,
        "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", "0", "--window", "64",
        "--stride", "32", "--out", str(tmp_path / "out"),
    ])
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "out" / "a.json").read_text())
    text = json.dumps(record)
    assert "ext:dino_vitb8" in text and "vit_base_patch8_224.dino" in text


def test_eval_runs_the_proxyclip_protocol(proxy, tmp_path):
    from fake_benchmarks import make_benchmark

    from clipseg_sparse.cli.app import app

    make_benchmark("voc21", tmp_path / "voc", n=2, size=(40, 56))
    out = tmp_path / "voc.json"
    res = CliRunner().invoke(app, [
        "eval", "--dataset", "voc21", "--root", str(tmp_path / "voc"), "--protocol", "proxyclip", "--model", TINY_CONFIG,
        "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", "64", "--window", "64",
        "--stride", "32", "--out", str(out),
    ], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "ext:dino_vitb8[cos,shift:1.2,scale:3,pos]/softmax/cls:0/noffn" in text and "vit_base_patch8_224.dino" in text
    assert '"bg_threshold": 0.2' in text and '"logit_scale": 40.0' in text


def test_missing_proxy_weights_stop_the_cli_with_one_line(proxy, tmp_path):
    from clipseg_sparse.cli.app import app

    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "a.png")
    res = CliRunner().invoke(app, [
        "segment", str(tmp_path / "a.png"), "--classes", "cat,dog", "--preset", "proxyclip", "--model", TINY_CONFIG,
        "--pretrained", "none", "--device", "cpu", "--templates", "single", "--proxy-weights", str(tmp_path / "dino.pth"),
        "--out", str(tmp_path / "out"),
    ], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "dino.pth: backbone checkpoint file not found" in lines[0]
    assert not (tmp_path / "out" / "a.json").exists()


def test_two_segmenters_with_other_backbone_weights_each_use_their_own(proxy):  # noqa: F811
    """The backbones belong to a run (`Resources`), not to the process: a segmenter built later with other
    DINO weights changes nothing for one built before (the last one built used to decide for all), and each
    records its own weights."""
    import timm.models.vision_transformer as vt

    from clipseg_sparse.models.proxies import ProxyBackbones
    from clipseg_sparse.segment.resources import Resources

    clip, tiny = proxy
    torch.manual_seed(9)
    model = vt.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True)
    weights = {"a.pth": Backbone(BACKBONES.get("dino_vitb8"), tiny.model, weights="a.pth"), "b.pth": Backbone(BACKBONES.get("dino_vitb8"), model, weights="b.pth")}
    runs = {}
    for name, backbone in weights.items():
        backbones = ProxyBackbones.following(clip, name)
        backbones.use(backbone, "cpu")
        runs[name] = Resources(backbones=backbones)
    img = np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    settings = InferenceSettings(resolution=48, window=32, stride=16)
    first = Segmenter(clip, "cat,dog,sky", "proxyclip", settings, templates="single", resources=runs["a.pth"])
    before = first.predict(img).probs
    second = Segmenter(clip, "cat,dog,sky", "proxyclip", settings, templates="single", resources=runs["b.pth"])
    assert not np.allclose(second.predict(img).probs, before, atol=1e-4)
    assert np.array_equal(first.predict(img).probs, before)
    assert [s.config()["proxy_backbones"]["dino_vitb8"]["weights"] for s in (first, second)] == ["a.pth", "b.pth"]
