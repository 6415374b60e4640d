"""The baselines (presets `clip`, `maskclip`): the unmodified block and MaskCLIP's value path."""

import torch

from conftest import block_and_tokens
from clipseg_sparse.attention import AttentionSpec, edited_block_forward


def test_preset_contents():
    assert AttentionSpec.parse("clip") == AttentionSpec()
    assert AttentionSpec.parse("maskclip").source == ("id",)


def test_unmodified_spec_reproduces_block(tiny_clip):
    blk, x = block_and_tokens(tiny_clip)
    with torch.no_grad():
        assert (edited_block_forward(blk, x, AttentionSpec(), (4, 4)) - blk(x)).abs().max() <= 1e-5


def test_id_source_is_value_path(tiny_clip):
    blk, x = block_and_tokens(tiny_clip)
    spec = AttentionSpec(source="id", residual=False, ffn=False)
    with torch.no_grad():
        out = edited_block_forward(blk, x, spec, (4, 4))
        C = x.shape[-1]
        v = torch.nn.functional.linear(blk.ln_1(x), blk.attn.in_proj_weight[2 * C :], blk.attn.in_proj_bias[2 * C :])
        assert torch.allclose(out, blk.attn.out_proj(v), atol=1e-5)
