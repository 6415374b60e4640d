import numpy as np
import pytest
import torch
from PIL import Image

from conftest import block_and_tokens
from clipseg_sparse.attention import AttentionSpec, PRESETS, edited_block_forward, list_presets
from clipseg_sparse.errors import UserValueError

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


def test_list_presets_lists_the_baselines():
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


def test_entmax_block_matches_explicit_computation(tiny_clip):
    blk, x = block_and_tokens(tiny_clip)
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
    blk, x = block_and_tokens(tiny_clip)
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


@pytest.mark.parametrize("text", ["qq/softmax/aggout:kk", "qq/softmax/aggin:qq[cos,thresh:0.4]", "kk/softmax/aggout:vv"])
def test_an_aggregation_term_on_the_blocks_own_projections_is_refused(text):
    """aggin / aggout run outside the block's attention, where its q/k/v do not exist (a crash before)."""
    with pytest.raises(UserValueError, match="reads the edited block's own q/k/v"):
        AttentionSpec.parse(text)
    assert AttentionSpec.parse("qq/softmax/aggout:x@4[cos,thresh:0.4]").aggregate_out == "x@4[cos,thresh:0.4]"


def test_an_aggregation_term_on_the_blocks_projections_is_one_line_at_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(image)
    res = CliRunner().invoke(app, ["segment", str(image), "--classes", "a,b", "--attn", "qq/softmax/aggout:kk", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0 and "aggout:kk" in res.stderr
