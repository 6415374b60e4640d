"""`clipseg-sparse bench`: the timing suites (normalizers, forward, segmentation, time to first mask, windows, bf16)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .common import Device, DeviceOpt, Precision, PrecisionOpt, out_console, user_errors

app = typer.Typer()


@app.command("bench")
@user_errors()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="ViT-B/16 at 224 px only, without the slow package solvers (seconds).")] = False,
    device: DeviceOpt = Device.cpu,
    precision: PrecisionOpt = Precision.fp32,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Benchmark only this model (name or config JSON).")] = None,
    suites: Annotated[str, typer.Option("--suites", help="Comma-separated: normalizer, forward, segment, ttfm (time to first mask), windows (the published window loop), bf16 (benchmarks/README.md).")] = "normalizer,forward,segment,ttfm,windows,bf16",
) -> None:
    """Time fast entmax vs the entmax package vs softmax, the patched forward, segmentation overhead, time to first mask, the published window loop and bf16."""
    from ..bench.run import run_all, rich_tables
    from ..runtime.device import resolve_device

    chosen = [s.strip() for s in suites.split(",") if s.strip()]
    rows = run_all(quick=quick, device=str(resolve_device(device.value)), precision=precision.value, model=model, suites=chosen)
    console = out_console()
    for table in rich_tables(rows):
        console.print(table)
