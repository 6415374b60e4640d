"""Subspace statistics of DnA: V+ vs V- per block and head, and class subspaces of dense features.

Principal angles between the column spaces of A (n x p) and B (n x q) follow scipy's `subspace_angles`
(Bjorck & Golub; small angles refined as in Knyazev & Argentati 2002): orthonormal bases Q_A, Q_B from the
SVD, cos(theta_i) = singular values of Q_A^T Q_B, and for angles below 45 degrees theta_i = arcsin of the
singular values of Q_B - Q_A Q_A^T Q_B, which keeps tiny angles accurate.

Per head h, V+_h and V-_h are the value projections' rows h*d_h .. (h+1)*d_h (d_h x C); their column spaces
compared are those of the transposes, the d_h-dimensional subspaces of the C-dim token space that each
head reads. The normalised Frobenius inner product <V+_h, V-_h>_F / (|V+_h|_F |V-_h|_F) is -1 under the
warm start (V- = -eps V+), 0 for orthogonal maps. A class subspace is spanned by the top-`rank` right
singular vectors of the dense features of the patches labelled with that class (research/dna.md section 3:
the paper's exact construction is not public; this one is ours).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence

import torch

from ..errors import UserValueError
from ..datasets import IGNORE_INDEX
from ..runtime.fingerprint import file_digest
from .module import DenoisingAttention


def orthonormal_basis(a: torch.Tensor) -> torch.Tensor:
    """n x r orthonormal basis of the column space of a (n x p), rank r by scipy.linalg.orth's tolerance."""
    a = a.double()
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    tol = max(a.shape) * torch.finfo(a.dtype).eps * (s[0] if len(s) else 0)
    return u[:, : int((s > tol).sum())]


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles in degrees, ascending, between the column spaces of a (n x p) and b (n x q):
    min(rank a, rank b) of them."""
    qa, qb = orthonormal_basis(a), orthonormal_basis(b)
    if qa.shape[1] < qb.shape[1]:
        qa, qb = qb, qa
    cos = torch.linalg.svdvals(qa.T @ qb).clamp(-1, 1)  # descending -> angles ascending
    sin = torch.linalg.svdvals(qb - qa @ (qa.T @ qb)).clamp(-1, 1).flip(0)  # ascending
    theta = torch.where(cos**2 >= 0.5, torch.arcsin(sin), torch.arccos(cos))
    return torch.rad2deg(theta)


def frobenius_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """<a, b>_F / (|a|_F |b|_F), in [-1, 1]."""
    a, b = a.double(), b.double()
    return float((a * b).sum() / (a.norm() * b.norm()))


def value_subspaces(modules: dict[int, DenoisingAttention]) -> list[dict]:
    """One row per (block, head): V+/V- principal angles (mean, min, max, degrees), Frobenius cosine, alpha."""
    rows = []
    for block, m in modules.items():
        C, H = m.embed_dim, m.num_heads
        d = C // H
        v_pos = m.positive.in_proj_weight[2 * C :].detach()
        if m.v_neg is None:
            raise UserValueError(f"block {block}: the shared-value ablation has no V- to compare with V+")
        v_neg = m.v_neg.weight.detach()
        for h in range(H):
            p, n = v_pos[h * d : (h + 1) * d], v_neg[h * d : (h + 1) * d]
            angles = principal_angles(p.T, n.T)
            rows.append({
                "block": block, "head": h, "angle_mean": float(angles.mean()), "angle_min": float(angles.min()),
                "angle_max": float(angles.max()), "frobenius": frobenius_cosine(p, n), "alpha": float(m.alpha[h].detach()),
            })
    return rows


def class_subspaces(features: dict[int, torch.Tensor], rank: int = 5) -> dict:
    """Principal angles between every pair of class subspaces (top-`rank` right singular vectors of each
    class's n_c x D features; classes with fewer than `rank` features are left out).

    Returns classes used, pairs, and the mean over pairs of the smallest / mean principal angle (degrees).
    """
    bases = {}
    for c, f in sorted(features.items()):
        if f.shape[0] >= rank:
            _, _, vh = torch.linalg.svd(f.double(), full_matrices=False)
            bases[c] = vh[:rank].T
    pairs = list(itertools.combinations(bases, 2))
    smallest, mean = [], []
    for a, b in pairs:
        angles = principal_angles(bases[a], bases[b])
        smallest.append(float(angles.min()))
        mean.append(float(angles.mean()))
    return {
        "rank": rank, "classes": list(bases), "pairs": len(pairs),
        "min_angle_mean": sum(smallest) / len(pairs) if pairs else None,
        "angle_mean": sum(mean) / len(pairs) if pairs else None,
    }


def dense_class_features(clip, samples: Sequence, bench, resolution: int = 224) -> dict[int, torch.Tensor]:
    """{class: n_c x D dense features} of the centre crops of `samples`, patches labelled by majority."""
    from .data import TrainingSet

    data = TrainingSet(samples, resolution, clip.mean, clip.std, 0, bench, clip.patch_size, augment=False)
    chunks: dict[int, list[torch.Tensor]] = {}
    for i in range(len(data)):
        pixels, labels = data[(i, 0, 0)]
        feats = clip.encode_dense(pixels[None])[0].flatten(0, 1).cpu()  # h*w x D
        labels = labels.flatten()
        for c in labels.unique().tolist():
            if c != IGNORE_INDEX:
                chunks.setdefault(c, []).append(feats[labels == c])
    return {c: torch.cat(v) for c, v in chunks.items()}


def adapter_stats(
    clip, adapter, dataset: str | None = None, root=None, split: str = "val", limit: int | None = None,
    rank: int = 5, resolution: int = 224,
) -> dict:
    """V+/V- statistics of an adapter on `clip`; with a dataset, class-subspace angles of the dense
    features without and with the adapter (the model is restored afterwards)."""
    from ..datasets import DATASETS
    from .adapter import apply_adapter, build_modules, load_adapter
    from .convert import vision_blocks

    adapter = adapter if hasattr(adapter, "tensors") else load_adapter(adapter)
    record = {"adapter": adapter.path, "base": {k: adapter.meta[k] for k in ("model", "pretrained", "blocks")},
              "model": clip.config(),  # the weights measured on (a checkpoint's content digest included)
              **({"adapter_sha256": file_digest(adapter.path)} if Path(adapter.path).is_file() else {}),
              "value_subspaces": value_subspaces(build_modules(adapter, clip))}
    if dataset is None:
        return record
    bench = DATASETS.get(dataset)
    samples = bench.samples(root, split)[:limit]
    without = class_subspaces(dense_class_features(clip, samples, bench, resolution), rank)
    blocks = vision_blocks(clip)
    modules = apply_adapter(clip, adapter)
    try:
        with_dna = class_subspaces(dense_class_features(clip, samples, bench, resolution), rank)
    finally:
        for i, m in modules.items():
            blocks[i].attn = m.positive
    record["class_subspaces"] = {"dataset": dataset, "split": split, "images": len(samples), "resolution": resolution,
                                 "without": without, "with": with_dna}
    return record
