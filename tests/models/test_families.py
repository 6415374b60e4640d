"""timm-tower CLIP families (models/families/): EVA-02, SigLIP 2, PE-Core through the one engine.

The towers are open_clip's real architectures (`_build_vision_tower` / `_build_text_tower` of the shipped
configs) built on the meta device and filled with seeded random weights (timm's own init of 86M
parameters takes 10+ s here; the equalities below hold for any weights). References are timm's and
open_clip's own forwards on the same modules; timm's `dynamic_img_size` path (what a model built with
`dynamic_img_size=True` runs) is switched on for the non-square references by setting exactly the
attributes that flag sets at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses

import open_clip
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from clipseg_sparse.attention import edited_block_forward, resolve_spec
from clipseg_sparse.attention.terms import SOURCES
from clipseg_sparse.models.clip import check_model_name, supported_models
from clipseg_sparse.models.text_tower import cut_plan, encode_tokens
from clipseg_sparse.models.clip import DenseCLIP
from clipseg_sparse.models.families.timm_tower import TimmTower
from clipseg_sparse.models.tower import model_family
from conftest import free_memory

FAMILIES = {"eva02": "EVA02-B-16", "siglip2": "ViT-B-16-SigLIP2", "pecore": "PE-Core-B-16"}
SMALL = (32, 48)  # a 2 x 3 patch grid at /16


def _fill(module: nn.Module, seed: int = 0) -> nn.Module:
    """Materialise a meta-built module on the CPU with seeded random weights and its own buffers."""
    module = module.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                if isinstance(m, nn.LayerNorm) and name == "weight":  # in place: no temporary of the parameter's size
                    p.normal_(1.0, 0.1, generator=g)
                else:
                    p.normal_(0.0, 0.05, generator=g)
            if hasattr(m, "init_non_persistent_buffers"):
                m.init_non_persistent_buffers()
            elif hasattr(m, "_init_buffers"):
                m._init_buffers()
            if hasattr(m, "build_causal_mask") and getattr(m, "attn_mask", None) is not None:
                m.attn_mask = m.build_causal_mask()
    return module.eval().requires_grad_(False)


def _vision(name: str) -> nn.Module:
    from open_clip.model import _build_vision_tower

    cfg = open_clip.get_model_config(name)
    with torch.device("meta"):
        visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
    visual = _fill(visual)
    visual.preprocess_cfg = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    return visual


def _dense(name: str) -> DenseCLIP:
    holder = nn.Module()
    holder.visual = _vision(name)
    holder.logit_scale = nn.Parameter(torch.tensor(2.0))
    return DenseCLIP(model=holder, tokenizer=None, model_name=name, pretrained="none")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """B/16 towers on a few tokens: one thread is 5-10x faster than two on a shared, loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _free_memory_after_test():
    """B/16 towers (SigLIP 2's text tower alone is 0.8 GB) are built per test: freed after each."""
    yield
    free_memory()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> tuple[str, DenseCLIP]:
    return request.param, _dense(FAMILIES[request.param])


@contextlib.contextmanager
def timm_dynamic(trunk: nn.Module):
    """timm's own `dynamic_img_size=True` path on this trunk: patch embedding NHWC without the size check,
    RoPE rebuilt per shape from its bands (no cached table); restored afterwards."""
    from timm.layers.format import Format

    pe, rope = trunk.patch_embed, getattr(trunk, "rope", None)
    saved = (trunk.dynamic_img_size, pe.strict_img_size, pe.flatten, pe.output_fmt, getattr(rope, "_use_cached_embed", None))
    trunk.dynamic_img_size, pe.strict_img_size, pe.flatten, pe.output_fmt = True, False, False, Format.NHWC
    if rope is not None:
        rope._use_cached_embed = False
    try:
        yield
    finally:
        trunk.dynamic_img_size, pe.strict_img_size, pe.flatten, pe.output_fmt = saved[:4]
        if rope is not None:
            rope._use_cached_embed = saved[4]


def _timm_rope(trunk: nn.Module, grid: tuple[int, int]) -> torch.Tensor | None:
    if getattr(trunk, "rope", None) is None:
        return None
    with timm_dynamic(trunk):
        return trunk.rope.get_embed(shape=list(grid))


