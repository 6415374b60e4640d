"""SCLIP (preset `sclip`: qq+kk): the sum of the two normalised maps."""

import torch

from conftest import block_and_tokens
from clipseg_sparse.attention import AttentionSpec, edited_block_forward


def test_preset_contents():
    assert AttentionSpec.parse("sclip") == AttentionSpec(source=("qq", "kk"))
    assert AttentionSpec.parse("sclip-entmax").normalizer == "entmax:1.5"


def test_sum_of_sources_sums_normalised_maps(tiny_clip):
    blk, x = block_and_tokens(tiny_clip)
    strip = dict(residual=False, ffn=False)
    with torch.no_grad():
        both = edited_block_forward(blk, x, AttentionSpec(source=("qq", "kk"), **strip), (4, 4))
        qq = edited_block_forward(blk, x, AttentionSpec(source="qq", **strip), (4, 4))
        kk = edited_block_forward(blk, x, AttentionSpec(source="kk", **strip), (4, 4))
        bias = blk.attn.out_proj.bias
        # out_proj is affine: out(a v + b v) = W(a+b)v + bias
        assert torch.allclose(both, qq + kk - bias, atol=1e-4)
