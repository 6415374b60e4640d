"""Exact fast text encoding (text_tower.py) against open_clip's own encode_text, and its progress output."""

from __future__ import annotations

import dataclasses

import open_clip
import pytest
import torch
import torch.nn.functional as F

from clipseg_sparse.segment.vocabulary import embed_names
from clipseg_sparse.models.text_tower import cut_plan, encode_cut, encode_tokens, pool_index

# templates of different lengths, one prompt close to the 77-token context and one past it (truncated
# by the tokenizer, so its end-of-text token sits at position 76)
LONG = "a photo of a " + " ".join(["very"] * 66) + " small cat."
PROMPTS = [
    "cat.",
    "a photo of a cat.",
    "a bad photo of the chest of drawers.",
    "itap of a swimming pool.",
    "a low resolution photo of a traffic light.",
    LONG,
    "a photo of a " + " ".join(["very"] * 90) + " big dog.",
    "sky",
    "a sculpture of the person.",
]


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within 1e-6 after L2 normalisation (what the project uses), and within 1e-6 of each row's norm
    before it: open_clip's own result moves by ~2e-7 of the norm when only the batch changes."""
    unit = (F.normalize(got, dim=-1) - F.normalize(expected, dim=-1)).abs().max()
    raw = ((got - expected).abs().amax(-1) / expected.norm(dim=-1)).max()
    return bool(unit <= 1e-6 and raw <= 1e-6)


def _encode_watched(model: torch.nn.Module, transformer: torch.nn.Module, tokens: torch.Tensor, batch_size: int):
    """encode_tokens(model, tokens), and the sequence lengths `transformer` was run on."""
    seen: list[int] = []
    handle = transformer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    try:
        return encode_tokens(model, tokens, batch_size=batch_size), seen
    finally:
        handle.remove()


def test_long_prompt_reaches_the_end_of_the_context():
    tokens = open_clip.get_tokenizer("ViT-B-16")(PROMPTS)
    ends = tokens.argmax(-1) + 1
    assert 70 <= int(ends[PROMPTS.index(LONG)]) < 77 and int(ends.max()) == 77 and int(ends.min()) <= 4


def test_vit_b16_equals_open_clip_encode_text(vit_b16):
    """The CLIP class (text tower parts on the model), buckets of 3 prompts, mixed lengths."""
    tokens = vit_b16.tokenizer(PROMPTS)
    with torch.inference_mode():
        expected = vit_b16.model.encode_text(tokens)
    got, seen = _encode_watched(vit_b16.model, vit_b16.model.transformer, tokens, 3)
    assert _close(got, expected)
    ends = sorted(int(e) + 1 for e in tokens.argmax(-1))
    assert seen == [max(ends[i : i + 3]) for i in range(0, len(ends), 3)]  # tight buckets, shortest first
    normalized = vit_b16.encode_text(PROMPTS[4:], batch_size=4)  # DenseCLIP's entry point
    assert (normalized - F.normalize(expected[4:], dim=-1)).abs().max() <= 1e-6


def test_vit_l14_text_tower_equals_open_clip():
    """The real ViT-L-14 text tower (12 blocks, width 768), built alone as open_clip's TextTransformer."""
    from open_clip.model import _build_text_tower

    cfg = open_clip.get_model_config("ViT-L-14")
    torch.manual_seed(0)
    tower = _build_text_tower(cfg["embed_dim"], cfg["text_cfg"]).eval()
    tokens = open_clip.get_tokenizer("ViT-L-14")(PROMPTS[:6])
    with torch.inference_mode():
        expected = tower(tokens)
    got = encode_tokens(tower, tokens, batch_size=4)
    assert cut_plan(tower) is not None
    assert _close(got, expected)


TINY_VISION = {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16}
TINY_TEXT = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}


