"""What every timing suite shares: result rows, best-of-N timing, and smooth synthetic images.

Its own module so that each suite (run.py, published.py, ttfm.py) imports it downward.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..runtime.allocator import keep_freed_memory


@dataclass(frozen=True)
class BenchRow:
    """One timed variant. ratio = ms / the reference variant's ms in the same case (reference: 1.0)."""

    suite: str
    case: str
    variant: str
    ms: float
    ratio: float
    reference: str
    max_abs_diff: float | None = None  # against the reference's output, where the suite checks it
    gflop: float | None = None  # the work of one run (FlopCounterMode), for the roofline line (roofline.py)


_clock: contextvars.ContextVar[Callable[[], float]] = contextvars.ContextVar("clipseg_sparse_bench_clock", default=time.perf_counter)


@contextlib.contextmanager
def cpu_clock():
    """Inside the block `best_ms` measures this process's CPU time instead of wall time: on a machine
    so oversubscribed that the process waits most of the wall time, CPU time still says what each variant
    costs (run with one thread, `torch.set_num_threads(1)`, so that no thread spins at a barrier)."""
    token = _clock.set(time.process_time)
    try:
        yield
    finally:
        _clock.reset(token)


def best_ms(runs: dict[str, Callable[[], object]], repeat: int = 3, device: torch.device | str = "cpu") -> dict[str, float]:
    """Best wall time (CPU time inside `cpu_clock`) of each run over `repeat` rounds, in milliseconds,
    after one warm-up round.

    Rounds interleave the runs (a, b, c, a, b, c, ...) so that load from other processes on a shared
    machine hits every variant alike and the ratios stay fair.
    """
    keep_freed_memory()  # time what the CLI runs: without it, page-fault churn moved runs by 40 %
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    clock = _clock.get()
    best = {name: math.inf for name in runs}
    for round_ in range(repeat + 1):
        for name, fn in runs.items():
            start = clock()
            fn()
            sync()
            if round_:
                best[name] = min(best[name], clock() - start)
    return {name: t * 1e3 for name, t in best.items()}


def rows_of(suite: str, case: str, times: dict[str, float], reference: str) -> list[BenchRow]:
    return [BenchRow(suite, case, name, ms, ms / times[reference], reference) for name, ms in times.items()]


# -- (c) segmentation overhead -----------------------------------------------------------------------
def smooth_image(size: tuple[int, int] = (480, 640), rng: np.random.Generator | None = None) -> np.ndarray:
    """A smooth random H x W x 3 uint8 image (random 16 x 16-pixel cells, upsampled bilinearly)."""
    from PIL import Image

    rng = rng or np.random.default_rng(0)
    small = rng.integers(0, 255, (size[0] // 16, size[1] // 16, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize(size[::-1], Image.BILINEAR))


def write_images(folder: Path, count: int, size: tuple[int, int] = (480, 640), seed: int = 0) -> list[Path]:
    """Smooth random RGB images (PNG) so decoding costs what a photo's would."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        paths.append(folder / f"img{i:03d}.png")
        Image.fromarray(smooth_image(size, rng)).save(paths[-1])
    return paths
