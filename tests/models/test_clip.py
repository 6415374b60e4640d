import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from clipseg_sparse import AttentionSpec, WeightsUnavailableError, load_clip
from clipseg_sparse.attention import SOURCES

from conftest import TINY_CONFIG


def _open_clip_patch_tokens(clip, pixels):
    """open_clip's own final patch tokens after ln_post and proj, L2-normalised."""
    visual = clip.visual
    visual.output_tokens = True
    try:
        _, tokens = visual(pixels)
    finally:
        visual.output_tokens = False
    return F.normalize(tokens @ visual.proj, dim=-1)


def test_invariant_vit_b16(vit_b16):
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 224, 224)
    ref = _open_clip_patch_tokens(vit_b16, pixels).reshape(2, 14, 14, -1)
    assert (vit_b16.encode_dense(pixels, "qk/softmax") - ref).abs().max() <= 1e-5
    # every block re-run through our own block code, not open_clip's
    all_edited = vit_b16.encode_dense(pixels, AttentionSpec(layers=12))
    assert (all_edited - ref).abs().max() <= 1e-5


def test_vit_l14_architecture():
    """The real ViT-L-14 (24 blocks, width 1024, 16 heads, patch 14, 768-d output), random weights."""
    clip = load_clip("ViT-L-14", pretrained=None, device="cpu")
    assert clip.patch_size == 14 and clip.embed_dim == 768 and clip.visual.transformer.resblocks[0].attn.num_heads == 16
    assert len(clip.visual.transformer.resblocks) == 24
    pixels = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    ref = _open_clip_patch_tokens(clip, pixels).reshape(1, 16, 16, -1)
    assert (clip.encode_dense(pixels, AttentionSpec(layers=2)) - ref).abs().max() <= 1e-5
    out = clip.encode_dense(torch.randn(1, 3, 224, 308), "naclip")
    assert out.shape == (1, 16, 22, 768) and torch.isfinite(out).all()


@pytest.mark.parametrize("source", [s for s in SOURCES] + ["qq+kk"])
@pytest.mark.parametrize("normalizer", ["softmax", "entmax:1.5", "sparsemax", "entmax:1.25"])
def test_every_source_and_normalizer(tiny_clip, source, normalizer):
    if source == "id" and normalizer != "softmax":  # no normalizer slot: refused (tests/attention/test_spec_values.py)
        with pytest.raises(ValueError, match="would change nothing"):
            tiny_clip.encode_dense(torch.randn(1, 3, 64, 96), f"{source}/{normalizer}/nores")
        return
    torch.manual_seed(0)
    out = tiny_clip.encode_dense(torch.randn(2, 3, 64, 96), f"{source}/{normalizer}/nores")
    assert out.shape == (2, 4, 6, 64)
    assert torch.allclose(out.norm(dim=-1), torch.ones(2, 4, 6), atol=1e-5)


def test_specs_change_features_and_do_not_touch_weights(tiny_clip):
    before = {k: v.clone() for k, v in tiny_clip.model.state_dict().items()}
    pixels = torch.randn(1, 3, 64, 64)
    plain = tiny_clip.encode_dense(pixels)
    edited = tiny_clip.encode_dense(pixels, "clearclip")
    again = tiny_clip.encode_dense(pixels)
    assert not torch.allclose(plain, edited, atol=1e-3)
    assert torch.equal(plain, again)  # nothing left patched
    after = tiny_clip.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_square_and_positional_interpolation(vit_b16):
    pos = vit_b16.positional_embedding((14, 14))
    assert pos is vit_b16.visual.positional_embedding  # identity at the native grid
    wide = vit_b16.positional_embedding((14, 21))
    assert wide.shape == (1 + 14 * 21, 768)
    assert torch.equal(wide[0], pos[0])  # CLS untouched
    out = vit_b16.encode_dense(torch.randn(1, 3, 224, 336), "sclip")
    assert out.shape == (1, 14, 21, 512)


def test_input_not_multiple_of_patch(tiny_clip):
    with pytest.raises(ValueError, match="multiple of the patch size"):
        tiny_clip.encode_dense(torch.randn(1, 3, 60, 64))


def test_encode_text(tiny_clip):
    emb = tiny_clip.encode_text(["a photo of a cat.", "a photo of a dog."])
    assert emb.shape == (2, 64)
    assert torch.allclose(emb.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert not torch.allclose(emb[0], emb[1])


def test_precisions(tiny_clip):
    clip = load_clip(TINY_CONFIG, pretrained=None, device="cpu", precision="bf16")
    out = clip.encode_dense(torch.randn(1, 3, 64, 64), "qq/entmax:1.5")
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="precision"):
        load_clip(TINY_CONFIG, pretrained=None, precision="fp8")


def test_local_checkpoint_round_trip(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip.model.state_dict().items()}, path)
    loaded = load_clip(TINY_CONFIG, pretrained=str(path), device="cpu")
    assert loaded.pretrained == str(path)
    pixels = torch.randn(1, 3, 64, 64)
    assert torch.allclose(loaded.encode_dense(pixels, "sclip"), tiny_clip.encode_dense(pixels, "sclip"), atol=1e-6)
    pt = tmp_path / "tiny.pt"
    torch.save(tiny_clip.model.state_dict(), pt)
    assert torch.allclose(load_clip(TINY_CONFIG, pretrained=str(pt)).encode_text(["x"]), tiny_clip.encode_text(["x"]), atol=1e-6)


def test_missing_checkpoint_file(tmp_path):
    with pytest.raises(WeightsUnavailableError, match="not found"):
        load_clip(TINY_CONFIG, pretrained=str(tmp_path / "nope.pt"))


def test_unknown_model_and_tag():
    with pytest.raises(ValueError, match="unknown model"):
        load_clip("ViT-Q-99", pretrained=None)
    with pytest.raises(ValueError, match="unknown pretrained tag"):
        load_clip("ViT-B-16", pretrained="not-a-tag")


def test_offline_error_is_one_clear_message(tmp_path):
    """With no network and an empty cache, a tag gives one actionable error, not network tracebacks."""
    code = (
        "from clipseg_sparse import load_clip, WeightsUnavailableError\n"
        "try:\n    load_clip('ViT-B-16', pretrained='openai', device='cpu')\n"
        "except WeightsUnavailableError as e:\n    print('ERR', e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("ERR could not obtain weights 'openai' for ViT-B-16")
    assert "--pretrained /path/to/model.pt" in out.stdout and "HF_HUB_OFFLINE" in out.stdout


def test_random_weights_are_seeded_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = load_clip(TINY_CONFIG, pretrained=None)
    assert torch.equal(torch.rand(1), expected_next)  # building the model did not consume the caller's RNG
    b = load_clip(TINY_CONFIG, pretrained=None)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
