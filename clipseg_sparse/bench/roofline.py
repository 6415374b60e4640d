"""The roofline line of `bench`: a forward's achieved GFLOP/s against this machine's matrix-product rate.

The work of a forward is counted by torch's FlopCounterMode (matrix products and attention; elementwise
work is not counted). The machine's rate is a 2048^3 matrix product in fp32 and in bf16, timed in the same
run (`matmul_rates`), so the fraction says how close the forward runs to what the matrix units can do.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .timing import BenchRow, best_ms

PROBE_SIDE = 2048
PROBE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _count_cpu_attention() -> None:
    """Teach FlopCounterMode the two CPU attention ops it does not count in torch 2.14: the flash-attention
    op (counted on CUDA only; same formula as the CUDA kernels: two products of N x N x d per head), and
    `_native_multi_head_attention`, nn.MultiheadAttention's fused inference op, which open_clip's blocks
    run in fp32 (uncounted, it hid about 40 % of a ViT-B/16 forward's work at 448 px)."""
    from torch.utils import flop_counter

    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if sdpa not in flop_counter.flop_registry:

        def sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

        flop_counter.register_flop_formula(sdpa)(sdpa_flops)
    mha = torch.ops.aten._native_multi_head_attention
    if mha not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(mha)(mha_flops)


def mha_flops(query_shape, key_shape, value_shape, embed_dim: int, num_head: int, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `_native_multi_head_attention` on query B x N x C and key / value B x S x C (batch first):
    the q, k and v projections, q k^T and the product with v, and the output projection."""
    *_, n, c = query_shape
    s = key_shape[-2]
    b = math.prod(query_shape[:-2])
    return 2 * b * c * c * (n + 2 * s) + 4 * b * n * s * c + 2 * b * n * c * c


def count_gflop(fn: Callable[[], object]) -> float:
    """GFLOP that `fn()` runs, by FlopCounterMode (one extra call of `fn`)."""
    from torch.utils.flop_counter import FlopCounterMode

    _count_cpu_attention()
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / 1e9


def matmul_rates(device: torch.device | str = "cpu", repeat: int = 3, side: int = PROBE_SIDE) -> list[BenchRow]:
    """Rows (suite "matmul") timing a side^3 product in fp32 and bf16, interleaved; gflop = 2 side^3."""
    gen = torch.Generator().manual_seed(0)
    pairs = {
        name: [torch.randn(side, side, generator=gen).to(device=device, dtype=dtype) for _ in range(2)] for name, dtype in PROBE_DTYPES.items()
    }
    times = best_ms({name: (lambda a=a, b=b: a @ b) for name, (a, b) in pairs.items()}, repeat, device)
    gflop = 2 * side**3 / 1e9
    return [BenchRow("matmul", f"{side}^3 product", name, ms, ms / times["fp32"], "fp32", gflop=gflop) for name, ms in times.items()]


def achieved(row: BenchRow) -> float:
    """GFLOP/s of a row that carries its work (gflop)."""
    return row.gflop / (row.ms * 1e-3)


def roofline_lines(rows: list[BenchRow]) -> list[str]:
    """One line per row with a FLOP count: achieved GFLOP/s and its fraction of the measured fp32 and
    bf16 matrix-product rates (empty without a `matmul` probe among the rows)."""
    rates = {r.variant: achieved(r) for r in rows if r.suite == "matmul"}
    if not rates:
        return []
    head = ", ".join(f"{name} {rate:,.0f} GFLOP/s" for name, rate in rates.items())
    if len(rates) == 2 and "fp32" in rates:  # the ceiling: no forward gains more from the low precision than its products do
        low = next(name for name in rates if name != "fp32")
        head += f" ({low} / fp32 = {rates[low] / rates['fp32']:.1f}x: the most a forward can gain from {low} here)"
    lines = [f"matrix-product rate of this machine ({PROBE_SIDE}^3, same run): {head}"]
    for r in rows:
        if r.gflop is None or r.suite == "matmul":
            continue
        fractions = ", ".join(f"{100 * achieved(r) / rate:.1f} % of the {name} rate" for name, rate in rates.items())
        case = r.case.split(" (")[0]  # without the accuracy notes some cases carry
        lines.append(f"roofline {r.suite} | {case} | {r.variant}: {r.gflop:.1f} GFLOP in {r.ms:.0f} ms = {achieved(r):,.0f} GFLOP/s ({fractions})")
    return lines