def test_families_and_refusals_by_name():
    """Each shipped config gets its family; non-ViT towers keep being refused, by name and reason."""
    assert model_family("EVA02-B-16", open_clip.get_model_config("EVA02-B-16")).name == "EVA-02"
    assert model_family("ViT-B-16-SigLIP2", open_clip.get_model_config("ViT-B-16-SigLIP2")).name == "SigLIP 2"
    assert model_family("ViT-B-16-SigLIP", open_clip.get_model_config("ViT-B-16-SigLIP")).name == "SigLIP"
    assert model_family("PE-Core-B-16", open_clip.get_model_config("PE-Core-B-16")).name == "PE-Core"
    assert model_family("ViT-H-14-worldwide", open_clip.get_model_config("ViT-H-14-worldwide")).reason is None
    supported = set(supported_models())
    assert {"ViT-B-16", "EVA02-B-16", "EVA02-L-14", "ViT-B-16-SigLIP2", "ViT-SO400M-14-SigLIP", "PE-Core-B-16"} <= supported
    for name, why in [("RN50", "ResNet"), ("convnext_base", "ConvNeXt"), ("ViTamin-B", "hybrid"), ("ViT-L-14-CLIPA", "CLIPA"),
                      ("MobileCLIP2-S0", "FastViT"), ("nllb-clip-base-siglip", "Hugging Face transformers")]:
        assert name not in supported
        with pytest.raises(ValueError, match=why):
            check_model_name(name)


def test_trunk_tokens_and_pooled_embedding_equal_timm_and_open_clip(family):
    """Nothing edited, at the native 224: tokens after the final norm equal timm's forward_features, the
    pooled embedding equals open_clip's encode_image (TimmModel.forward, normalised)."""
    _, clip = family
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected_tokens = clip.model.visual.trunk.forward_features(x)
        expected = F.normalize(clip.model.visual(x), dim=-1)
        tokens, _ = clip._last_tokens(x, None, (), "size")
        normed = clip.visual.ln_post(tokens)
        feats, pooled = clip.encode_dense(x, with_cls=True)
    assert (normed - expected_tokens).abs().max() <= 1e-5
    assert (pooled - expected).abs().max() <= 1e-5
    assert feats.shape == (1, 14, 14, clip.embed_dim) and clip.embed_dim == expected.shape[-1]


def test_non_square_trunk_equals_timm_dynamic_size(family):
    """On non-square grids (4 x 7, 2 x 3; 14 x 20 in the block test below) the positions follow timm's
    dynamic-size rule: the resampled absolute embedding and the RoPE of that grid."""
    _, clip = family
    trunk = clip.model.visual.trunk
    for size in [(64, 112), SMALL]:
        x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode(), timm_dynamic(trunk):
            expected = trunk.forward_features(x)
        with torch.inference_mode():
            ours = clip.visual.forward_tokens(x)
        assert ours.shape == expected.shape and (ours - expected).abs().max() <= 1e-5


