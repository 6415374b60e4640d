"""Published methods, one room each: presets, stages, protocol, constants and notes (see methods/README.md).

This package is the catalog: `PRESETS`, `STAGES`, `PROTOCOLS`, `PIPELINES`, `REGION_SOURCES` and `FORWARDS`
name it in their `locations`, so their first lookup imports it, and it imports every method module of the
folder: those of `METHODS` first, in that order (the order `ls` lists them in), then any other module here
(a new method's file is found without an edit here). May import `evaluation` and below; nothing below
imports a method.
"""

from __future__ import annotations

import importlib
import pkgutil

# In dependency order: a method that reuses another's protocol or constants comes after it.
METHODS = (
    "baselines",  # clip, maskclip
    "sclip",  # SCLIP (ECCV 2024): qq+kk
    "clearclip",  # ClearCLIP (ECCV 2024): qq without residual and FFN; its protocol serves gem and clipsurgery
    "naclip",  # NACLIP (WACV 2025): kk + Gaussian prior; protocols naclip, naclip-v1
    "scclip",  # SC-CLIP: mid map, aggregation, multi-level sum; the lof stage
    "gem",  # GEM (CVPR 2024): self-self attention on a parallel path, under ClearCLIP's protocol
    "clipsurgery",  # CLIP Surgery: v-v parallel path; the surgery stage; under ClearCLIP's protocol
    "resclip",  # ResCLIP (CVPR 2025) on NACLIP: the RCS map tap and SFR feedback
    "proxyclip",  # ProxyCLIP (ECCV 2024): a proxy backbone's feature cosine (ext:)
    "corrclip",  # CorrCLIP (ICCV 2025) on ProxyCLIP: region scope, mask class tokens; the regionvote stage
    "ovstitcher",  # OV-Stitcher (CVPR 2026): CorrCLIP with the windows stitched into image-wide attention
    "corrclipv2",  # CorrCLIPv2 on CorrCLIP: whole-image RADIO features, the retrieve stage (image bank)
    "trident",  # Trident (ICCV 2025): DINO proxy per window, splice; the sam stage
    "trident_refine",  # Trident's SAM prompt refinement: the samrefine stage, protocol trident-samrefine
    "lposs",  # LPOSS / LPOSS+ (CVPR 2025): the lp stages (joint patch graph over windows, Lab pixel graph)
    "pearl",  # PEARL (CVPR 2026): Procrustes-aligned attention taps pa / pakk, the tlp post stage
    "sam3",  # SAM 3 zero-shot (SegEarth-OV3): the sam3 pipeline and protocol, not a CLIP spec
    "activesam",  # ActiveSAM on the sam3 pipeline: context tokens, presence preview, MABC background
)


def import_methods() -> None:
    """Import the modules of `METHODS` in order, then every other module of this folder (once each)."""
    for name in (*METHODS, *sorted({m.name for m in pkgutil.iter_modules(__path__)} - set(METHODS))):
        importlib.import_module(f"{__name__}.{name}")


import_methods()
