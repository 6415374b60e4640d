"""Running over several processes with torchrun (torch.distributed), and splitting work into shards.

`eval` / `fgovd`: each rank reads its own shard of the samples (every `world`-th, starting at `rank`),
the per-class counts are all-reduced (the per-region scores gathered), and rank 0 writes the result.
`segment`: each rank segments its shard of the images still to do. `sweep`: each rank runs its shard of
the cells still to do, each cell alone (`single_process`). Nothing here runs unless the process was
started by torchrun (WORLD_SIZE > 1), so single-process use is unchanged.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Sequence, TypeVar

import numpy as np

from ..errors import UserValueError

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
        # ranks of a sweep wait for each other only at the end, after cells of very different lengths
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=WAIT)
    return dist.get_rank(), dist.get_world_size()


def leave() -> None:
    """Leave the process group, if this process joined one, while the interpreter is still whole.

    Without it the group is torn down during interpreter finalisation, where gloo's worker threads can still
    hold work with tensors whose release needs the GIL: the process then aborts after all its work is done
    ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489), about one exit in
    five in a bare two-rank gloo script. The CLI calls it once at its exit (`cli.app.main`). Local for
    gloo and NCCL: it waits for no other rank."""
    import sys

    dist = sys.modules.get("torch.distributed")  # not imported: no group (and `--help` stays quick)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


#: how long a rank waits for the others at a collective (the end of a sweep can be hours apart)
WAIT = timedelta(days=7)

_local = False  # inside `single_process()`


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1); (0, 1) inside `single_process()`."""
    import torch.distributed as dist

    if not _local and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def single_process() -> Iterator[None]:
    """Run a whole evaluation in this rank alone (a sweep's cell): no sharding, no collectives."""
    global _local
    before, _local = _local, True
    try:
        yield
    finally:
        _local = before


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    return list(items[rank::world])


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` (1 <= I <= N) -> (I - 1, N), the 0-based part for `shard`; UserValueError otherwise."""
    part, sep, parts = text.partition("/")
    try:
        index, count = int(part), int(parts)
    except ValueError:
        index = count = 0
    if not sep or not 1 <= index <= count:
        raise UserValueError(f"--shard {text}: expected I/N with 1 <= I <= N, e.g. 1/4 (the first of 4 parts)")
    return index - 1, count


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    import torch.distributed as dist

    if rank_and_world()[1] > 1:
        dist.barrier()


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] without a process group."""
    import torch.distributed as dist

    world = rank_and_world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


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
