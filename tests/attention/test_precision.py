"""bf16 (`load_clip(..., precision="bf16")`): every preset runs, the parts accuracy needs stay fp32, and the
features stay within the documented tolerance of fp32 on random weights.

A 24-block tiny ViT (width 64, two heads) holds every preset's block indices (ViT-L/14's SC-CLIP and
CorrCLIP read blocks up to 22); tiny timm backbones stand in for DINO, DINOv2 and SAM.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import installed_backbones, tiny_sam, tiny_stable_diffusion
from test_dense_backbones import tiny_radio
from clipseg_sparse import Segmenter, load_clip
from clipseg_sparse.attention import PRESETS, precision
from clipseg_sparse.models.backbones import BACKBONES, Backbone
from clipseg_sparse.segment.plan import Plan
from clipseg_sparse.segment.settings import InferenceSettings

# documented in docs/speed.md and in --precision's help: bf16 features vs fp32 on random weights
MEAN_COSINE = 0.999
MIN_COSINE = 0.98
# ResCLIP's feedback map is built from the first pass's labels (argmax over the text): where bf16 flips a
# near-tied label on random weights the map changes, so its features are held to a looser bound
LABEL_FED = {"resclip": (0.99, 0.9), "resclip-entmax": (0.99, 0.9)}
# SC-CLIP repairs the patches that LOF on the features ranks anomalous, a discrete cut that bf16 rounding can move:
# on a CPU without AMX (AVX512-BF16 kernels) scclip-l14-entmax gave one patch of 49 at cosine 0.964, mean 0.9985
LABEL_FED |= {name: (0.998, 0.9) for name in PRESETS.names() if name.startswith("scclip")}
SAM_SIDE = 64
SETTINGS = InferenceSettings(resolution=0, window=48, stride=16, size_multiple=16)
STITCH_SETTINGS = InferenceSettings(resolution=120, window=112, stride=56)  # OV-Stitcher's stitch:56 needs 112 px windows


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(fp32, bf16) loads of one seeded random 24-block tiny ViT."""
    config = {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 64, "layers": 24, "width": 64, "patch_size": 16, "head_width": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    }
    path = tmp_path_factory.mktemp("precision") / "tiny-vit-24.json"
    path.write_text(json.dumps(config))
    clips = tuple(load_clip(str(path), pretrained=None, device="cpu", precision=p) for p in ("fp32", "bf16"))
    for dtype in (torch.float32, torch.bfloat16):  # each backbone in each precision: a run loads its CLIP's
        _BACKBONES[dtype] = _tiny_backbones(dtype)
    with installed_backbones(*(bb for backbones in _BACKBONES.values() for bb in backbones), clips=clips):
        yield clips


def _tiny_backbones(dtype: torch.dtype) -> list[Backbone]:
    import timm.models.vision_transformer as vt

    torch.manual_seed(0)
    vit = dict(embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True)
    dinov2 = vt.VisionTransformer(
        img_size=28, patch_size=14, reg_tokens=4, no_embed_class=True, init_values=1e-5, dynamic_img_size=True, **vit
    )
    out = [
        Backbone(BACKBONES.get("dino_vitb8"), vt.VisionTransformer(img_size=32, patch_size=8, **dict(vit, embed_dim=64))),  # CASS: heads as wide as CLIP's
        Backbone(BACKBONES.get("dino_vitb16"), vt.VisionTransformer(img_size=32, patch_size=16, **vit)),
        Backbone(BACKBONES.get("dinov2_vitb14_reg"), dinov2),
        Backbone(dataclasses.replace(BACKBONES.get("sam_vitb"), input_size=SAM_SIDE), tiny_sam(SAM_SIDE, window_size=2)),
    ]
    with torch.random.fork_rng():  # tiny_radio seeds the global generator; the presets' draws stay as they were
        out.append(tiny_radio())
    for bb in out:
        bb.model.eval().to(dtype)
    return out


_BACKBONES: dict[torch.dtype, list[Backbone]] = {}


