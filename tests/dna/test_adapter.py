"""DnA: the module against its formula written out per head, conversion, gradients, adapters, subspaces."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from entmax import entmax15, sparsemax

from clipseg_sparse.dna import AdapterError, DenoisingAttention, apply_adapter, convert_to_dna, load_adapter, save_adapter
from clipseg_sparse.dna.adapter import check_compatible
from clipseg_sparse.dna.data import patch_majority
from clipseg_sparse.dna.stats import principal_angles, value_subspaces


def _random_dna(C=8, H=2, **kw) -> DenoisingAttention:
    torch.manual_seed(1)
    m = DenoisingAttention(C, H, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.7)
    return m


def _by_hand(m: DenoisingAttention, x: torch.Tensor, sign: int, shared: bool, neg_map=None) -> torch.Tensor:
    """The DnA formula with explicit loops over batch and head, rows normalised by hand."""
    C, H = m.embed_dim, m.num_heads
    d = C // H
    W, b = m.positive.in_proj_weight.detach(), m.positive.in_proj_bias.detach()
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        xn = x[n]
        q, k, v = xn @ W[:C].T + b[:C], xn @ W[C : 2 * C].T + b[C : 2 * C], xn @ W[2 * C :].T + b[2 * C :]
        qn = xn @ m.q_neg.weight.detach().T + m.q_neg.bias.detach()
        vn = v if shared else xn @ m.v_neg.weight.detach().T + m.v_neg.bias.detach()
        for h in range(H):
            sl = slice(h * d, (h + 1) * d)
            s_pos = q[:, sl] @ k[:, sl].T / math.sqrt(d)
            s_neg = qn[:, sl] @ k[:, sl].T / math.sqrt(d)
            p = torch.exp(s_pos - s_pos.max(1, keepdim=True).values)
            p = p / p.sum(1, keepdim=True)
            if neg_map is None:
                e = torch.exp(-s_neg - (-s_neg).max(1, keepdim=True).values)
                nmap = e / e.sum(1, keepdim=True)
            else:
                nmap = neg_map(-s_neg)
            out[n, :, sl] = p @ v[:, sl] + sign * m.alpha[h].detach() * (nmap @ vn[:, sl])
    return out @ m.positive.out_proj.weight.detach().T + m.positive.out_proj.bias.detach()


@pytest.mark.parametrize("sign", [1, -1])
def test_module_equals_formula_both_published_signs(sign):
    m = _random_dna(sign=sign)
    x = torch.randn(2, 5, 8)
    got, weights = m(x, x, x, need_weights=False)
    assert weights is None
    torch.testing.assert_close(got, _by_hand(m, x, sign, shared=False), atol=1e-5, rtol=1e-5)


def test_published_default_signs():
    # vit/dna_models.py adds the negative branch; the shared-value ablation (vit/dna.py) subtracts it
    assert DenoisingAttention(8, 2).sign == 1
    assert DenoisingAttention(8, 2, shared_values=True).sign == -1


def test_shared_value_ablation_equals_formula():
    m = _random_dna(shared_values=True)
    assert m.v_neg is None
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(m(x)[0], _by_hand(m, x, -1, shared=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("negative,fn", [("entmax:1.5", lambda z: entmax15(z, dim=-1)), ("sparsemax", lambda z: sparsemax(z, dim=-1))])
def test_entmax_negative_branch_equals_formula(negative, fn):
    m = _random_dna(negative=negative)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(m(x)[0], _by_hand(m, x, 1, shared=False, neg_map=fn), atol=1e-5, rtol=1e-5)
    # and it is sparse: some keys get exactly zero negative weight
    with torch.no_grad():
        scores = -(m.q_neg(x)[0, :, :4] @ torch.nn.functional.linear(x, m.positive.in_proj_weight[8:12], m.positive.in_proj_bias[8:12])[0].T) / 2
    assert (fn(scores) == 0).any()


def test_not_batch_first_and_boolean_mask():
    m = _random_dna()
    x = torch.randn(2, 5, 8)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)  # causal: True = not allowed
    seq_first = DenoisingAttention(8, 2, positive=torch.nn.MultiheadAttention(8, 2, batch_first=False))
    seq_first.load_state_dict(m.state_dict())
    torch.testing.assert_close(seq_first(x.transpose(0, 1), attn_mask=mask)[0].transpose(0, 1), m(x, attn_mask=mask)[0])
    # masked keys get no weight in either branch: token 0 sees only itself
    one = m(x[:, :1])[0]
    torch.testing.assert_close(m(x, attn_mask=mask)[0][:, :1], one, atol=1e-6, rtol=1e-5)


def _blocks(clip):
    return clip.model.visual.transformer.resblocks


@pytest.mark.parametrize("shared", [False, True])
def test_conversion_preserves_output_within_a_bound_that_shrinks_with_eps(tiny_clip, shared):
    x = torch.randn(2, 3, 64, 64)
    ref_dense, ref_image = tiny_clip.encode_dense(x), tiny_clip.model.encode_image(x)
    block_in = torch.randn(2, 17, 96)
    ref_block = _blocks(tiny_clip)[2](block_in)
    diffs = []
    for eps in (1e-2, 1e-4):
        clip = copy.deepcopy(tiny_clip)
        modules = convert_to_dna(clip, 2, eps=eps, shared_values=shared)
        assert sorted(modules) == [1, 2]
        with torch.no_grad():
            block = (_blocks(clip)[2](block_in) - ref_block).abs().max().item()
            dense = (clip.encode_dense(x) - ref_dense).abs().max().item()
            image = (clip.model.encode_image(x) - ref_image).abs().max().item()
        diffs.append((block, dense, image))
    (b2, d2, i2), (b4, d4, i4) = diffs
    assert 0 < b4 < b2 / 30 and d4 < d2 / 30 and i4 < i2 / 30  # O(eps): 100x smaller eps, ~100x smaller change
    assert b4 < 1e-3 and d4 < 1e-3


def test_warm_start_values(tiny_clip):
    clip = copy.deepcopy(tiny_clip)
    m = convert_to_dna(clip, [-1], eps=1e-3)[2]
    W, b = m.positive.in_proj_weight, m.positive.in_proj_bias
    torch.testing.assert_close(m.q_neg.weight, 1e-3 * W[:96])
    torch.testing.assert_close(m.q_neg.bias, 1e-3 * b[:96])
    torch.testing.assert_close(m.v_neg.weight, -1e-3 * W[192:])
    torch.testing.assert_close(m.v_neg.bias, -1e-3 * b[192:])
    assert m.alpha.tolist() == [0.5] * 3
    rows = value_subspaces({2: m})  # V- = -eps V+: same column space, Frobenius cosine -1
    assert all(r["angle_max"] < 1e-3 and abs(r["frobenius"] + 1) < 1e-9 for r in rows)


@pytest.mark.parametrize("negative", ["softmax", "entmax:1.5"])
def test_gradients_reach_only_the_negative_branch(tiny_clip, negative):
    clip = copy.deepcopy(tiny_clip)
    convert_to_dna(clip, 2, negative=negative)
    trainable = {n for n, p in clip.model.named_parameters() if p.requires_grad}
    expected = {f"visual.transformer.resblocks.{i}.attn.{n}" for i in (1, 2) for n in ("alpha", "q_neg.weight", "q_neg.bias", "v_neg.weight", "v_neg.bias")}
    assert trainable == expected
    feats = clip.dense_forward(torch.randn(2, 3, 64, 64))
    (feats[..., 0].sum() + clip.model.encode_image(torch.randn(1, 3, 64, 64)).sum()).backward()
    for n, p in clip.model.named_parameters():
        if n in expected:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_adapter_round_trip(tiny_clip, tmp_path):
    clip = copy.deepcopy(tiny_clip)
    modules = convert_to_dna(clip, 2, negative="entmax:1.5", sign=-1)
    with torch.no_grad():
        for m in modules.values():
            for p in m.negative_parameters().values():
                p.normal_(0, 0.1)
    path = save_adapter(clip, tmp_path / "a.safetensors", training={"steps": 3})
    x = torch.randn(1, 3, 64, 64)
    expected = clip.encode_dense(x)
    adapter = load_adapter(path)
    assert adapter.meta["model"] == "tiny-vit" and adapter.meta["pretrained"] == "none" and adapter.blocks == [1, 2]
    assert adapter.meta["sign"] == "-1" and adapter.meta["negative"] == "entmax:1.5"
    assert adapter.num_parameters == 2 * (2 * 96 * 96 + 2 * 96 + 3)  # 2 d^2 + 2 d + heads per block
    fresh = copy.deepcopy(tiny_clip)
    apply_adapter(fresh, path)
    torch.testing.assert_close(fresh.encode_dense(x), expected)
    assert not torch.allclose(tiny_clip.encode_dense(x), expected, atol=1e-4)  # the adapter changes the output


@pytest.mark.parametrize("key,value", [("model", "ViT-B-16"), ("pretrained", "openai"), ("width", "768"), ("heads", "12"), ("num_blocks", "12")])
def test_adapter_mismatch_is_one_line(tiny_clip, tmp_path, key, value):
    clip = copy.deepcopy(tiny_clip)
    convert_to_dna(clip, 1)
    adapter = load_adapter(save_adapter(clip, tmp_path / "a.safetensors"))
    bad = type(adapter)(adapter.path, adapter.tensors, {**adapter.meta, key: value})
    with pytest.raises(AdapterError, match=key) as e:
        check_compatible(bad, tiny_clip)
    assert "\n" not in str(e.value)


def test_not_an_adapter(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(AdapterError, match="not a DnA adapter"):
        load_adapter(tmp_path / "w.safetensors")
    with pytest.raises(AdapterError, match="not found"):
        load_adapter(tmp_path / "missing.safetensors")


def test_principal_angles_of_known_subspaces():
    e = torch.eye(4, dtype=torch.float64)
    assert principal_angles(e[:, :2], e[:, :2] @ torch.tensor([[2.0, 1.0], [0.0, 3.0]], dtype=torch.float64)).abs().max() < 1e-6
    torch.testing.assert_close(principal_angles(e[:, :2], e[:, 2:]), torch.full((2,), 90.0, dtype=torch.float64))
    for deg in (30.0, 1e-3, 75.0):
        t = math.radians(deg)
        b = torch.stack([e[:, 0], math.cos(t) * e[:, 1] + math.sin(t) * e[:, 2]], 1)
        got = principal_angles(e[:, :2], b)
        torch.testing.assert_close(got, torch.tensor([0.0, deg], dtype=torch.float64), atol=1e-9, rtol=1e-7)
    # one direction against a plane: the angle to its projection
    v = torch.tensor([[1.0], [1.0], [1.0], [0.0]], dtype=torch.float64)
    expected = math.degrees(math.acos(math.sqrt(2 / 3)))
    assert abs(principal_angles(e[:, :2], v).item() - expected) < 1e-9


def test_patch_majority_by_hand():
    labels = np.array([
        [1, 1, 2, 2],
        [1, 3, 255, 255],
        [255, 255, 4, 5],
        [255, 255, 5, 4],
    ])
    # patches of 2x2: [1,1,1,3] -> 1; [2,2,255,255] -> 2; all ignore -> 255; [4,5,5,4] tie -> 4 (lowest)
    assert patch_majority(labels, 2).tolist() == [[1, 2], [255, 4]]
