"""OV-Stitcher against CorrCLIP on one image: time and peak memory of `Segmenter.cosine`, side by side in one run.

Random-init ViT-B/16 and DINO ViT-B/8 (no weights here), one random image and region map per size, the
`ovstitcher` and `corrclip` presets with the same windows: a 448 x 600 network input (windows 336 / 112, the
ovstitcher protocol's VOC/ADE setting) and a Cityscapes-size 560 x 1120 one (windows 224 / 112). Each case runs in
a fresh process, so its peak resident set (Linux ru_maxrss) is its own; `ovstitcher (one block)` runs the
image-wide attentions as one block of rows (the whole N x N map at once, as the published code) to show what the
row blocks save. The cases of a size run in turn, `--rounds` times (interleaved, so a change in the machine's
load hits all of them); the table gives each case's fastest round and its largest peak. Ratios are to corrclip at
the same size.

    python benchmarks/ovstitcher.py [--sizes 448x600,560x1120] [--threads 2] [--rounds 2] [--classes 21] [--full-map-max 5000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

WINDOWS = {(448, 600): (336, 112), (560, 1120): (224, 112)}


def run_case(preset: str, size: tuple[int, int], classes: int, rows: int | None, threads: int, queue) -> None:
    """One Segmenter.cosine (after a one-window warm-up) in this process: (seconds, peak MiB)."""
    import numpy as np
    import torch

    from clipseg_sparse import load_clip
    from clipseg_sparse.methods import ovstitcher
    from clipseg_sparse.segment.segmenter import Segmenter
    from clipseg_sparse.segment.settings import InferenceSettings

    torch.set_num_threads(threads)
    clip = load_clip("ViT-B-16", pretrained=None, device="cpu")  # random: DINO loads random weights
    rng = np.random.default_rng(0)
    H, W = size
    image = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    regions = np.kron(rng.integers(-1, 40, (H // 16 + 1, W // 16 + 1)), np.ones((16, 16), dtype=np.int64))[:H, :W]
    window, stride = WINDOWS[size]
    settings = InferenceSettings(resolution=0, window=window, stride=stride, pos_interp="scale")
    seg = Segmenter(clip, [f"class {i}" for i in range(classes)], preset, settings, templates="single", regions=lambda i, n: regions)
    if rows is not None:  # every image-wide attention as one block of rows
        real = ovstitcher.stitched_features
        ovstitcher.stitched_features = lambda run, rows_=None: real(run, rows)
    with torch.inference_mode():
        seg.cosine(image[:window, :window], regions[:window, :window])  # warm-up on one window: loads DINO
        t0 = time.perf_counter()
        seg.cosine(image, regions).rows(0, 8)
        seconds = time.perf_counter() - t0
    queue.put((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="448x600,560x1120")
    parser.add_argument("--classes", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--full-map-max", type=int, default=5000, help="run the one-block variant up to this many DINO tokens")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print("| network input | windows | preset | s | ratio | peak RSS MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for text in args.sizes.split(","):
        size = tuple(int(v) for v in text.split("x"))
        tokens = (size[0] // 8) * (size[1] // 8)
        cases = [("corrclip", None), ("ovstitcher", None)] + ([("ovstitcher", tokens)] if tokens <= args.full_map_max else [])
        best: dict[tuple, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for case in cases:
                queue = ctx.Queue()
                proc = ctx.Process(target=run_case, args=(case[0], size, args.classes, case[1], args.threads, queue))
                proc.start()
                seconds, peak = queue.get()
                proc.join()
                old = best.get(case, (seconds, peak))
                best[case] = (min(seconds, old[0]), max(peak, old[1]))
        base = best[cases[0]]
        for (preset, rows), (seconds, peak) in best.items():
            name = preset + (" (one block)" if rows else "")
            print(f"| {size[0]} x {size[1]} ({tokens} DINO tokens) | {WINDOWS[size][0]} / {WINDOWS[size][1]} | {name} | {seconds:.1f} | "
                  f"{seconds / base[0]:.2f} | {peak:.0f} | {peak / base[1]:.2f} |", flush=True)

if __name__ == "__main__":
    main()