class _SmallSam:
    """BACKBONES as `proxy_grid` reads it, with SAM's input size that of the tiny SAM."""

    def get(self, name):
        info = BACKBONES.get(name)
        return dataclasses.replace(info, input_size=SAM_SIDE) if name == "sam_vitb" else info


def _inputs():
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(1, 3, 112, 112, generator=g)  # 7 x 7 patches: SC-CLIP's LOF needs 31 neighbours
    regions = (torch.arange(112)[:, None] // 56 * 2 + torch.arange(112)[None] // 56).expand(1, 112, 112).contiguous()
    return pixels, regions


# Presets that exist only inside Segmenter's forward: those whose windows are not encoded alone (a forward other
# than the plain windows: OV-Stitcher's stitched image, GLA-CLIP's keys and values of every window) and
# CorrCLIPv2's `ext:NAME.image` (whole-image features, computed once per image). encode_dense refuses them on
# windows alone: they run in bf16 through the Segmenter (`test_presets_with_stages_segment_in_bf16`).
SEGMENTER_ONLY = {n for n in PRESETS.names() if Plan.of(n).forward_name != "windows" or ".image" in str(PRESETS.get(n).spec)}


@pytest.mark.parametrize("name", [n for n in PRESETS.names() if n not in SEGMENTER_ONLY])
def test_every_preset_runs_in_bf16_close_to_fp32(pair, name, monkeypatch):
    from clipseg_sparse.models import proxies

    monkeypatch.setattr(proxies, "BACKBONES", _SmallSam())
    pixels, regions = _inputs()
    context = {"text": F.normalize(torch.randn(3, 64, generator=torch.Generator().manual_seed(4)), dim=-1), "logit_scale": 40.0}
    feats = []
    for clip in pair:
        feats.append(clip.encode_dense(pixels, name, regions=regions, context=context))
    full, low = feats
    assert low.dtype == full.dtype == torch.float32 and low.shape == full.shape
    cosine = (full * low).sum(-1)
    mean, least = LABEL_FED.get(name, (MEAN_COSINE, MIN_COSINE))
    assert cosine.mean() >= mean and cosine.min() >= least, (name, cosine.mean(), cosine.min())


@pytest.fixture(scope="module")
def bank(pair, tmp_path_factory):
    """An image bank of the fp32 model (keys of the tiny C-RADIO), used by both precisions: as a user builds
    one bank and segments with it in either."""
    from test_bank import build, write_images

    from clipseg_sparse.segment.bank import ImageBank

    folder = tmp_path_factory.mktemp("bank")
    jobs, regions = write_images(folder / "images", 3)
    radio = next(bb for bb in _BACKBONES[torch.float32] if bb.info.name == "c_radio_v3_l")
    build(folder / "bank", jobs, regions, [pair[0]], radio)
    return ImageBank.open(folder / "bank")


# RF-CLIP's sink channels are listed for ViT-B/16 and ViT-L/14 widths: the tiny model names four of its own
TINY_SPECS = {
    name: str(PRESETS.get(name).spec).replace("denoise:5,0.4", "denoise:5,0.4,3;17;40;61") for name in PRESETS.names() if Plan.of(name).forward_name == "refocus"
}


def _floss_ranks(folder, names=("sky", "tree", "grass")):
    """A FLOSS rank file for `names` (FLOSS's presets read one: `floss:auto` would look for `floss rank`'s)."""
    import json

    rows = [{"template_id": t, "entropy": 0.1 * t, "pixel_percentage": 1.0, "rank": t + 1} for t in range(80)]
    path = folder / "ranks.json"
    path.write_text(json.dumps({"classes": {n: {"entropy_ranking": rows[i:] + rows[:i]} for i, n in enumerate(names)}}))
    return path


@pytest.mark.parametrize("name", ["trident", "pearl", *sorted(SEGMENTER_ONLY)])
def test_presets_with_stages_segment_in_bf16(pair, bank, name, tmp_path, monkeypatch):
    """The whole Segmenter (windows; global, windows and post stages that run other backbones or read the
    text; OV-Stitcher's stitched forward and CorrCLIPv2's whole-image features; CLIPer's FGC on a tiny Stable
    Diffusion at 128 px) on the bf16 model; labels agree with fp32 on most pixels (random weights: class maps
    close together, so this is no accuracy measure; `bench --suites bf16` has one)."""
    if "fgc" in str(PRESETS.get(name).spec):
        from clipseg_sparse.methods import cliper

        monkeypatch.setattr(cliper, "_PIPELINES", {})
        cliper.use_diffusion(tiny_stable_diffusion(tmp_path), "cpu")
        monkeypatch.setattr(cliper, "SD_SIZE", 128)
    rgb = np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    regions = (np.arange(50)[:, None] // 25 * 2 + np.arange(70)[None] // 35).astype(np.int64)
    labels = []
    for clip in pair:
        spec = str(PRESETS.get(name).spec)
        retrieval = "retrieve" in spec
        settings = STITCH_SETTINGS if "stitch:" in spec else SETTINGS
        if "floss:auto" in spec:
            spec = spec.replace("floss:auto", f"floss:{_floss_ranks(tmp_path)}")
        seg = Segmenter(
            clip, "sky,tree,grass", spec=TINY_SPECS.get(name, spec), settings=settings, templates="single", regions=lambda image, source: regions, bank=bank if retrieval else None
        )
        labels.append(seg.predict_labels(rgb))
    assert labels[0].shape == labels[1].shape == (50, 70)
    assert np.mean(labels[0] == labels[1]) > 0.5


def test_bf16_runs_the_trunk_in_bf16_and_keeps_the_accuracy_parts_fp32(pair, monkeypatch):
    _, low = pair
    from clipseg_sparse.attention import combine, normalizers

    seen: dict[str, list] = {"blocks": [], "scores": [], "probs": []}
    real_block, real_normalize = precision.sdpa_block, combine.normalize

    def block_spy(block, x, causal=False):
        seen["blocks"].append(x.dtype)
        return real_block(block, x, causal)

    def normalize_spy(scores, norm, dim=-1):
        seen["scores"].append(scores.dtype)
        out = real_normalize(scores, norm, dim)
        seen["probs"].append(out.dtype)
        return out

    monkeypatch.setattr(precision, "sdpa_block", block_spy)
    monkeypatch.setattr(combine, "normalize", normalize_spy)
    pixels, _ = _inputs()
    feats = low.encode_dense(pixels, "qq/entmax:1.5")
    assert low.visual.transformer.resblocks[0].mlp.c_fc.weight.dtype == torch.bfloat16
    assert seen["blocks"] == [torch.bfloat16] * 23  # every unedited block, in bf16, through SDPA
    assert seen["scores"] == seen["probs"] == [torch.float32]  # the edited block's scores and entmax
    assert feats.dtype == torch.float32
    tokens = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    assert low._final_norm()(tokens).dtype == torch.float32  # ln_post
    assert low.encode_text(["a photo of a cat."]).dtype == torch.float32
    assert normalizers.normalize(torch.randn(3, 4, dtype=torch.bfloat16), "entmax:1.5").dtype == torch.bfloat16


def test_sdpa_block_is_open_clip_block(pair):
    full, low = pair
    x = torch.randn(2, 17, 64)
    block = full.visual.transformer.resblocks[3]
    torch.testing.assert_close(precision.sdpa_block(block, x), block(x), atol=1e-5, rtol=1e-5)
    assert precision.reduced_block(block, x) is None  # fp32 models keep open_clip's own forward
    low_block = low.visual.transformer.resblocks[3]
    y = precision.reduced_block(low_block, x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert F.cosine_similarity(y.float(), block(x), dim=-1).min() > 0.999


def test_bf16_text_tower_is_close_to_fp32(pair):
    full, low = pair
    prompts = [f"a photo of a {w}." for w in ("cat", "dog", "tree", "red car parked by a wall")]
    a, b = full.encode_text(prompts), low.encode_text(prompts)
    assert b.dtype == torch.float32
    assert (a * b).sum(-1).min() > 0.999


@pytest.mark.parametrize("explicit", [True, False])
def test_both_reduced_attention_paths_match_fp32(monkeypatch, explicit):
    """`precision.attend` written out (CPUs without AMX) and fused (AMX, GPUs) give softmax(q k^T / sqrt(d)) v
    in bf16 within bf16's rounding of fp32 attention, for a head width whose scale is exact (64) and one
    whose scale is not (80)."""
    monkeypatch.setattr(precision, "explicit_attention_is_faster", lambda device: explicit)
    g = torch.Generator().manual_seed(0)
    for d in (64, 80):
        q, k, v = (torch.randn(2, 3, 50, d, generator=g) for _ in range(3))
        expected = F.scaled_dot_product_attention(q, k, v)
        got = precision.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
        assert got.dtype == torch.bfloat16 and got.shape == expected.shape
        assert (got.float() - expected).abs().max() < 0.02
        assert F.cosine_similarity(got.float(), expected, dim=-1).min() > 0.999


def test_explicit_attention_is_chosen_on_cpus_without_amx(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert precision.explicit_attention_is_faster(torch.device("cpu"))
    assert not precision.explicit_attention_is_faster(torch.device("cuda"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert not precision.explicit_attention_is_faster(torch.device("cpu"))


def test_bf16_text_tower_runs_causal_blocks_of_its_own(pair, monkeypatch):
    """In bf16 the text blocks run through `sdpa_block` with the causal mask (open_clip's masked
    nn.MultiheadAttention transposes and copies its inputs for every projection); fp32 keeps open_clip's
    tower. Both agree with open_clip's own bf16 `encode_text` within bf16 rounding."""
    full, low = pair
    calls = []
    real = precision.sdpa_block
    monkeypatch.setattr(precision, "sdpa_block", lambda block, x, causal=False: calls.append(causal) or real(block, x, causal))
    prompts = ["a photo of a cat.", "a red car parked by a wall on a rainy day.", "a tree."]
    ours = low.encode_text(prompts)
    assert calls == [True] * len(low.model.transformer.resblocks)
    with torch.inference_mode():
        theirs = F.normalize(low.model.encode_text(low.tokenizer(prompts)).float(), dim=-1)
    assert (ours * theirs).sum(-1).min() > 0.999
    calls.clear()
    full.encode_text(prompts)
    assert calls == []
    # causal: the first tokens' outputs do not depend on the tokens after them
    block = low.model.transformer.resblocks[0]
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    head = precision.sdpa_block(block, x[:, :3], causal=True)
    assert torch.equal(precision.sdpa_block(block, x, causal=True)[:, :3], head)
    assert not torch.equal(precision.sdpa_block(block, x, causal=False)[:, :3], head)


def test_fp16_on_a_cpu_without_amx_fp16_is_refused_in_one_line(tmp_path, monkeypatch):
    """fp16 matrix products are emulated on such CPUs (tens of times slower than fp32): load_clip and every
    command refuse it, naming bf16, before the weights load; a CPU with AMX-FP16 may run it."""
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app
    from clipseg_sparse.errors import UserValueError
    from conftest import TINY_CONFIG

    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    with pytest.raises(UserValueError, match="fp16 on the CPU.*use bf16"):
        load_clip(TINY_CONFIG, pretrained=None, device="cpu", precision="fp16")
    (tmp_path / "a.png").write_bytes(b"")  # never read: the precision is refused first
    res = CliRunner().invoke(app, ["segment", str(tmp_path / "a.png"), "--classes", "a,b", "--model", "no-such-model", "--precision", "fp16",
                                   "--device", "cpu", "--out", str(tmp_path / "out")])  # fmt: skip
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "--precision fp16 on the CPU" in lines[0], res.output
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
    assert load_clip(TINY_CONFIG, pretrained=None, device="cpu", precision="fp16").dtype == torch.float16
