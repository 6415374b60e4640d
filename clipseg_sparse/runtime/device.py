"""Device and precision choice: one rule for CLIP, proxy backbones and every command."""

from __future__ import annotations

import torch

from ..errors import UserValueError

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`auto` picks CUDA, then Apple MPS, then CPU; UserValueError for a device this machine lacks."""
    if device is None or str(device) == "auto":
        if _cuda_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if (dev.type == "cuda" and not _cuda_available()) or (dev.type == "mps" and not _mps_available()):
        raise UserValueError(f"device {str(dev)!r} is not available on this machine (torch {torch.__version__}); use --device cpu or auto")
    return dev


def check_precision(precision: str, device: torch.device) -> None:
    """UserValueError for fp16 on a CPU without AMX-FP16: there torch runs fp16 matrix products emulated (a
    1024^3 product took 61x its fp32 time on an AVX512 CPU), so an fp16 run would crawl; bf16 is the CPU's
    reduced precision."""
    amx_fp16 = getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    if precision == "fp16" and device.type == "cpu" and not amx_fp16():
        raise UserValueError("--precision fp16 on the CPU: its fp16 matrix products are emulated, tens of times slower than fp32; use bf16 (or fp32) on the CPU, fp16 on a GPU")
