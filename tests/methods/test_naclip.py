"""NACLIP (preset `naclip`: kk with a Gaussian neighbourhood prior, no residual or FFN)."""

import pytest
import torch

from clipseg_sparse.attention import AttentionSpec, gaussian_prior


def test_preset_contents():
    assert AttentionSpec.parse("naclip") == AttentionSpec(source="kk", gauss_sigma=5.0, residual=False, ffn=False)


def test_gaussian_prior_shape_and_values():
    prior = gaussian_prior((3, 4), sigma=1.0)
    assert prior.shape == (13, 13)
    assert torch.all(prior[0] == 0) and torch.all(prior[:, 0] == 0)
    assert torch.allclose(torch.diagonal(prior)[1:], torch.ones(12))
    # neighbours one step apart: exp(-1/2)
    assert prior[1, 2].item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item())
