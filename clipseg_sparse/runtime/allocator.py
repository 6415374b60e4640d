"""Keep freed memory in the process: glibc malloc settings for repeated, same-sized tensor work.

glibc serves large allocations with fresh mmap pages (above a threshold it moves at run time) and hands
freed memory at the top of its heap back to the system. Inference allocates and frees the same large
tensors over and over (every block's activations, every band of logits, the entmax work buffers), so the
process keeps faulting in and zeroing pages it has just given back. Measured here (ViT-B/16, 4 images of
480 x 640, 150 classes): 140-360 thousand minor page faults per pass (0.5-1.4 GB of pages), runs of the
same work 40 % apart, and `segment` 1.16-1.29x the bare model; with the mmap threshold fixed at glibc's
largest value and trimming off: no page faults after the first pass and 1.02-1.13x. The price is that
the process keeps its peak heap for reuse instead of returning it. PyTorch's CPU performance guide gives
the same advice (run under jemalloc or tcmalloc); this needs no preloading.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest mmap threshold on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1

_kept = False


def keep_freed_memory() -> bool:
    """Set glibc's malloc, process-wide, to keep freed memory for reuse (the CLI and the benchmarks call
    it once). True when the settings took effect; False where there is no glibc (macOS, Windows, musl)."""
    global _kept
    if _kept or not sys.platform.startswith("linux"):
        return _kept
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept
