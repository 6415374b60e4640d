"""CLIP families side by side: one 448 x 448 image (9 windows of 224, stride 112) per family at B/16,
time of the dense forward (unpatched, sclip, sclip-entmax) and peak memory, ratios to OpenAI ViT-B/16.

    python benchmarks/families.py [--px 448] [--repeat 3] [--device cpu] [--threads N]

Random-init weights (the costs do not depend on them). Times: all families loaded in one process and
measured round-robin (best of --repeat rounds), so a shared machine's changing load hits every family
alike. Memory: each family in its own process (a process's peak RSS only grows); on CUDA the peak is
torch's max_memory_allocated.
MetaCLIP and DFN B/16 are ViT-B-16-quickgelu, OpenAI's architecture: their cost is OpenAI's row.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

FAMILIES = {"OpenAI ViT-B/16": "ViT-B-16", "EVA-02 B/16": "EVA02-B-16", "SigLIP 2 B/16": "ViT-B-16-SigLIP2", "PE-Core B/16": "PE-Core-B-16"}
SPECS = ("clip", "sclip", "sclip-entmax")


def _windows(clip, px: int):
    import torch

    from clipseg_sparse.segment.preprocess import window_boxes

    boxes = window_boxes(px, px, 224, 112)
    image = torch.randn(1, 3, px, px, generator=torch.Generator().manual_seed(0))
    return torch.cat([image[..., y0:y1, x0:x1] for y0, y1, x0, x1 in boxes]).to(clip.device)


def _ms(clip, windows, spec: str) -> float:
    import torch

    if clip.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    clip.encode_dense(windows, spec)
    if clip.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def one(model: str, px: int, device: str, threads: int | None) -> dict:
    """Memory of one family: RSS after loading, peak RSS (CUDA: peak allocated) over every spec."""
    import torch

    from clipseg_sparse import load_clip

    if threads:
        torch.set_num_threads(threads)
    clip = load_clip(model, pretrained=None, device=device)
    windows = _windows(clip, px)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if clip.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        for spec in SPECS:
            clip.encode_dense(windows, spec)
    out = {"model": model, "windows": len(windows), "rss_loaded_mb": rss_loaded, "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if clip.device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def times(px: int, repeat: int, device: str, threads: int | None) -> dict[str, dict[str, float]]:
    """Best ms per family and spec, every family loaded at once and measured round-robin."""
    import torch

    from clipseg_sparse import load_clip

    if threads:
        torch.set_num_threads(threads)
    clips = {label: load_clip(model, pretrained=None, device=device) for label, model in FAMILIES.items()}
    windows = {label: _windows(clip, px) for label, clip in clips.items()}
    best = {label: {spec: float("inf") for spec in SPECS} for label in clips}
    with torch.inference_mode():
        for round_ in range(repeat + 1):  # round 0 warms up
            for spec in SPECS:
                for label, clip in clips.items():
                    ms = _ms(clip, windows[label], spec)
                    if round_:
                        best[label][spec] = min(best[label][spec], ms)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--px", type=int, default=448)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.px, args.device, args.threads)))
        return
    rows = {}
    for label, model in FAMILIES.items():
        cmd = [sys.executable, __file__, "--one", model, "--px", str(args.px), "--device", args.device]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[label] = json.loads(done.stdout.strip().splitlines()[-1])
    for label, ms in times(args.px, args.repeat, args.device, args.threads).items():
        rows[label]["ms"] = ms
    ref = rows["OpenAI ViT-B/16"]
    mem = "cuda_peak_mb" if "cuda_peak_mb" in ref else "rss_peak_mb"
    print(f"| family ({args.px}px, {ref['windows']} windows, {args.device}) | " + " | ".join(f"{s} ms (x OpenAI)" for s in SPECS)
          + f" | {mem} (x OpenAI) | RSS after load MB |")
    print("|---" * (len(SPECS) + 3) + "|")
    for label, r in rows.items():
        cells = [f"{r['ms'][s]:.0f} ({r['ms'][s] / ref['ms'][s]:.2f})" for s in SPECS]
        print(f"| {label} | " + " | ".join(cells) + f" | {r[mem]:.0f} ({r[mem] / ref[mem]:.2f}) | {r['rss_loaded_mb']:.0f} |")


if __name__ == "__main__":
    main()
