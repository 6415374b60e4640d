"""`clipseg-sparse bench`: the timing suites (normalizers, forward, segmentation, time to first mask, windows, bf16, pipeline)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .common import Device, DeviceOpt, Precision, PrecisionOpt, fail, out_console, user_errors

app = typer.Typer()


@app.command("bench")
@user_errors()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="ViT-B/16 at 224 px only, without the slow package solvers (seconds).")] = False,
    device: DeviceOpt = Device.cpu,
    precision: PrecisionOpt = Precision.fp32,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Benchmark only this model (name or config JSON).")] = None,
    suites: Annotated[str, typer.Option("--suites", help="Comma-separated: normalizer, forward, segment, ttfm (time to first mask), windows (the published window loop), bf16 (benchmarks/README.md); pipeline, not by default (one image's run by part).")] = "normalizer,forward,segment,ttfm,windows,bf16",
    families: Annotated[str, typer.Option("--families", help="pipeline: comma-separated preset families (sclip, naclip+pamr, proxyclip, trident, trident+samrefine, corrclip, ovstitcher, corrclipv2+bank, lposs, lposs+, pearl), SAM 3 pipelines (sam3, activesam: --model gives their SAM 3 weights, random by default) or any presets (each with its paper's protocol).")] = "sclip",
    classes: Annotated[str, typer.Option("--classes", help="pipeline: comma-separated class counts.")] = "21,150",
    size: Annotated[str, typer.Option("--size", help="pipeline: the image's HEIGHTxWIDTH.")] = "480x640",
) -> None:
    """Time fast entmax vs the entmax package vs softmax, the patched forward, segmentation overhead, time to first mask, the published window loop, bf16, and one image's run by part."""
    from ..bench.run import SUITES, run_all, rich_tables
    from ..runtime.device import resolve_device

    chosen = [s.strip() for s in suites.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SUITES) - {"pipeline"})
    if unknown:
        fail(f"unknown benchmark suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES + ('pipeline',))}")
    console = out_console()
    dev = str(resolve_device(device.value))
    if set(chosen) - {"pipeline"}:
        rows = run_all(quick=quick, device=dev, precision=precision.value, model=model, suites=[s for s in chosen if s != "pipeline"])
        for table in rich_tables(rows):
            console.print(table)
    if "pipeline" in chosen:
        from ..bench.pipeline import bench_pipeline, rich_pipeline_table

        try:
            height, width = (int(v) for v in size.lower().split("x"))
            counts = [int(c) for c in classes.split(",") if c.strip()]
        except ValueError:
            fail(f"--size {size!r} / --classes {classes!r}: expected HEIGHTxWIDTH and comma-separated integers")
        for family in (f.strip() for f in families.split(",") if f.strip()):
            for count in counts:
                console.print(rich_pipeline_table(bench_pipeline(family, count, (height, width), model, dev)))
