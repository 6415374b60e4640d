"""C kernels for CPU loops that torch's elementwise operators can only make as one pass over memory per term
(PAMR: 16 neighbours an iteration), built on first use with the machine's C compiler and loaded with ctypes.

A kernel is compiled once per source, compiler and flags into `~/.cache/clipseg-sparse/native` (or
`$XDG_CACHE_HOME`; written under a temporary name, then renamed, so parallel runs never load half a file). No
torch headers are involved: the build takes a fraction of a second. Where no compiler works, `kernel` returns
None and the caller keeps its torch path (one line in the log says why); `CLIPSEG_SPARSE_NATIVE=0` turns the
kernels off, `CC` picks the compiler.

Flags: on CPUs whose ATen kernels are the AVX2 or AVX-512 builds (`torch.backends.cpu.get_cpu_capability`)
the C is compiled with FMA and contraction on, so `a + b * c` rounds once, as ATen's vectorised loops do:
the kernels then give the torch path's bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

SOURCES = Path(__file__).with_name("native")
ENV_SWITCH = "CLIPSEG_SPARSE_NATIVE"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clipseg-sparse" / "native"


def compile_flags() -> list[str]:
    flags = ["-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=fast"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def kernel(name: str) -> ctypes.CDLL | None:
    """The compiled library of `native/NAME.c`, or None (kernels off, or no working compiler)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    return _load(name, os.environ.get("CC", "cc"))


@functools.cache
def _load(name: str, compiler: str) -> ctypes.CDLL | None:
    source = SOURCES / f"{name}.c"
    command = [*shlex.split(compiler), *compile_flags()]
    key = hashlib.sha256(source.read_bytes() + "\0".join(command).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([*command, str(source), "-o", partial], check=True, capture_output=True, text=True, timeout=120)
                os.replace(partial, target)
            finally:
                Path(partial).unlink(missing_ok=True)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        why = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        logging.getLogger(__name__).info("native kernel %s not built (%s): the torch path runs", name, why[0] if why else type(e).__name__)
        return None


def float_pointer(t: torch.Tensor) -> ctypes.POINTER(ctypes.c_float):
    """A C float* to a contiguous CPU float32 tensor's data."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"a C kernel needs contiguous CPU float32 memory, got {t.dtype} on {t.device}")
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))


def over_threads(work: Callable[[int, int], None], count: int) -> None:
    """work(lo, hi) on contiguous parts of range(count), one part per torch thread (at most `count`), run at once:
    a ctypes call releases the GIL, so the kernels' parts run in parallel."""
    workers = max(1, min(torch.get_num_threads(), count))
    cuts = [count * i // workers for i in range(workers + 1)]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda i: work(cuts[i], cuts[i + 1]), range(workers)))
