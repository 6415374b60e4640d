"""Trident (`trident` preset, `sam` global stage, `trident` protocol) against a plain re-implementation.

A tiny random CLIP (tests/data/tiny-vit.json, patch 16), a tiny DINO-layout ViT (patch 16, standing in
for DINO ViT-B/16) and a tiny random SAM image encoder (128-px input, 8 x 8 grid, standing in for SAM
ViT-B at 1024 px) are installed as `dino_vitb16` and `sam_vitb`. The reference below is written from
the published steps (research/peers-sota.md 2.7, YuHengsss/Trident trident.py) with plain torch: an
explicit loop over windows, a splice with a count array, SAM's preprocessing, the filtered attention
with full N x N cosine matrices.
"""

from __future__ import annotations

import dataclasses
import json

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from conftest import TINY_CONFIG, installed_backbones, tiny_sam, window_run
from clipseg_sparse.models.backbones import BACKBONES, Backbone
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.methods.trident import spliced_tokens

from clipseg_sparse.methods.trident import sam_attention

SAM_SIDE = 128
SETTINGS = InferenceSettings(resolution=0, window=48, stride=16, size_multiple=16)  # 50 x 70 -> 64 x 80: 2 x 3 windows


@pytest.fixture(scope="module")
def trident(tiny_clip):
    import timm.models.vision_transformer as vt

    torch.manual_seed(0)
    dino = vt.VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True).eval()
    sam = tiny_sam(SAM_SIDE, window_size=4)
    dino_bb = Backbone(BACKBONES.get("dino_vitb16"), dino)
    sam_bb = Backbone(dataclasses.replace(BACKBONES.get("sam_vitb"), input_size=SAM_SIDE), sam)
    with installed_backbones(dino_bb, sam_bb, clips=[tiny_clip]):
        yield tiny_clip, dino_bb, sam_bb