def _tiny(custom_text: bool = False, **text_cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = open_clip.model.CustomTextCLIP if custom_text else open_clip.model.CLIP
    return cls(embed_dim=16, vision_cfg=TINY_VISION, text_cfg={**TINY_TEXT, **text_cfg}).eval()


@pytest.mark.parametrize(
    "custom_text, text_cfg",
    [
        (False, {"no_causal_mask": True}),  # bidirectional: padding changes every token
        (False, {"pool_type": "last"}),  # reads the last context position, a padding token
        (True, {"no_causal_mask": True, "pool_type": "first"}),
        (True, {"embed_cls": True}),  # CoCa-style appended class token, pooled last
    ],
)
def test_fallback_runs_full_length_where_the_cut_is_not_exact(custom_text, text_cfg):
    model = _tiny(custom_text, **text_cfg)
    tokens = open_clip.get_tokenizer("ViT-B-16")(PROMPTS[:4])
    with torch.inference_mode():
        expected = model.encode_text(tokens)
    assert cut_plan(model) is None
    transformer = model.text.transformer if custom_text else model.transformer
    got, seen = _encode_watched(model, transformer, tokens, 2)
    assert seen == [tokens.shape[1] + int(bool(text_cfg.get("embed_cls")))] * 2
    assert _close(got, expected)


def test_cutting_a_bidirectional_tower_would_be_wrong():
    """Why the fallback exists: forced through the cut, a bidirectional tower gives other embeddings."""
    causal, bidir = _tiny(), _tiny(no_causal_mask=True)
    bidir.load_state_dict(causal.state_dict())
    plan = cut_plan(causal)
    forced = dataclasses.replace(plan, transformer=bidir.transformer, attn_mask=torch.zeros_like(plan.attn_mask))
    tokens = open_clip.get_tokenizer("ViT-B-16")(PROMPTS[:4])
    with torch.inference_mode():
        assert not torch.allclose(encode_cut(forced, tokens, pool_index(tokens, plan)), bidir.encode_text(tokens), atol=1e-3)


@pytest.mark.parametrize(
    "custom_text, text_cfg",
    [(True, {}), (False, {"pool_type": "eos", "eos_id": 49407}), (True, {"pool_type": "first"})],
)
def test_other_cuttable_towers_equal_open_clip(custom_text, text_cfg):
    """A TextTransformer inside CustomTextCLIP, and pooling at the eos token or the first token."""
    model = _tiny(custom_text, **text_cfg)
    tokens = open_clip.get_tokenizer("ViT-B-16")(PROMPTS)
    with torch.inference_mode():
        expected = model.encode_text(tokens)
    assert cut_plan(model) is not None
    transformer = model.text.transformer if custom_text else model.transformer
    got, seen = _encode_watched(model, transformer, tokens, 5)
    # the end-of-text token (49407) is both the argmax and the eos token here; `first` needs one token
    ends = sorted(1 if text_cfg.get("pool_type") == "first" else int((row == 49407).nonzero()[0]) + 1 for row in tokens)
    assert seen == [max(ends[i : i + 5]) for i in range(0, len(ends), 5)]
    assert _close(got, expected)


def test_progress_bar_on_stderr(tiny_clip, capsys):
    embed_names(tiny_clip, ["cat", "dog"], ("a photo of a {}.", "{}", "a {} in the wild."), use_cache=False, progress=True)
    err = capsys.readouterr().err
    assert "text: 2 names x 3 templates" in err and "prompts/s" in err and "6/6" in err


def test_no_output_without_progress(tiny_clip, capsys):
    embed_names(tiny_clip, ["cat"], "single", use_cache=False)
    assert capsys.readouterr().err == ""


def test_cache_reuse_is_announced(tiny_clip, tmp_path, capsys):
    tagged = dataclasses.replace(tiny_clip, pretrained="some-tag")  # a weights key, so the cache is used
    first = embed_names(tagged, ["cat", "dog"], "single", cache_dir=tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "prompts/s" in err and "reusing" not in err
    again = embed_names(tagged, ["cat", "dog"], "single", cache_dir=tmp_path, progress=True)
    err = capsys.readouterr().err
    assert torch.equal(first, again)
    assert "reusing the cached embeddings of 2 names x 1 templates" in err and "prompts/s" not in err
    assert str(tmp_path) in err.replace("\n", "")
