"""Time and peak memory per image of the propagation stages against PAMR, side by side in one run.

Every stage runs on the same random inputs of one image (names x pixels raw cosines; the stages alone, not the
CLIP forward): `pamr` (10 iterations, dilations 8, 16, at the original size), `lp:patch` (LPOSS: DINO ViT-B/16
values of every window, random weights, then the kNN graph and the CG solve; and the graph + solve alone),
`lp:pixel` (LPOSS+: the Lab pixel graph at the network input's size) and `tlp` (PEARL, at the original size).
Peak memory is the growth of the process's maximum resident set during the stage (Linux ru_maxrss), so run
the stages in increasing order of memory (as listed) for meaningful numbers.

    python benchmarks/propagation.py [--classes 150] [--size 375x500] [--short 336] [--threads 2] [--skip lp:pixel]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from clipseg_sparse.methods import lposs, pearl
from clipseg_sparse.models.proxies import PROXIES
from clipseg_sparse.segment.preprocess import resized_shape, window_boxes
from clipseg_sparse.stages import pamr


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeat: int) -> tuple[float, float]:
    """(median seconds over `repeat` calls after a warm-up, growth of the peak resident set in MiB in the warm-up)."""
    before = peak_mib()
    fn()
    grown, times = peak_mib() - before, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=150)
    parser.add_argument("--size", default="375x500", help="original image H x W")
    parser.add_argument("--short", type=int, default=336, help="network input short side (LPOSS's protocol: 448)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to skip, e.g. lp:pixel")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    H, W = map(int, args.size.split("x"))
    h, w = resized_shape(H, W, args.short)
    g = torch.Generator().manual_seed(0)
    n = args.classes
    cos = (torch.randn(n, H, W, generator=g) * 0.05 + 0.2).to(dev)
    guide = torch.randn(3, H, W, generator=g).to(dev)
    text = F.normalize(torch.randn(n, 512, generator=g), dim=-1).to(dev)
    pixels = torch.randn(1, 3, h, w, generator=g).to(dev)
    boxes = window_boxes(h, w, 224, 112)
    win = (torch.randn(len(boxes), 14, 14, n, generator=g) * 0.05 + 0.2).to(dev)
    cos_in = F.interpolate(cos[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    rgb = torch.rand(3, h, w, generator=g).to(dev)
    PROXIES.configure(weights="none")
    backbone = PROXIES.get(lposs.LP_PROXY, dev)  # DINO ViT-B/16, random weights
    feats = lposs.proxy_values(lposs.window_crops(pixels, boxes, 16), backbone)

    stages = {
        "pamr": lambda: pamr(cos, guide),
        "lp:patch": lambda: lposs.lp_patch(win, boxes, pixels, 16),
        "lp:patch (graph + CG)": lambda: lposs.lp_patch(win, boxes, pixels, 16, feats=feats),
        "tlp": lambda: pearl.tlp(cos, guide, text),
        "lp:pixel": lambda: lposs.lp_pixel(cos_in, rgb),
    }
    print(f"{n} classes, original {H}x{W}, network input {h}x{w}, {len(boxes)} windows ({len(boxes) * 196} patches), "
          f"{torch.get_num_threads()} threads, {args.device}")
    base = None
    print(f"{'stage':24s} {'s/image':>9s} {'x PAMR':>8s} {'peak +MiB':>10s}")
    for name, fn in stages.items():
        if any(name.startswith(s) for s in args.skip):
            continue
        with torch.inference_mode():
            sec, mib = timed(fn, args.repeat)
        base = sec if name == "pamr" else base
        ratio = f"{sec / base:8.2f}" if base else "       -"
        print(f"{name:24s} {sec:9.3f} {ratio} {mib:10.0f}", flush=True)


if __name__ == "__main__":
    main()