def test_map_head_per_token_is_the_hand_computation(family):
    """SigLIP 2 and PE-Core: each token's dense feature is the MAP head's value projection, its output
    projection and its residual MLP (MaskCLIP's construction), then the trunk's head; EVA-02: the head."""
    name, clip = family
    trunk = clip.model.visual.trunk
    x = torch.randn(1, 3, *SMALL, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        tokens, grid = clip._last_tokens(x, None, (), "size")
        normed = trunk.norm(tokens)
        C = normed.shape[-1]
        if name == "eva02":
            assert trunk.attn_pool is None
            hand = trunk.head(normed)
        else:
            ap = trunk.attn_pool
            v = normed @ ap.kv.weight[C:].T + ap.kv.bias[C:]
            y = v @ ap.proj.weight.T + ap.proj.bias
            y = y + ap.mlp(F.layer_norm(y, (C,), ap.norm.weight, ap.norm.bias, ap.norm.eps))
            hand = trunk.head(y)
        feats = clip.encode_dense(x)
    expected = F.normalize(hand[:, -grid[0] * grid[1] :], dim=-1).reshape(1, *grid, -1)
    assert (feats - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("normalizer", ["softmax", "entmax:1.5"])
def test_every_source_runs_on_every_family(family, normalizer):
    """Every source x normalizer, and the published presets, run on the last block of each family."""
    _, clip = family
    x = torch.randn(2, 3, *SMALL, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        plain = clip.encode_dense(x)
        for source in SOURCES:
            spec = f"{source}/{normalizer}" if source != "id" else "id"
            f = clip.encode_dense(x, spec)
            assert f.shape == plain.shape and torch.isfinite(f).all()
            assert torch.allclose(f.norm(dim=-1), torch.ones(2, 2, 3))
        for preset in ["sclip", "clearclip", "naclip", "naclip-entmax", "gem", "clipsurgery-entmax", "qq+kk/entmax:1.5/layers:2"]:
            assert clip.encode_dense(x, preset).shape == plain.shape


def test_entmax_near_one_equals_softmax(family):
    _, clip = family
    x = torch.randn(1, 3, *SMALL, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        for source in ["qk", "qq", "kk+qq"]:
            soft = clip.encode_dense(x, f"{source}/softmax")
            near = clip.encode_dense(x, f"{source}/entmax:1.0001")
            assert (soft - near).abs().max() <= 2e-3


def test_edited_block_equals_timm_block_with_rope(family):
    """An edited `qk/softmax` block with residual and FFN kept equals timm's block output (RoPE of the
    grid applied where timm applies it) at 224 and at a non-square 224 x 320."""
    _, clip = family
    trunk = clip.model.visual.trunk
    spec = resolve_spec("qk/softmax")
    assert spec.residual and spec.ffn
    block, adapted = trunk.blocks[-1], clip.visual.transformer.resblocks[-1]
    for grid in [(14, 14), (14, 20)]:
        g = torch.Generator().manual_seed(6)
        x = torch.randn(1, clip.prefix_tokens + grid[0] * grid[1], trunk.embed_dim, generator=g)
        rope = _timm_rope(trunk, grid)
        with torch.inference_mode():
            expected = block(x, rope=rope) if rope is not None else block(x)
            ours = edited_block_forward(adapted, x, spec, grid)
        assert (ours - expected).abs().max() <= 1e-5


def test_specs_a_timm_tower_cannot_run_are_refused(family):
    """SigLIP has no CLS token to copy per region (`mct:`) or to add (`cls:C`, C != 0); `cls:0` runs
    everywhere (below), and both run on the towers with a CLS token."""
    name, clip = family
    if name == "siglip2":
        with pytest.raises(ValueError, match="mct:BETA copies the CLS token"):
            clip.check_spec("qk/softmax/mct:0.5")
        with pytest.raises(ValueError, match="cls:C adds C x the CLS token"):
            clip.check_spec("clearclip/cls:0.3")
        x = torch.randn(1, 3, *SMALL, generator=torch.Generator().manual_seed(20))
        with pytest.raises(ValueError, match="cls:C adds C x the CLS token"):  # the engine's own check
            edited_block_forward(clip.visual.transformer.resblocks[-1], clip.visual.forward_tokens(x)[:, :6], resolve_spec("qq/softmax/cls:0.3"), (2, 3))
    else:
        clip.check_spec("qk/softmax/cls:0/noffn/mct:0.5")
        clip.check_spec("clearclip/cls:0.3")


def test_cls_option_on_every_family(family):
    """`cls:C` (SC-CLIP, and ProxyCLIP's `cls:0`): attention over the patches, residual C x the block input's
    CLS token (hand identity: tokens(cls:C) - tokens(cls:0) = C x CLS). SigLIP has no CLS token: `cls:0` is
    the block without residual (`nores`), exactly."""
    name, clip = family
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(21))
    with torch.inference_mode():
        if name == "siglip2":
            assert torch.equal(clip.encode_dense(x, "qq/softmax/cls:0/noffn"), clip.encode_dense(x, "qq/softmax/nores/noffn"))
            return
        zero, _ = clip._last_tokens(x, "qq/softmax/cls:0/noffn", (), "size")
        half, _ = clip._last_tokens(x, "qq/softmax/cls:0.5/noffn", (), "size")
    assert torch.equal(zero[:, :1], half[:, :1])  # the CLS token passes the edited block unchanged
    assert (half[:, 1:] - zero[:, 1:] - 0.5 * zero[:, :1]).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["eva02", "pecore"])
def test_mask_class_tokens_on_rope_towers_follow_the_cls_token(name):
    """CorrCLIP's `mct:` on towers with a CLS token: with one region, each MCT attends to the CLS and every
    patch in every block, as the CLS itself does, so its last-block output is timm's CLS token (RoPE on the
    patches only, none on the CLS copies), at a non-square grid."""
    from clipseg_sparse.attention.blocks import encode_tokens

    clip = _dense(FAMILIES[name])
    trunk = clip.model.visual.trunk
    x = torch.randn(1, 3, 64, 112, generator=torch.Generator().manual_seed(22))
    with torch.inference_mode(), timm_dynamic(trunk):
        expected = trunk.forward_features(x)[:, 0]
    with torch.inference_mode():
        tokens, grid = clip._embed(x)
        branches = []
        encode_tokens(clip.visual, tokens, resolve_spec("qq/softmax/cls:0/noffn/mct:0.5"), grid, x,
                      regions=torch.zeros(1, 64, 112, dtype=torch.int64), branches=branches)  # fmt: skip
        beta, semantic = branches[-1]
        feats = clip.encode_dense(x, "qq/softmax/cls:0/noffn/mct:0.5", regions=torch.zeros(1, 64, 112, dtype=torch.int64))
    assert beta == 0.5 and semantic.shape == (1, 28, expected.shape[-1])
    assert (clip.visual.ln_post(semantic) - expected[:, None]).abs().max() <= 1e-4  # 12 blocks of SDPA vs timm: ~1e-5
    assert feats.shape == (1, 4, 7, clip.embed_dim) and torch.isfinite(feats).all()


@pytest.mark.parametrize("name", ["EVA02-B-16", "ViT-B-16-SigLIP2", "PE-Core-B-16"])
def test_text_tower_equals_encode_text(name):
    """Token ids given directly (the SigLIP 2 tokenizer's files are not on this machine): the fast path
    equals open_clip's encode_text; SigLIP's bidirectional tower with last-token pooling falls back."""
    from open_clip.model import _build_text_tower

    cfg = open_clip.get_model_config(name)
    with torch.device("meta"):
        text = _build_text_tower(cfg["embed_dim"], cfg["text_cfg"])
    text = _fill(text, seed=7)
    context, vocab = text.positional_embedding.shape[0], text.vocab_size
    g = torch.Generator().manual_seed(8)
    ids = torch.zeros(5, context, dtype=torch.long)
    for i, n in enumerate([3, 7, 1, context - 2, 12]):
        ids[i, :n] = torch.randint(1, vocab - 1, (n,), generator=g)
        ids[i, n] = vocab - 1  # the end token is the largest id (argmax pooling)
    if name == "ViT-B-16-SigLIP2":
        assert cut_plan(text) is None  # no causal mask, `last` pooling: full length
    else:
        assert cut_plan(text) is not None
    with torch.inference_mode():
        expected = text(ids)
        ours = encode_tokens(text, ids, batch_size=2)
    assert (F.normalize(ours, dim=-1) - F.normalize(expected, dim=-1)).abs().max() <= 1e-5


@pytest.mark.parametrize("name,patch", [("EVA02-L-14", 14), ("ViT-SO400M-14-SigLIP", 14), ("EVA01-g-14", 14), ("PE-Core-L-14-336", 14), ("vit_medium_patch16_gap_256", 16)])
def test_large_towers_shapes(name, patch):
    """EVA02-L-14, SO400M SigLIP, EVA01-g (fused qkv with q/v biases), PE-Core-L and an average-pooled timm ViT:
    shape check on the meta device (no numbers): dense grid and width."""
    from open_clip.model import _build_vision_tower

    cfg = open_clip.get_model_config(name)
    with torch.device("meta"):
        visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
        visual.preprocess_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
        holder = nn.Module()
        holder.visual = visual
        holder.logit_scale = nn.Parameter(torch.tensor(1.0))
    clip = DenseCLIP(model=holder, tokenizer=None, model_name=name, pretrained="none")
    x = torch.empty(1, 3, 3 * patch, 5 * patch, device="meta")
    with torch.inference_mode():
        feats, pooled = clip.encode_dense(x, "sclip", with_cls=True)
    assert feats.shape == (1, 3, 5, cfg["embed_dim"]) and pooled.shape == (1, cfg["embed_dim"])


def test_load_clip_gives_a_timm_tower_and_a_lazy_hub_tokenizer(monkeypatch, tmp_path):
    """load_clip on SigLIP 2 with random weights: DenseCLIP, images run offline, and the Hugging Face
    tokenizer is only asked for with the first text: a missing local directory is one line."""
    from clipseg_sparse import WeightsUnavailableError, load_clip
    from clipseg_sparse.models import clip as clip_module
    from clipseg_sparse.models.tokenizers import HubTokenizer

    name = "ViT-B-16-SigLIP2"
    with torch.device("meta"):
        model = open_clip.create_model(name, pretrained=None, device="meta")
    model = _fill(model, seed=9)
    model.visual.preprocess_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
    monkeypatch.setattr(clip_module, "_create_open_clip", lambda *a, **k: (model, name, None, False, None))
    clip = load_clip(name, pretrained=None, device="cpu")
    assert isinstance(clip.tower, TimmTower) and isinstance(clip.tokenizer, HubTokenizer) and clip.tokenizer._tokenizer is None
    assert clip.encode_dense(torch.zeros(1, 3, *SMALL)).shape == (1, 2, 3, 768) and clip.mean == (0.5,) * 3
    missing = tmp_path / "no-tokenizer"
    clip = load_clip(name, pretrained=None, device="cpu", tokenizer=str(missing))
    with pytest.raises(WeightsUnavailableError, match="tokenizer directory not found") as e:
        clip.encode_text(["a photo of a cat."])
    assert "\n" not in str(e.value)


def test_hub_tokenizer_offline_is_one_clear_message(tmp_path):
    """Offline with an empty cache: the same one-line advice as missing weights (or the extra to install)."""
    import os
    import subprocess
    import sys

    code = (
        "import open_clip\n"
        "from clipseg_sparse.models.tokenizers import HubTokenizer\n"
        "from clipseg_sparse.runtime.weights import MissingExtraError, WeightsUnavailableError\n"
        "cfg = open_clip.get_model_config('ViT-B-16-SigLIP2')['text_cfg']\n"
        "try:\n    HubTokenizer('ViT-B-16-SigLIP2', cfg).load()\n"
        "except (WeightsUnavailableError, MissingExtraError) as e:\n    print('ERR', type(e).__name__, e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERR"), out.stdout + out.stderr
    if "MissingExtraError" in lines[0]:
        assert "clipseg-sparse[families]" in lines[0]
    else:
        assert "could not obtain the Hugging Face tokenizer 'timm/ViT-B-16-SigLIP2'" in lines[0] and "HF_HUB_OFFLINE" in lines[0]


def test_families_grid_names_each_models_weights():
    """The `families` grid: 6 families x 8 benchmarks x 3 presets x {softmax, entmax:1.5}; each cell
    loads its model's own tag; `--pretrained none` (a smoke run) replaces every model's weights."""
    from clipseg_sparse.sweeps.grid import GRIDS, Grid, model_weights, read_grid_file

    spec = read_grid_file(GRIDS.get("families"))
    cells = spec.grid.cells()
    assert len(cells) == 6 * 8 * 3 * 2
    weights = {(c.model, c.pretrained) for c in cells}
    assert ("ViT-B-16-quickgelu", "metaclip_fullcc") in weights and ("ViT-B-16-quickgelu", "dfn2b") in weights
    assert ("ViT-B-16-SigLIP2", "webli") in weights and ("EVA02-B-16", "merged2b_s8b_b131k") in weights
    assert len({c.hash for c in cells}) == len(cells) and all(c.config()["pretrained"] == c.pretrained for c in cells)
    smoke = read_grid_file(GRIDS.get("families"), overrides={"pretrained": "none"}).grid
    assert {c.pretrained for c in smoke.cells()} == {"none"} and len(smoke.models) == 5  # MetaCLIP and DFN share ViT-B-16-quickgelu
    assert model_weights("tests/tiny.json") == ("tests/tiny.json", None) and model_weights("ViT-B-16") == ("ViT-B-16", None)
    with pytest.raises(ValueError, match="no pretrained tag 'nope'"):
        Grid(models=("ViT-B-16:nope",), datasets=("voc21",))


class _WordIds:
    """A stand-in for SigLIP 2's Hub tokenizer (its files are not on this machine): words -> ids, padded."""

    def __init__(self, context: int, vocab: int):
        self.context, self.vocab = context, vocab

    def __call__(self, texts):
        ids = torch.zeros(len(texts), self.context, dtype=torch.long)
        for i, text in enumerate(texts):
            words = [sum(map(ord, w)) % (self.vocab - 2) + 1 for w in text.split()][: self.context - 1]
            ids[i, : len(words) + 1] = torch.tensor(words + [self.vocab - 1])
        return ids


@pytest.mark.parametrize("name", ["EVA02-B-16", "ViT-B-16-SigLIP2"])
def test_segmenter_runs_unchanged_on_timm_towers(name):
    """The library path `segment` and `eval` use: Segmenter with windows, templates, synonyms and an -entmax
    preset (SigLIP's text tower runs at full length: two templates, not 80, keep it short)."""
    import numpy as np

    from clipseg_sparse.segment.segmenter import Segmenter
    from clipseg_sparse.segment.settings import InferenceSettings

    with torch.device("meta"):
        model = open_clip.create_model(name, pretrained=None, device="meta")
    model = _fill(model, seed=10)
    model.visual.preprocess_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
    cfg = open_clip.get_model_config(name)["text_cfg"]
    tokenizer = _WordIds(cfg["context_length"], cfg["vocab_size"]) if "hf_tokenizer_name" in cfg else open_clip.get_tokenizer(name)
    clip = DenseCLIP(model=model, tokenizer=tokenizer, model_name=name, pretrained="none")
    settings = InferenceSettings(resolution=64, window=32, stride=16)
    image = np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)
    with torch.inference_mode():
        seg = Segmenter(clip, "cat,dog|puppy,grass", spec="naclip-entmax", settings=settings, templates=["a photo of a {}.", "{}"])
        result = seg.predict(image)
    assert result.labels.shape == (48, 80) and set(np.unique(result.labels)) <= {0, 1, 2}
    assert result.settings["model"] == name


@pytest.mark.parametrize("grid", ["corrclip", "trident"])
def test_method_grids_add_metaclip_and_keep_the_openai_cells(grid):
    """CorrCLIP and Trident report MetaCLIP B/16 rows: their grids run it next to OpenAI's, whose cells
    keep the configuration (and so the result files) they had before weights could be named per model."""
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get(grid)).grid
    assert {(c.model, c.pretrained) for c in g.cells()} == {("ViT-B-16", "openai"), ("ViT-B-16-quickgelu", "metaclip_fullcc")}
    before = dataclasses.replace(g, models=("ViT-B-16",), pretrained="openai")
    assert {c.hash for c in before.cells()} <= {c.hash for c in g.cells()}


