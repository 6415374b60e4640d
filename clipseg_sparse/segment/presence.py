"""Text presence adjustment: CASS's object-presence prior on the text embeddings, which RF-CLIP reuses.

Read from MICV-yonsei/CASS@228ecdd (`cass_segmentor.py`: `hierarchical_clustering`, `hierarchical_prompt`,
`forward_feature`; Ward linkage) and liblacklucy/RF-CLIP@c2b333e (`custom_segmentor.py`: the same code with complete
linkage). Once per vocabulary the names' text embeddings are clustered (`linkage_clusters`: agglomerative
clustering of their cosine distances, cut at a distance with scipy's `linkage` + `fcluster(t, 'distance')`, as published). Per
window (`Presence.logits`), with g the cosine of a global image embedding with every name (the whole image's CLS, or
the window's): in each cluster the name with the largest g is moved towards the image, t <- normalize((1 - alpha) t +
alpha m), m the L2-normalised mean of the `top` patch features most similar to t, and the window's logits are
(1 - weight) cos(patch, t_adjusted) + weight g. The forwards that compute g call it (RF-CLIP's `refocus`,
`methods/rfclip.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserValueError

LINKAGES = ("complete", "ward")


def cosine_distances(text: torch.Tensor) -> torch.Tensor:
    """Q x Q float64 1 - cos between the rows of `text`, clipped to [0, 2], diagonal 0 (sklearn's
    `cosine_distances`, computed in the embeddings' float32)."""
    t = F.normalize(text.detach().float().cpu(), dim=-1)
    d = (1 - t @ t.T).clamp_(0, 2)
    d.fill_diagonal_(0)
    return d.double()


def linkage_clusters(text: torch.Tensor, linkage: str, threshold: float) -> torch.Tensor:
    """Q int64 flat-cluster ids (0..K-1, numbered by first member) of Q text embeddings: agglomerative clustering
    of their cosine distances with `linkage` cut at `threshold`, as published:
    `fcluster(linkage(squareform(d), method), t=threshold, criterion='distance')`."""
    from scipy.cluster.hierarchy import fcluster
    from scipy.cluster.hierarchy import linkage as merges
    from scipy.spatial.distance import squareform

    if linkage not in LINKAGES:
        raise UserValueError(f"unknown linkage {linkage!r}; choose {', '.join(LINKAGES)}")
    d = cosine_distances(text).numpy()
    if len(d) < 2:
        return torch.zeros(len(d), dtype=torch.int64)
    flat = fcluster(merges(squareform(d, checks=False), method=linkage), t=threshold, criterion="distance")
    first: dict[int, int] = {}
    return torch.tensor([first.setdefault(int(c), len(first)) for c in flat], dtype=torch.int64)


@dataclass(frozen=True)
class Presence:
    """The adjustment's constants: linkage and cut `threshold` of the name clusters, the mix `alpha` of the patch
    mean into the text, the `weight` of the global similarity in the logits, the `top` patches averaged."""

    linkage: str
    weight: float
    alpha: float
    threshold: float
    top: int = 2

    def logits(self, feats: torch.Tensor, global_sim: torch.Tensor, text: torch.Tensor, clusters: torch.Tensor) -> torch.Tensor:
        """B x N x Q window logits. feats: B x N x D L2-normalised patch features; global_sim: B x Q cosine of each
        window's global embedding with the names; text: Q x D L2-normalised names; clusters: Q ids from
        `linkage_clusters`."""
        K = int(clusters.max()) + 1
        member = clusters.to(text.device)[None, :] == torch.arange(K, device=text.device)[:, None]  # K x Q
        out = []
        for f, g in zip(feats, global_sim):
            reps = g[None, :].masked_fill(~member, float("-inf")).argmax(-1)  # the first largest g of each cluster
            t = F.normalize(text[reps], dim=-1)
            top = (f @ t.T).topk(min(self.top, f.shape[0]), dim=0).indices  # top x K
            m = F.normalize(f[top].mean(0), dim=-1)
            adjusted = text.clone()
            adjusted[reps] = F.normalize((1 - self.alpha) * t + self.alpha * m, dim=-1)
            out.append((1 - self.weight) * (f @ adjusted.T) + self.weight * g)
        return torch.stack(out)
