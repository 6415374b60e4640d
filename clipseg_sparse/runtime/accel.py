"""Optional fused entmax attention on CUDA through AdaSplash's Triton kernels (`pip install .[cuda]`).

The default backend, `torch`, materialises the score matrix and normalises it with our exact entmax
(any device). The `adasplash` backend calls AdaSplash-1's non-causal kernel (Goncalves, Treviso and
Martins, "AdaSplash: Adaptive Sparse Flash Attention"), which never stores the N x N matrix and solves
each row's threshold with a fixed number of Halley/bisection steps: faster and lighter on a GPU, but
only as exact as `niter` allows, so it is opt-in:

    with attention_backend("adasplash"):
        feats = clip.encode_dense(pixels, "qq/entmax:1.5")

Calls the kernel cannot serve (CPU tensors, the package missing, a Gaussian prior, head sizes other
than 16/32/64/128/256) silently take the `torch` path, so the switch never changes which specs work.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
from typing import Iterator

import torch

from ..errors import UserValueError

ATTENTION_BACKENDS = ("torch", "adasplash")
ADASPLASH_HEAD_DIMS = (16, 32, 64, 128, 256)
ADASPLASH_NITER = 10

_backend: contextvars.ContextVar[str] = contextvars.ContextVar("clipseg_sparse_attention_backend", default="torch")


def get_attention_backend() -> str:
    return _backend.get()


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Use `name` (`torch` or `adasplash`) for entmax attention inside the block."""
    if name not in ATTENTION_BACKENDS:
        raise UserValueError(f"unknown attention backend {name!r}; choose {', '.join(ATTENTION_BACKENDS)}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


def adasplash_installed() -> bool:
    return importlib.util.find_spec("adasplash") is not None


def can_use_adasplash(q: torch.Tensor, has_prior: bool) -> bool:
    """True when the `adasplash` backend is selected and its kernel can run these B x H x N x d tensors."""
    return (
        get_attention_backend() == "adasplash"
        and q.is_cuda
        and not has_prior
        and q.shape[-1] in ADASPLASH_HEAD_DIMS
        and adasplash_installed()
    )


def adasplash_entmax_attention(
    a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, alpha: float, scale: float, niter: int = ADASPLASH_NITER
) -> torch.Tensor:
    """entmax_alpha(scale * a @ b^T) @ v without the N x N matrix; a, b, v: B x H x N x d on CUDA.

    AdaSplash fixes the score scale at 1/sqrt(d), so `a` is rescaled to give `scale` instead.
    """
    from adasplash import adasplash_v1

    d = a.shape[-1]
    a = (a * (scale * d**0.5)).contiguous()
    return adasplash_v1(a, b.contiguous(), v.contiguous(), alpha=alpha, is_causal=False, niter=niter)
