"""ClearCLIP (preset `clearclip`: qq without residual and FFN)."""

from clipseg_sparse.attention import AttentionSpec


def test_preset_contents():
    assert AttentionSpec.parse("clearclip") == AttentionSpec(source="qq", residual=False, ffn=False)