def test_taps_and_scclip_run_on_every_family(family):
    """Score terms that read CLIP's hidden states (`x@L`) and its own attention (`attn@A-B`, RoPE included)
    run on each tower; SC-CLIP (extra inputs, aggregation, the LOF hook) wherever a CLS token exists."""
    name, clip = family
    x = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        for spec in ["x@9[cos]+kk/softmax", "0.5*attn@6-9+qq/entmax:1.5/nores/noffn", "qq/entmax:1.5/in:sum@4-10"]:
            assert clip.encode_dense(x, spec).shape == (1, 6, 6, clip.embed_dim)
        if name != "siglip2":
            assert torch.isfinite(clip.encode_dense(x, "scclip-entmax")).all()
        maps = clip.attention_maps(x, "qq/entmax:1.5")
    assert maps.shape == (1, 12, clip.prefix_tokens + 36, clip.prefix_tokens + 36)
    assert torch.allclose(maps.sum(-1), torch.ones_like(maps.sum(-1)), atol=1e-4)


def test_resclip_feedback_runs_on_every_family(family):
    """ResCLIP's first pass reads each tower's own dense head (MAP per token, or the trunk's head) and its
    feedback map is cut to the tower's tokens (no CLS row in SigLIP)."""
    _, clip = family
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(12))
    text = F.normalize(torch.randn(3, clip.embed_dim, generator=torch.Generator().manual_seed(13)), dim=-1)
    with torch.inference_mode():
        feats = clip.encode_dense(x, "resclip-entmax", context={"text": text, "logit_scale": 40.0, "windows": x})
    assert feats.shape == (1, 4, 4, clip.embed_dim) and torch.isfinite(feats).all()


