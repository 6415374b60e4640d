"""The text presence adjustment (`segment/presence.py`) against the published code that uses it: the clustering of
RF-CLIP's and CASS's `hierarchical_clustering` (sklearn's cosine distances, scipy's `linkage` with complete or Ward
linkage, `fcluster` with the distance criterion) and `hierarchical_prompt` (liblacklucy/RF-CLIP@c2b333e
`custom_segmentor.py`; MICV-yonsei/CASS@228ecdd `cass_segmentor.py` has the same code with Ward linkage)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from clipseg_sparse.errors import UserValueError
from clipseg_sparse.segment.presence import Presence, cosine_distances, linkage_clusters


def ref_clusters(text, h_threshold, method="complete"):
    """hierarchical_clustering: sklearn's cosine_distances (numpy), squareform, linkage, fcluster - 1."""
    X = text.numpy().astype(np.float32)
    X = X / np.linalg.norm(X, axis=1, keepdims=True)
    d = np.clip(1 - X @ X.T, 0, 2)
    np.fill_diagonal(d, 0)
    return fcluster(linkage(squareform(d), method=method), t=h_threshold, criterion="distance") - 1


def ref_hierarchical_prompt(image_features, sims, text, clusters, alpha):
    adjusted = text.clone()
    sims = sims.numpy()
    for cluster_id in range(len(set(clusters))):
        indices = np.where(clusters == cluster_id)[0]
        class_i = int(indices[np.argmax(sims[indices])])
        t = F.normalize(text[class_i].unsqueeze(0), dim=1)
        _, topk = torch.topk((F.normalize(image_features, dim=1) @ t.T).squeeze(1), min(2, image_features.shape[0]))
        mean_vector = F.normalize(image_features[topk].mean(dim=0), dim=0)
        adjusted[class_i] = F.normalize((1 - alpha) * t.squeeze(0) + alpha * mean_vector, dim=0)
    return adjusted


@pytest.mark.parametrize("method", ["complete", "ward"])
def test_linkage_clusters_cut_at_the_threshold(method):
    """Three tight groups of names far apart: one cluster each at a mid cut, singletons below the groups'
    spread, one cluster above every distance; ids numbered by first member."""
    g = torch.Generator().manual_seed(7)
    axes = torch.eye(16)[:3]  # orthogonal centres: cosine distance 1 between groups
    text = F.normalize(axes[[0, 1, 0, 2, 1, 2]] + 0.05 * torch.randn(6, 16, generator=g), dim=-1)
    spread = cosine_distances(text)[[0, 1, 3], [2, 4, 5]].max().item()
    assert spread < 0.1
    assert linkage_clusters(text, method, 0.5).tolist() == [0, 1, 0, 2, 1, 2]
    assert linkage_clusters(text, method, spread / 2).tolist() == [0, 1, 2, 3, 4, 5]
    assert linkage_clusters(text, method, 10.0).tolist() == [0] * 6
    assert linkage_clusters(text[:1], method, 0.5).tolist() == [0]


def test_presence_logits_equal_hierarchical_prompt():
    g = torch.Generator().manual_seed(4)
    text = F.normalize(torch.randn(9, 12, generator=g), dim=-1)
    feats = F.normalize(torch.randn(2, 30, 12, generator=g), dim=-1)
    sims = F.normalize(torch.randn(2, 12, generator=g), dim=-1) @ text.T
    clusters = ref_clusters(text, 1.0)
    got = Presence("complete", 0.3, 0.2, 1.0).logits(feats, sims, text, linkage_clusters(text, "complete", 1.0))
    for b in range(2):
        adjusted = ref_hierarchical_prompt(feats[b], sims[b], text, clusters, 0.2)
        assert (got[b] - ((feats[b] @ adjusted.T) * 0.7 + sims[b] * 0.3)).abs().max() < 1e-6


def test_an_unknown_linkage_is_refused():
    with pytest.raises(UserValueError, match="complete, ward"):
        linkage_clusters(torch.eye(3), "single", 0.5)
