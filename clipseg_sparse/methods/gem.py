"""GEM (Bousselham et al., CVPR 2024): grounding everything, self-self attention on a parallel path.

Read from WalBouss/GEM@5fa677c (`gem/gem_utils.py`: `SelfSelfAttention`, `GEMResidualBlock`). The spec:
self-self attention of L2-normalised v, k and q with the adaptive temperature and one clustering step, the
mean of the three, on a parallel path over the last 6 blocks (residual kept, no FFN). Quirks copied: `GEM_NOTES`
(docs/datasets.md, Presets). GEM publishes no evaluation code (WalBouss/GEM#5): its numbers on these benchmarks
come from ClearCLIP's re-implementation, so its protocol is ClearCLIP's (`clearclip.PROTOCOL`). Grid:
`sweeps/grids/gem.toml`.
"""

from __future__ import annotations

import dataclasses

from ..attention.presets import register_entmax_variant, register_preset
from ..evaluation.protocols import PROTOCOLS
from ..evaluation.published import register_published
from . import clearclip

GEM_NOTES = (
    "copied: 6 blocks (gem_depth 7 gives range(1, 7)), temperature = mean token norm of the original path's "
    "ln_1 state x d^-1/2 per image, final maps applied to the unnormalised v, CLS included in the attention"
)
register_preset(
    "gem",
    "vv[cos,temp:auto,iter:1]+kk[cos,temp:auto,iter:1]+qq[cos,temp:auto,iter:1]/softmax/noffn/layers:6/parallel/avg",
    "GEM (Bousselham et al., CVPR 2024): self-self attention of L2-normalised v, k and q with the adaptive "
    "temperature and one clustering step, mean of the three, on a parallel path over the last 6 blocks "
    "(residual kept, no FFN)",
    GEM_NOTES,
)
register_entmax_variant("gem")

PROTOCOL = PROTOCOLS.register(
    "gem",
    dataclasses.replace(
        clearclip.PROTOCOL,
        name="gem",
        attention="gem",
        source="ClearCLIP's protocol (mc-lan/ClearCLIP@fd05ce4); under which ClearCLIP re-evaluated GEM; GEM's repository has no evaluation",
    ),
    help="GEM (CVPR 2024), under ClearCLIP's protocol (its repository has no evaluation code)",
)

# GEM's paper reports VOC21 46.2 and PC60 32.6 under its own evaluation (no code for it); the numbers under this
# protocol (ClearCLIP's) are ClearCLIP's re-implementation of GEM, five sets. Not measured here.
register_published(
    PROTOCOL,
    {"voc20": 79.9, "context59": 35.9, "coco-stuff": 23.7, "cityscapes": 30.8, "ade20k": 15.7},
    "ClearCLIP's re-implementation of GEM: mc-lan/ClearCLIP assets/results.png",
    note="GEM's own paper: VOC21 46.2, PC60 32.6 (as yvhangyang/ResCLIP figs/main_results_w.png lists them), another protocol",
)  # fmt: skip
