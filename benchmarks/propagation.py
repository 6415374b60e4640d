"""Time and peak memory per image of the propagation stages against PAMR, side by side in one run, and how
both grow with the number of classes and the image size.

Every stage runs on random inputs of one image (names x pixels raw cosines; the stages alone, not the CLIP
forward): `pamr` (10 iterations, dilations 8, 16, at the original size), `lp:patch` (LPOSS: DINO ViT-B/16
values of every window, random weights, then the kNN graph and the CG solve; and the graph + solve alone),
`lp:pixel` (LPOSS+: the Lab pixel graph at the network input's size) and `tlp` (PEARL, at the original size).

Each stage runs in a fresh process (memory freed by one stage is not reused by the next), which builds only
that stage's inputs, returns freed heap memory to the system (glibc `malloc_trim`), resets the kernel's peak
resident set to the current one (Linux `/proc/self/clear_refs` 5) and runs the stage once: `peak +MiB` is VmHWM - VmRSS over that run, the memory
the stage itself needs; the time is the median of `--repeat` runs after it.

    python benchmarks/propagation.py [--classes 150] [--size 375x500] [--short 336] [--threads 2] [--skip lp:pixel]
    python benchmarks/propagation.py --grow            # classes 21 / 59 / 150 and three image sizes
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

STAGES = ("pamr", "lp:patch", "lp:patch (graph + CG)", "tlp", "lp:pixel")
# --grow: (original H x W, network short side) from small to large, and class counts (VOC21, Context59, ADE20K)
SIZES = (("250x333", 224), ("375x500", 336), ("500x667", 448))
CLASSES = (21, 59, 150)


def status_mib(key: str) -> float:
    """A /proc/self/status entry (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def run_stage(name: str, n: int, size: str, short: int, repeat: int, device: str) -> dict:
    """Build `name`'s inputs, then (seconds, peak MiB above the resident set before the run)."""
    from clipseg_sparse.methods import lposs, pearl
    from clipseg_sparse.models.proxies import ProxyBackbones
    from clipseg_sparse.segment.preprocess import resized_shape, window_boxes
    from clipseg_sparse.stages import pamr

    dev = torch.device(device)
    H, W = map(int, size.split("x"))
    h, w = resized_shape(H, W, short)
    g = torch.Generator().manual_seed(0)
    boxes = window_boxes(h, w, 224, 112)
    pixels = torch.randn(1, 3, h, w, generator=g).to(dev)
    if name == "pamr":
        cos, guide = torch.randn(n, H, W, generator=g).to(dev) * 0.05 + 0.2, torch.randn(3, H, W, generator=g).to(dev)
        fn = lambda: pamr(cos, guide)  # noqa: E731
    elif name == "tlp":
        cos, guide = torch.randn(n, H, W, generator=g).to(dev) * 0.05 + 0.2, torch.randn(3, H, W, generator=g).to(dev)
        text = F.normalize(torch.randn(n, 512, generator=g), dim=-1).to(dev)
        fn = lambda: pearl.tlp(cos, guide, text)  # noqa: E731
    elif name.startswith("lp:patch"):
        win = (torch.randn(len(boxes), 14, 14, n, generator=g) * 0.05 + 0.2).to(dev)
        backbones = ProxyBackbones(weights="none")
        backbone = backbones.get(lposs.LP_PROXY, dev)  # DINO ViT-B/16, random weights (loaded before the run)
        crops = lambda: lposs.window_crops(pixels, boxes, 16)  # noqa: E731
        values = lambda: lposs.proxy_values(crops(), backbone, backbones.clip_mean, backbones.clip_std)  # noqa: E731
        if "graph" in name:  # the graph and the solve alone: the DINO values made before the run
            feats = values()
            fn = lambda: lposs.lp_patch(win, boxes, 16, feats)  # noqa: E731
        else:  # as the stage runs per image: the DINO values within the timed call
            fn = lambda: lposs.lp_patch(win, boxes, 16, values())  # noqa: E731
    elif name == "lp:pixel":
        cos_in, rgb = torch.randn(n, h, w, generator=g).to(dev) * 0.05 + 0.2, torch.rand(3, h, w, generator=g).to(dev)
        fn = lambda: lposs.lp_pixel(cos_in, rgb)  # noqa: E731
    else:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    with torch.inference_mode():
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: the stage cannot reuse it unseen
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set restarts from the current one
        before = status_mib("VmRSS")
        t0 = time.perf_counter()
        fn()
        times = [time.perf_counter() - t0]
        peak = status_mib("VmHWM") - before
        for _ in range(repeat - 1):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {"stage": name, "classes": n, "size": size, "short": short, "input": f"{h}x{w}", "windows": len(boxes),
            "seconds": statistics.median(times), "peak_mib": peak}  # fmt: skip


def in_fresh_process(args, name: str, n: int, size: str, short: int) -> dict:
    cmd = [sys.executable, __file__, "--one", name, "--classes", str(n), "--size", size, "--short", str(short),
           "--repeat", str(args.repeat), "--threads", str(args.threads), "--device", args.device]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(rows: list[dict]) -> None:
    print(f"{'stage':24s} {'classes':>7s} {'image':>9s} {'input':>9s} {'s/image':>9s} {'x PAMR':>7s} {'peak MiB':>9s} {'x PAMR':>7s}")
    for r in rows:
        base = next((b for b in rows if b["stage"] == "pamr" and (b["classes"], b["size"]) == (r["classes"], r["size"])), None)
        ratio = lambda key: f"{r[key] / base[key]:7.2f}" if base and base[key] > 0 else "      -"  # noqa: E731
        print(f"{r['stage']:24s} {r['classes']:7d} {r['size']:>9s} {r['input']:>9s} {r['seconds']:9.2f} {ratio('seconds')} "
              f"{r['peak_mib']:9.0f} {ratio('peak_mib')}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=150)
    parser.add_argument("--size", default="375x500", help="original image H x W")
    parser.add_argument("--short", type=int, default=336, help="network input short side (LPOSS's protocol: 448)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to skip, e.g. lp:pixel")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--grow", action="store_true", help="pamr, lp:patch (graph + CG) and tlp at 21/59/150 classes and three sizes; lp:pixel at 21 classes")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one stage here and print its JSON line
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_stage(args.one, args.classes, args.size, args.short, args.repeat, args.device)))
        return
    print(f"{torch.get_num_threads() if not args.threads else args.threads} threads, {args.device}; one fresh process per row")
    if args.grow:
        cells = [(s, n, size, short) for size, short in SIZES for n in CLASSES for s in ("pamr", "lp:patch (graph + CG)", "tlp")]
        cells += [("lp:pixel", 21, size, short) for size, short in SIZES]
    else:
        cells = [(s, args.classes, args.size, args.short) for s in STAGES]
    rows = [in_fresh_process(args, *cell) for cell in cells if not any(cell[0].startswith(s) for s in args.skip)]
    table(rows)


if __name__ == "__main__":
    main()
