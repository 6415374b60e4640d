"""Token and text hooks: registered steps outside the attention arithmetic that some methods need.

A spec names them (`/hook:NAME`), so result files and table rows say which ran.

- token hook `fn(state)`: runs once the unmodified blocks are done, before the edited block(s); it may
  replace `state.x` (B x (1 + h*w) x C, the edited block's input) and entries of `state.main` (the hidden
  states that the main path's score terms and input aggregation read). SC-CLIP's LOF repair is one.
- text hook `fn(cosine, cls, text)`: rewrites the per-window cosine map B x T x h x w given the windows'
  CLS embeddings (B x D, unit length) and the text embeddings (T x D); CLIP Surgery's feature surgery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .registry import Registry


@dataclass(frozen=True)
class Hook:
    kind: str  # "token" | "text"
    fn: Callable


HOOKS: Registry[Hook] = Registry("hook")


def check_hook(name: str) -> None:
    """ValueError naming the registered hooks when `name` is not one."""
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r}; hooks: {', '.join(HOOKS.names())}")


def hooks_of(names, kind: str) -> list[Callable]:
    return [HOOKS.get(n).fn for n in names if HOOKS.get(n).kind == kind]


# -- SC-CLIP: local outlier factor and neighbour-mean repair ------------------------------------------------
def lof_outliers(x: torch.Tensor, n_neighbors: int = 30, contamination: float = 0.05, chunk: int = 64) -> torch.Tensor:
    """SC-CLIP's `lof_pytorch` on N x C tokens: a boolean mask of the outliers (N).

    As published: squared Euclidean distances, the k nearest after dropping the first (itself), reach
    distance max(d(p, o), k-distance of p) (the query's own k-distance, a simplification of LOF),
    LRD = k / mean reach, LOF = mean over neighbours of LRD(o) / LRD(p); outliers: LOF > the 0.95
    quantile (float32). Distances are computed in row chunks (same values, bounded memory).
    """
    dist = torch.cat([torch.norm(x[i : i + chunk, None] - x[None], dim=2, p=2) ** 2 for i in range(0, len(x), chunk)])
    knn_d, knn_i = torch.topk(dist, k=n_neighbors + 1, largest=False)
    knn_d, knn_i = knn_d[:, 1:], knn_i[:, 1:]
    reach = torch.max(knn_d, knn_d[:, -1:].expand_as(knn_d))
    lrd = n_neighbors / torch.nan_to_num(reach.mean(dim=1), nan=1e-6)
    lof = (lrd[knn_i] / lrd.unsqueeze(1)).mean(dim=1)
    return lof > torch.quantile(lof.to(torch.float32), 1 - contamination)


def neighbour_repair(tokens: torch.Tensor, outliers: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """SC-CLIP's `mean_interpolation`: each outlier token (N x C, row-major h x w grid) becomes the mean
    of its non-outlier 3 x 3 neighbours (zero padding counts as invalid); kept if it has none."""
    h, w = grid
    C = tokens.shape[-1]
    fmap = tokens.T.reshape(1, C, h, w)
    keep = (~outliers).to(tokens.dtype).view(1, 1, h, w)
    kernel = torch.ones(C, 1, 3, 3, dtype=tokens.dtype, device=tokens.device)
    kernel[:, 0, 1, 1] = 0
    sums = F.conv2d(F.pad(fmap * keep, (1, 1, 1, 1)), kernel, groups=C)
    count = F.conv2d(F.pad(keep, (1, 1, 1, 1)), kernel[:1])
    update = outliers.to(tokens.dtype).view(1, 1, h, w) * (count > 0).to(tokens.dtype)
    mean = sums / count.clamp_min(1)  # SC-CLIP sets zero counts to 1
    return (fmap * (1 - update) + mean * update).reshape(C, h * w).T


def _scclip_lof(state) -> None:
    """Outliers of the edited block's input patch tokens, per image (the published code runs one window
    at a time); the input and the hidden states the main path reads are repaired at those positions."""
    x = state.x.clone()
    repaired = {layer: h.clone() for layer, h in state.main.items()}
    for b in range(x.shape[0]):
        outliers = lof_outliers(x[b, 1:])
        if not outliers.any():
            continue
        x[b, 1:] = neighbour_repair(x[b, 1:], outliers, state.grid)
        for h in repaired.values():
            h[b, 1:] = neighbour_repair(h[b, 1:], outliers, state.grid)
    state.x = x
    state.main = repaired


HOOKS.register("lof", Hook("token", _scclip_lof), help="SC-CLIP outlier repair (LOF k=30, 5 %, 3x3 neighbour mean)")
