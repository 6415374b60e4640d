import pytest
import torch

from clipseg_sparse.attention import AttentionSpec, PRESETS, edited_block_forward, gaussian_prior, list_presets

REQUIRED = ["qk/softmax", "qq/entmax:1.5", "qq+kk/softmax", "kk/sparsemax", "vv/entmax:1.25"]


@pytest.mark.parametrize("text", REQUIRED + ["id/softmax", "kk/softmax/gauss:5/nores/noffn", "qq/entmax:1.25/temp:0.1/layers:2/neg:0.2"])
def test_round_trip(text):
    spec = AttentionSpec.parse(text)
    assert str(spec) == text
    assert AttentionSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("name", ["clip", "maskclip", "sclip", "clearclip", "naclip"])
def test_presets(name):
    spec = AttentionSpec.parse(name)
    assert AttentionSpec.parse(str(spec)) == spec
    assert PRESETS.help(name)  # every preset says which paper it follows


def test_preset_contents():
    assert AttentionSpec.parse("clip") == AttentionSpec()
    assert AttentionSpec.parse("sclip") == AttentionSpec(source=("qq", "kk"))
    assert AttentionSpec.parse("clearclip") == AttentionSpec(source="qq", residual=False, ffn=False)
    assert AttentionSpec.parse("naclip") == AttentionSpec(source="kk", gauss_sigma=5.0, residual=False, ffn=False)
    assert AttentionSpec.parse("maskclip").source == ("id",)
    assert AttentionSpec.parse("sclip-entmax").normalizer == "entmax:1.5"
    assert set(["clip", "maskclip", "sclip", "clearclip", "naclip"]) <= set(list_presets())


def test_defaults_leave_architecture_unchanged():
    spec = AttentionSpec()
    assert spec.residual and spec.ffn and spec.layers == 1 and spec.source == ("qk",) and spec.is_identity


@pytest.mark.parametrize(
    "bad,fragment",
    [("sclp", "sclip"), ("qx/softmax", "qk"), ("qq/entmax:3", "(1, 2]"), ("qq/softmax/bogus", "options"),
     ("id+qq/softmax", "cannot be summed"), ("qq/softmax/layers:0", ">= 1")],
)
def test_bad_specs_explain(bad, fragment):
    with pytest.raises(ValueError) as err:
        AttentionSpec.parse(bad)
    assert fragment in str(err.value)


def test_gaussian_prior_shape_and_values():
    prior = gaussian_prior((3, 4), sigma=1.0)
    assert prior.shape == (13, 13)
    assert torch.all(prior[0] == 0) and torch.all(prior[:, 0] == 0)
    assert torch.allclose(torch.diagonal(prior)[1:], torch.ones(12))
    # neighbours one step apart: exp(-1/2)
    assert prior[1, 2].item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item())


def _block_and_tokens(clip, grid=(4, 4)):
    blk = clip.visual.transformer.resblocks[-1]
    x = torch.randn(2, 1 + grid[0] * grid[1], clip.visual.transformer.width)
    return blk, x


def test_unmodified_spec_reproduces_block(tiny_clip):
    blk, x = _block_and_tokens(tiny_clip)
    with torch.no_grad():
        assert (edited_block_forward(blk, x, AttentionSpec(), (4, 4)) - blk(x)).abs().max() <= 1e-5


def test_id_source_is_value_path(tiny_clip):
    blk, x = _block_and_tokens(tiny_clip)
    spec = AttentionSpec(source="id", residual=False, ffn=False)
    with torch.no_grad():
        out = edited_block_forward(blk, x, spec, (4, 4))
        C = x.shape[-1]
        v = torch.nn.functional.linear(blk.ln_1(x), blk.attn.in_proj_weight[2 * C :], blk.attn.in_proj_bias[2 * C :])
        assert torch.allclose(out, blk.attn.out_proj(v), atol=1e-5)


def test_sum_of_sources_sums_normalised_maps(tiny_clip):
    blk, x = _block_and_tokens(tiny_clip)
    strip = dict(residual=False, ffn=False)
    with torch.no_grad():
        both = edited_block_forward(blk, x, AttentionSpec(source=("qq", "kk"), **strip), (4, 4))
        qq = edited_block_forward(blk, x, AttentionSpec(source="qq", **strip), (4, 4))
        kk = edited_block_forward(blk, x, AttentionSpec(source="kk", **strip), (4, 4))
        bias = blk.attn.out_proj.bias
        # out_proj is affine: out(a v + b v) = W(a+b)v + bias
        assert torch.allclose(both, qq + kk - bias, atol=1e-4)


def test_entmax_block_matches_explicit_computation(tiny_clip):
    blk, x = _block_and_tokens(tiny_clip)
    spec = AttentionSpec.parse("kk/entmax:1.5/nores/noffn")
    import entmax

    with torch.no_grad():
        out = edited_block_forward(blk, x, spec, (4, 4))
        B, N, C = x.shape
        H = blk.attn.num_heads
        q, k, v = torch.nn.functional.linear(blk.ln_1(x), blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, -1)
        k = k.view(B, N, H, -1).transpose(1, 2)
        v = v.view(B, N, H, -1).transpose(1, 2)
        attn = entmax.entmax15(k @ k.transpose(-1, -2) * (C // H) ** -0.5, dim=-1)
        ref = blk.attn.out_proj((attn @ v).transpose(1, 2).reshape(B, N, C))
        assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax:1.5"])
def test_negative_branch_adds_weighted_softmin(tiny_clip, normalizer):
    blk, x = _block_and_tokens(tiny_clip)
    with torch.no_grad():
        with_neg = edited_block_forward(blk, x, AttentionSpec.parse(f"qq/{normalizer}/nores/noffn/neg:0.3"), (4, 4))
        without = edited_block_forward(blk, x, AttentionSpec.parse(f"qq/{normalizer}/nores/noffn"), (4, 4))
        B, N, C = x.shape
        H = blk.attn.num_heads
        q, _, v = torch.nn.functional.linear(blk.ln_1(x), blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, -1)
        q = q.view(B, N, H, -1).transpose(1, 2)
        v = v.view(B, N, H, -1).transpose(1, 2)
        softmin = torch.softmax(-(q @ q.transpose(-1, -2)) * (C // H) ** -0.5, dim=-1)
        extra = (0.3 * softmin @ v).transpose(1, 2).reshape(B, N, C) @ blk.attn.out_proj.weight.T
        assert torch.allclose(with_neg - without, extra, atol=1e-5)
