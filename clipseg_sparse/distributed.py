"""Running one evaluation over several processes with torchrun (torch.distributed).

Each rank reads its own shard of the samples (every `world`-th, starting at `rank`), the summed
per-class counts are all-reduced, and rank 0 writes the result. Nothing here runs unless the process
was started by torchrun (WORLD_SIZE > 1), so single-process use is unchanged.
"""

from __future__ import annotations

import os
from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; (rank, world size).

    Uses NCCL when CUDA is available (each rank on cuda:LOCAL_RANK), else gloo (CPU).
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    return list(items[rank::world])


def all_reduce(array: np.ndarray, op: str = "sum") -> np.ndarray:
    """Sum (or max) an array over all ranks; the identity without a process group."""
    import torch
    import torch.distributed as dist

    _, world = rank_and_world()
    if world == 1:
        return array
    t = torch.from_numpy(np.ascontiguousarray(array))
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().numpy()