def image(seed=0, size=(50, 70)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


# -- the reference ------------------------------------------------------------------------------------
def ref_window(clip, dino: Backbone, crop: torch.Tensor, beta=1.2, gamma=3.0) -> torch.Tensor:
    """ProxyCLIP's last block on one CLIP-normalised window (1 x 3 x h x w) with DINO B/16 features on
    CLIP's grid: W_o(A V) before ln_post, h/16 x w/16 x C."""
    v = clip.visual
    gh, gw = crop.shape[-2] // 16, crop.shape[-1] // 16
    mean, std = torch.tensor(clip.mean).view(1, 3, 1, 1), torch.tensor(clip.std).view(1, 3, 1, 1)
    raw = crop * std + mean
    imnet = (raw - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    feat = F.normalize(dino.features(imnet).tokens[0], dim=-1)  # M x C_dino (tokens checked in test_backbones)
    sim = feat @ feat.T
    sim = (sim - beta * sim.mean()) * gamma
    sim[sim < 0] = float("-inf")
    attn = sim.softmax(-1)
    x = v.conv1(crop).flatten(2).transpose(1, 2)
    x = torch.cat([v.class_embedding.view(1, 1, -1), x], dim=1) + clip.positional_embedding((gh, gw))
    x = v.ln_pre(x)
    for blk in v.transformer.resblocks[:-1]:
        x = blk(x)
    blk = v.transformer.resblocks[-1]
    C, H = x.shape[-1], blk.attn.num_heads
    y = blk.ln_1(x)[0, 1:]  # CLS dropped
    val = (y @ blk.attn.in_proj_weight[2 * C :].T + blk.attn.in_proj_bias[2 * C :]).view(-1, H, C // H).transpose(0, 1)
    out = (attn[None] @ val).transpose(0, 1).reshape(-1, C)
    return blk.attn.out_proj(out).view(gh, gw, C)


def ref_splice(clip, dino, pixels: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """mmseg's window loop (last window shifted back inside), each window's output added at its patch
    corner, then divided by the count of windows covering each cell: H/16 x W/16 x C."""
    _, _, H, W = pixels.shape
    total = torch.zeros(H // 16, W // 16, clip.visual.transformer.width)
    count = torch.zeros(H // 16, W // 16, 1)
    for r in range(max(H - window + stride - 1, 0) // stride + 1):
        for c in range(max(W - window + stride - 1, 0) // stride + 1):
            y2, x2 = min(r * stride + window, H), min(c * stride + window, W)
            y1, x1 = max(y2 - window, 0), max(x2 - window, 0)
            total[y1 // 16 : y2 // 16, x1 // 16 : x2 // 16] += ref_window(clip, dino, pixels[..., y1:y2, x1:x2])
            count[y1 // 16 : y2 // 16, x1 // 16 : x2 // 16] += 1
    return total / count


def ref_sam_map(img: np.ndarray, sam: Backbone, cos_fac: float, refine_neg_cos: bool) -> tuple[torch.Tensor, tuple[int, int]]:
    """SamPredictor.set_image + get_sam_feat + the value-cosine filter, with whole N x N matrices."""
    h, w = img.shape[:2]
    scale = SAM_SIDE / max(h, w)
    nh, nw = int(h * scale + 0.5), int(w * scale + 0.5)
    resized = np.asarray(Image.fromarray(img).resize((nw, nh), Image.BILINEAR)).astype(np.float32)
    x = (torch.from_numpy(resized).permute(2, 0, 1)[None] - torch.tensor([123.675, 116.28, 103.53]).view(1, 3, 1, 1)) / torch.tensor(
        [58.395, 57.12, 57.375]
    ).view(1, 3, 1, 1)
    x = F.pad(x, (0, SAM_SIDE - nw, 0, SAM_SIDE - nh))
    f = sam.features(x, want=("attn", "qkv"))  # attention checked against the block in test_backbones
    g = SAM_SIDE // 16
    vh, vw = nh // 16, nw // 16
    heads = f.attn.shape[1]
    attn = f.attn.view(1, heads, g, g, g, g)[:, :, :vh, :vw, :vh, :vw].reshape(1, heads, vh * vw, vh * vw)
    v = f.v.view(1, heads, g, g, -1)[:, :, :vh, :vw].reshape(1, heads, vh * vw, -1)
    vn = F.normalize(v, dim=-1)
    cos = vn @ vn.transpose(-2, -1)  # 1 x heads x n x n
    thr = torch.clamp(cos_fac * cos.mean(dim=(1, 3)), max=0.9)  # 1 x n: mean over heads and columns
    if not refine_neg_cos:
        thr[thr < 0] = 0.6
    kept = (attn * (cos > thr[:, None, :, None])).mean(1)
    return kept / kept.sum(-1, keepdim=True), (vh, vw)


def ref_trident_cosine(clip, dino, sam, img: np.ndarray, text, settings, cos_fac=1.2, refine_neg_cos=True, halves=False) -> torch.Tensor:
    """N x H x W cosine of Trident's pipeline on the original image."""
    H, W = img.shape[:2]
    mean, std = torch.tensor(clip.mean).view(1, 3, 1, 1), torch.tensor(clip.std).view(1, 3, 1, 1)
    pixels = (torch.from_numpy(img).permute(2, 0, 1)[None].float() / 255 - mean) / std
    rh, rw = -(-H // 16) * 16, -(-W // 16) * 16
    pixels = F.interpolate(pixels, size=(max(rh, settings.window), max(rw, settings.window)), mode="bilinear", align_corners=False)
    spliced = ref_splice(clip, dino, pixels, settings.window, settings.stride)
    sam_img = cv2.resize(img, (rw, rh), interpolation=cv2.INTER_LINEAR)
    parts = [sam_img[:, : rw // 2], sam_img[:, rw // 2 :]] if halves else [sam_img]
    maps = [ref_sam_map(p, sam, cos_fac, refine_neg_cos) for p in parts]
    gh, gw = maps[0][1][0], sum(m[1][1] for m in maps)
    feats = F.interpolate(spliced.permute(2, 0, 1)[None], size=(gh, gw), mode="bilinear", align_corners=False)[0]
    cols, x0 = [], 0
    for a, (vh, vw) in maps:
        part = feats[:, :, x0 : x0 + vw].reshape(feats.shape[0], -1).T  # n x C
        cols.append((a[0] @ part).view(vh, vw, -1))
        x0 += vw
    smoothed = torch.cat(cols, dim=1)
    out = F.normalize(clip.visual.ln_post(smoothed) @ clip.visual.proj, dim=-1)
    cos = torch.einsum("hwd,nd->nhw", out, text)
    return F.interpolate(cos[None], size=(H, W), mode="bilinear", align_corners=False)[0]


# -- the tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage, kw", [
    (None, {}),
    ("sam:3:neg0.6:halves", dict(cos_fac=3.0, refine_neg_cos=False, halves=True)),
    ("sam:0", dict(cos_fac=0.0)),
])
def test_trident_equals_the_reference(trident, stage, kw):
    clip, dino, sam = trident
    settings = SETTINGS.replace(stages=(stage,) if stage else ())
    seg = Segmenter(clip, "cat,dog,grass", spec="trident", settings=settings, templates="single")
    img = image()
    got = seg.cosine(img).rows(0, 50)
    with torch.inference_mode():
        expected = ref_trident_cosine(clip, dino, sam, img, seg.text, settings, **kw)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_splice_equals_a_loop_with_overlap_counts(trident):
    clip, dino, _ = trident
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, 64, 80)
    for batch_size in (1, 4):  # batching windows changes nothing (the DINO mean is per window)
        got = spliced_tokens(window_run(clip, pixels, clip_spec("softmax"), window=48, stride=16, batch_size=batch_size))[0]
        with torch.inference_mode():
            torch.testing.assert_close(got, ref_splice(clip, dino, pixels, 48, 16), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="splicing windows needs"):
        spliced_tokens(window_run(clip, torch.randn(1, 3, 64, 72), clip_spec("softmax"), window=48, stride=16))


def clip_spec(normalizer: str) -> str:
    return f"ext:dino_vitb16[cos,shift:1.2,scale:3,pos]/{normalizer}/cls:0/noffn/hook:sam"


def test_entmax_to_one_equals_trident_in_the_dino_stage_and_softmax_in_the_sam_stage(trident):
    """The DINO stage of trident-entmax tends to trident's as alpha -> 1. The SAM stage replaces the
    value-cosine filter by entmax on SAM's logits: alpha -> 1 gives the heads' mean softmax on the valid
    grid (not Trident's filtered map, which no normalizer reproduces)."""
    clip, _, sam = trident
    torch.manual_seed(2)
    pixels = torch.randn(1, 3, 64, 80)
    torch.testing.assert_close(
        spliced_tokens(window_run(clip, pixels, clip_spec("entmax:1.0005"), window=48, stride=16)),
        spliced_tokens(window_run(clip, pixels, clip_spec("softmax"), window=48, stride=16)), atol=2e-3, rtol=0,
    )
    img = image(3, (64, 80))
    a, valid = sam_attention(img, sam, 1.2, True, "entmax:1.0005")
    s, _ = sam_attention(img, sam, 1.2, True, "softmax")
    assert valid == (6, 8) and a.shape == (1, 48, 48)
    # by hand: SAM's logits (q k^T scale + rel-pos) from its full softmax map, cropped, softmax per head
    resized = np.asarray(Image.fromarray(img).resize((128, 102), Image.BILINEAR)).astype(np.float32)
    x = (torch.from_numpy(resized).permute(2, 0, 1)[None] / 255 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor(
        [0.229, 0.224, 0.225]
    ).view(1, 3, 1, 1)
    logits = sam.features(F.pad(x, (0, 0, 0, 26)), want=("attn",)).attn.log()  # log-softmax = logits - row constant
    keep = (torch.arange(6)[:, None] * 8 + torch.arange(8)[None]).flatten()
    expected = logits[:, :, keep][:, :, :, keep].softmax(-1).mean(1)
    torch.testing.assert_close(a, expected, atol=2e-3, rtol=0)
    sparse, _ = sam_attention(img, sam, 1.2, True, "entmax:1.5")
    torch.testing.assert_close(sparse.sum(-1), torch.ones(1, 48))
    assert (sparse == 0).any() and not torch.allclose(s[0], expected, atol=1e-2)


def test_presets_protocol_and_listing(trident):
    from clipseg_sparse.cli.app import app
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    runner = CliRunner()
    presets = runner.invoke(app, ["ls", "presets"], env={"COLUMNS": "300"}).output
    assert "trident-entmax" in presets and "trident " in presets
    assert "trident" in runner.invoke(app, ["ls", "protocols"], env={"COLUMNS": "300"}).output
    assert "sam" in runner.invoke(app, ["ls", "stages"], env={"COLUMNS": "300"}).output
    proto = PROTOCOLS.get("trident")
    city, ade, voc20 = proto.settings("cityscapes"), proto.settings("ade20k"), proto.settings("voc20")
    assert (city.resolution, city.window, city.stride, city.stages) == (688, 336, 224, ("sam:3:neg0.6:halves",))
    assert (ade.resolution, ade.stages, voc20.stride, voc20.stages) == (576, ("sam:1.2:neg0.6",), 112, ("sam:0",))
    assert proto.settings("voc21").bg_threshold == 0.2 and proto.settings("voc21").size_multiple == 16


def test_bad_stage_and_global_stage_conflicts_are_errors(trident):
    clip, _, _ = trident
    for text in ("sam:x", "sam:1:neg", "sam:1:halves:halves"):
        with pytest.raises(ValueError, match="expected sam") as e:
            InferenceSettings(stages=(text,))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="one global stage"):
        Segmenter(clip, "cat", spec="trident", settings=InferenceSettings(stages=("sam:1", "sam:3")), templates="single")
    with pytest.raises(ValueError, match="match stage surgery works on each window's cosine map"):
        Segmenter(clip, "cat", spec="vv/softmax/noffn/hook:surgery/hook:sam", templates="single")
    # the protocol's stage replaces the spec's default; a spec without one runs the settings' stage alone
    seg = Segmenter(clip, "cat", spec="trident", settings=InferenceSettings(stages=("sam:3",)), templates="single")
    assert [s.name for s in seg.plan.of_kind("global")] == ["sam:3"] and seg.plan.backbones == ("dino_vitb16", "sam_vitb")
    assert seg.plan.forward_name == "splice" and seg.config()["proxy_backbones"].keys() == {"dino_vitb16", "sam_vitb"}
    plain = Segmenter(clip, "cat", spec="sclip", templates="single").plan
    assert plain.of_kind("global") == () and plain.forward_name == "windows"
    sclip_sam = Segmenter(clip, "cat,dog", spec="sclip", settings=SETTINGS.replace(stages=("sam:1.2",)), templates="single")
    assert [s.name for s in sclip_sam.plan.of_kind("global")] == ["sam:1.2"] and sclip_sam.predict(image(5)).labels.shape == (50, 70)


def test_segment_cli_records_both_backbones_and_missing_weights_are_one_line(trident, tmp_path):
    from clipseg_sparse.cli.app import app

    Image.fromarray(image(4)).save(tmp_path / "a.png")
    base = ["segment", str(tmp_path / "a.png"), "--classes", "cat,dog", "--model", TINY_CONFIG, "--pretrained", "none",
            "--device", "cpu", "--templates", "single", "--resolution", "0", "--window", "48", "--stride", "16"]
    res = CliRunner().invoke(app, base + ["--preset", "trident-entmax", "--out", str(tmp_path / "out")], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "out" / "a.json").read_text())
    text = json.dumps(record)
    assert "hook:sam:1.2" in text and "vit_base_patch16_224.dino" in text and "samvit_base_patch16.sa1b" in text
    for weights, message in [
        (f"dino_vitb16={tmp_path / 'dino.pth'}", "dino.pth: backbone checkpoint file not found"),
        (f"sam_vitb={tmp_path / 'sam.pth'}", "sam.pth: backbone checkpoint file not found"),
        ("samm=x.pth", "--proxy-weights: unknown backbone 'samm'"),
    ]:
        res = CliRunner().invoke(app, base + ["--preset", "trident", "--proxy-weights", weights, "--out", str(tmp_path / "o2")], env={"COLUMNS": "300"})
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    assert not (tmp_path / "o2" / "a.json").exists()
    res = CliRunner().invoke(app, base + ["--preset", "trident", "--window", "50", "--out", str(tmp_path / "o3")], env={"COLUMNS": "300"})
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "window and stride must be multiples of the patch size 16" in lines[0], res.output


def test_eval_runs_the_trident_protocol(trident, tmp_path):
    from fake_benchmarks import make_benchmark

    from clipseg_sparse.cli.app import app

    make_benchmark("voc21", tmp_path / "voc", n=2, size=(40, 56))
    out = tmp_path / "voc.json"
    res = CliRunner().invoke(app, [
        "eval", "--dataset", "voc21", "--root", str(tmp_path / "voc"), "--protocol", "trident", "--model", TINY_CONFIG,
        "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", "48", "--window", "48",
        "--stride", "16", "--out", str(out),
    ], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    text = json.dumps(record)
    assert "hook:sam:1.2" in text and '"size_multiple": 16' in text and '"bg_threshold": 0.2' in text
    assert set(record["config"]["proxy_backbones"]) == {"dino_vitb16", "sam_vitb"}
