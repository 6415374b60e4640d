"""clipseg-sparse: training-free open-vocabulary segmentation with a frozen CLIP and sparse attention.

    from clipseg_sparse import load_clip, AttentionSpec
    clip = load_clip("ViT-B-16", pretrained="openai")
    feats = clip.encode_dense(pixels, "qq/entmax:1.5")   # B x h x w x D

Names are imported lazily so that `import clipseg_sparse` (and `clipseg-sparse --help`) stays fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AttentionSpec": "attention",
    "PRESETS": "attention",
    "list_presets": "attention",
    "Normalizer": "normalizers",
    "normalize": "normalizers",
    "entmax": "normalizers",
    "load_clip": "model",
    "DenseCLIP": "model",
    "WeightsUnavailableError": "model",
    "Vocabulary": "text",
    "embed_names": "text",
    "Segmenter": "inference",
    "InferenceSettings": "inference",
    "SegmentationResult": "inference",
    "load_image": "images",
    "resolve_spec": "attention",
    "attention_backend": "accel",
    "ConfigMismatchError": "results",
    # segment: find images, plan which still need work, run
    "discover_images": "discovery",
    "OutputOptions": "outputs",
    "plan_run": "batch",
    "run_plan": "batch",
    # eval / fgovd / sweep / report / bench. Not `evaluate`: it is also the name of the submodule, which
    # replaces a package attribute of that name once imported (`from clipseg_sparse.evaluate import evaluate`).
    "DATASETS": "datasets",
    "PROTOCOLS": "protocols",
    "evaluate_fgovd": "fgovd",
    "Grid": "sweep",
    "GRIDS": "sweep",
    "SweepPaths": "sweep",
    "read_grid_file": "sweep",
    "run_sweep": "sweep",
    "collect": "report",
    "pivot": "report",
    "to_markdown": "report",
    "to_csv": "report",
    "write_plots": "report",
    "run_all": "bench",
    # analysis: attention statistics, gain vs diffusivity, gallery, demo (`explain` is its module's name too:
    # from clipseg_sparse.explain import explain)
    "analyze": "analysis",
    "gain_cells": "diffusivity",
    "write_gallery": "gallery",
    "build_demo": "demo",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
