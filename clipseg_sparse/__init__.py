"""clipseg-sparse: training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention.

    from clipseg_sparse import load_clip, Segmenter
    clip = load_clip("ViT-B-16", pretrained="openai")
    feats = clip.encode_dense(pixels, "qq/entmax:1.5")        # B x h x w x D
    result = Segmenter(clip, "cat,dog,grass", spec="sclip").predict("photo.jpg")

The folders follow the data flow; each imports only the folders listed before it (`.importlinter` keeps it so):

- `runtime/`    how the code runs: devices, weights files, atomic writes, processes, progress, memory
- `attention/`  the engine: how the last blocks mix tokens (spec language, sources, normalizers incl. entmax)
- `models/`     the networks we load: `load_clip`, `DenseCLIP`, the fast text tower, proxy backbones
- `segment/`    image -> label map: settings, preprocessing, windows, label maps, `Segmenter`, vocabularies
- `datasets/`   benchmark readers;  `files/`: inputs and outputs on disk;  `evaluation/`: scores and protocols
- `methods/`    published methods, one room each (`methods/sclip.py`, ...; `methods/README.md` says how to add one)
- `sweeps/`, `bench/`, `dna/`, `analysis/`, `cli/`: grids and tables, timing, the trainable method, where sparsity
  helps, and the command line on top

Names are imported lazily so that `import clipseg_sparse` (and `clipseg-sparse --help`) stays fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__version__ = "0.1.0"

_EXPORTS = {
    "AttentionSpec": "attention",
    "PRESETS": "attention",
    "list_presets": "attention",
    "resolve_spec": "attention",
    "Normalizer": "attention.normalizers",
    "normalize": "attention.normalizers",
    "entmax": "attention.normalizers",
    "load_clip": "models.clip",
    "DenseCLIP": "models.clip",
    "WeightsUnavailableError": "runtime.weights",
    "UserError": "errors",
    "Vocabulary": "segment.vocabulary",
    "embed_names": "segment.vocabulary",
    "Segmenter": "segment.segmenter",
    "InferenceSettings": "segment.settings",
    "SegmentationResult": "segment.labels",
    "load_image": "segment.images",
    "attention_backend": "runtime.accel",
    "ConfigMismatchError": "files.results",
    # segment: find images, plan which still need work, run
    "discover_images": "files.inputs",
    "OutputOptions": "files.outputs",
    "plan_run": "files.folder",
    "run_plan": "files.folder",
    # eval / fgovd / sweep / report / bench
    "DATASETS": "datasets",
    "PROTOCOLS": "evaluation.protocols",
    "evaluate": "evaluation.segmentation",
    "evaluate_fgovd": "evaluation.fgovd",
    "Grid": "sweeps.grid",
    "GRIDS": "sweeps.grid",
    "read_grid_file": "sweeps.grid",
    "SweepPaths": "sweeps.run",
    "run_sweep": "sweeps.run",
    "collect": "sweeps.records",
    "pivot": "sweeps.report",
    "to_markdown": "sweeps.report",
    "to_csv": "sweeps.report",
    "write_plots": "sweeps.plots",
    "run_all": "bench.run",
    # analysis: attention statistics, gain vs diffusivity, explain, gallery, demo
    "analyze": "analysis.statistics",
    "explain": "analysis.explain",
    "gain_cells": "analysis.diffusivity",
    "write_gallery": "analysis.gallery",
    "build_demo": "analysis.demo",
}

# Module paths of the previous release -> where the code lives now. Served for one release, with a
# DeprecationWarning, by the finder below (detectron2's `_D2ProjectsFinder` mechanism). Modules that became
# packages of the same name (`analysis`, `bench`, `cli`) re-export their old names themselves; a module split
# between rooms maps to a tuple, and its old path holds the public names of all of them.
_MOVED = {
    "accel": "runtime.accel",
    "allocator": "runtime.allocator",
    "distributed": "runtime.distributed",
    "progress": "runtime.progress",
    "normalizers": "attention.normalizers",
    "proxy": ("attention.grid", "methods.corrclip", "methods.trident", "segment.windows"),
    "model": "models.clip",
    "text_tower": "models.text_tower",
    "backbones": "models.backbones",
    "models.towers": ("models.families.timm_tower", "models.tower"),
    "proxy_source": "models.proxies",
    "inference": "segment",
    "text": "segment.vocabulary",
    "regions": "segment.regions",
    "images": "segment.images",
    "discovery": "files.inputs",
    "batch": "files.folder",
    "outputs": "files.outputs",
    "results": "files.results",
    "evaluate": "evaluation.segmentation",
    "protocols": ("evaluation.protocols", "methods.resclip", "methods.trident_refine"),
    "metrics": "evaluation.metrics",
    "fgovd": "evaluation.fgovd",
    "fgovd.regions": "evaluation.fgovd.pooling",
    "corrclip": "methods.corrclip",
    "trident": "methods.trident",
    "sam_refine": "methods.trident_refine",
    "sweep": "sweeps",
    "report": "sweeps",
    "bench_compare": "bench.published",
    "bench_ttfm": "bench.ttfm",
    "diffusivity": "analysis.diffusivity",
    "explain": "analysis.explain",
    "gallery": "analysis.gallery",
    "demo": "analysis.demo",
    "cli_common": "cli.common",
    "cli_analysis": "cli.analysis",
    "cli_dna": "cli.dna",
    "cli_proxy": "cli.ls",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def moved_target(old: str) -> str | tuple[str, ...] | None:
    """The module (or, for a split module, the modules) that replaced `clipseg_sparse.<old>` (a dotted path
    below the package), or None."""
    head = old
    while head:
        if head in _MOVED:
            new = _MOVED[head]
            return new if isinstance(new, tuple) else new + old[len(head):]
        head = head.rpartition(".")[0]
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a moved module's old path get the new module itself, with a DeprecationWarning."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib's signature)
        if fullname.startswith(f"{__name__}.") and moved_target(fullname[len(__name__) + 1 :]):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):  # noqa: ANN001
        target = moved_target(spec.name[len(__name__) + 1 :])
        new = [f"{__name__}.{t}" for t in (target if isinstance(target, tuple) else (target,))]
        warnings.warn(f"{spec.name} moved to {', '.join(new)}; the old path goes away in the next release", DeprecationWarning, stacklevel=2)
        if len(new) == 1:
            return importlib.import_module(new[0])
        merged = types.ModuleType(spec.name, f"Moved to {', '.join(new)}.")
        for module in map(importlib.import_module, reversed(new)):  # the first target's names win
            merged.__dict__.update((k, v) for k, v in vars(module).items() if not k.startswith("_"))
        return merged

    def exec_module(self, module) -> None:  # noqa: ANN001  (the module is already loaded)
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # first: a moved package's old child path must not load a second copy
