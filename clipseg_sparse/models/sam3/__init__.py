"""SAM 3 (Meta, 2025) for the SAM 3 pipelines (`methods/sam3.py`, `methods/segearth_ov3.py`, ...) and the
`--regions sam3` source (`segment/regions.py`), behind one prompter API: `state = set_image(rgb)`, then
`prompts(state, names, confidence)` -> one `Sam3Prompt` per name; `normalized(normalizer)` puts a
normalizer into the detector's attention; `config()` for result files.

Two backends (`BACKENDS`), chosen by the weights given (`--proxy-weights sam3=W`):
- `transformers` (default; `hf.py`): `Sam3Model` on any device, fp32 or bf16; W = `hub` (facebook/sam3,
  gated), another Hub id, a folder with a saved model and processor, or `none` (random weights);
- `package` (`package.py`): the sam3 package (extra `.[sam3-package]`, CUDA only); W = `package:hub`,
  `package:FILE.pt` or a `.pt` checkpoint file.
"""

from __future__ import annotations

import torch

from .common import SAM3_HUB_ID, SAM3_RESOLUTION, Sam3Prompt, clip_bpe_path
from .hf import TransformersPrompter, load_sam3_transformers
from .package import PackagePrompter, check_device, load_sam3_package

BACKENDS = {"transformers": load_sam3_transformers, "package": load_sam3_package}


def backend_of(weights: str | None) -> tuple[str, str]:
    """(backend, weights for it) named by a weights value: `package:W` or a `.pt` file -> the package."""
    text = "hub" if weights in (None, "") else str(weights)
    if text.startswith("package:"):
        return "package", text.removeprefix("package:") or "hub"
    return ("package" if text.endswith(".pt") else "transformers"), text


def load_sam3(weights: str | None = "hub", device: str | torch.device = "cpu", precision: str = "fp32"):
    """SAM 3's prompter on `device` (see the module doc for the weights values and backends)."""
    backend, weights = backend_of(weights)
    if backend == "package":  # bf16 autocast on CUDA, its only device, whatever the precision
        return load_sam3_package(weights, device)
    return load_sam3_transformers(weights, device, precision)


def check_backend(weights: str | None, device: str | torch.device) -> None:
    """The package backend's device check, before any model loads (the transformers backend runs anywhere)."""
    if backend_of(weights)[0] == "package":
        check_device(device)


__all__ = ["BACKENDS", "SAM3_HUB_ID", "SAM3_RESOLUTION", "PackagePrompter", "Sam3Prompt", "TransformersPrompter", "backend_of", "check_backend",
           "clip_bpe_path", "load_sam3", "load_sam3_package", "load_sam3_transformers"]  # fmt: skip