def test_bench_normalizer_scores_on_every_family(family):
    """`bench normalizers` reads the last block's q-q scores through the engine's block interface: on every
    family their softmax is the engine's own `qq/softmax` attention map of the same image."""
    from clipseg_sparse.bench.run import last_block_scores

    _, clip = family
    with torch.inference_mode():
        scores = last_block_scores(clip, 64, seed=5)
        maps = clip.attention_maps(torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(5)), "qq/softmax")
    n = clip.prefix_tokens + 16
    assert scores.shape == (12, n, n) and (scores - scores.transpose(-2, -1)).abs().max() < 1e-4
    assert (torch.softmax(scores, -1) - maps[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("explicit", [True, False])
def test_bf16_towers_follow_the_faster_attention_path_and_stay_close_to_fp32(family, monkeypatch, explicit):
    """In bf16, where the fused attention kernel is the slower path (CPUs without AMX), the towers' unedited
    blocks run timm's explicit attention (its `fused_attn` off for the call, restored after); fp32 and the
    AMX / GPU case keep the fused kernel. bf16 features stay within bf16 rounding of fp32."""
    from clipseg_sparse.attention import precision

    name, clip = family
    low = _dense(FAMILIES[name])
    low.model.visual.to(torch.bfloat16)
    monkeypatch.setattr(precision, "explicit_attention_is_faster", lambda device: explicit)
    seen: dict[torch.dtype, list[bool]] = {torch.float32: [], torch.bfloat16: []}
    for model in (clip, low):
        for block in model.visual.trunk.blocks:
            attn = block.attn
            monkeypatch.setattr(attn, "forward", lambda *a, _attn=attn, _f=attn.forward, **k: seen[a[0].dtype].append(_attn.fused_attn) or _f(*a, **k))
    from clipseg_sparse.attention import combine

    normalized: list[tuple[torch.dtype, torch.dtype]] = []
    real_normalize = combine.normalize
    def normalize_spy(scores, norm, dim=-1):
        out = real_normalize(scores, norm, dim)
        normalized.append((scores.dtype, out.dtype))
        return out

    monkeypatch.setattr(combine, "normalize", normalize_spy)
    pixels = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    full, reduced = clip.encode_dense(pixels, "sclip-entmax"), low.encode_dense(pixels, "sclip-entmax")
    groups = len(resolve_spec("sclip-entmax").groups)  # one normalizer call per score group and model
    assert normalized == [(torch.float32, torch.float32)] * 2 * groups  # the edited block's scores and entmax stay fp32 in bf16 too
    depth = len(clip.visual.trunk.blocks)
    assert seen[torch.float32] == [True] * (depth - 1)  # the last block is the edited one
    assert seen[torch.bfloat16] == [not explicit] * (depth - 1)
    assert all(block.attn.fused_attn for block in low.visual.trunk.blocks)
    cosine = (full * reduced).sum(-1)  # these filled weights: EVA-02 0.9988 / 0.9983 (mean / min) on both paths
    assert reduced.dtype == torch.float32 and cosine.mean() > 0.998 and cosine.min() > 0.99, (cosine.mean(), cosine.min())
