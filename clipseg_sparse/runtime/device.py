"""Device and precision choice: one rule for CLIP, proxy backbones and every command."""

from __future__ import annotations

import torch


PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`auto` picks CUDA, then Apple MPS, then CPU; ValueError for a device this machine lacks."""
    if device is None or str(device) == "auto":
        if _cuda_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if (dev.type == "cuda" and not _cuda_available()) or (dev.type == "mps" and not _mps_available()):
        raise ValueError(f"device {str(dev)!r} is not available on this machine (torch {torch.__version__}); use --device cpu or auto")
    return dev
