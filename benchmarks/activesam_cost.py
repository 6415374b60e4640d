"""ActiveSAM against the sam3 pipeline (SegEarth-OV3's): cost per image on this machine, at 21 and 150 names.

Random weights (none can be downloaded here), one random 480 x 640 image, on the CPU in fp32 or (`--precision
bf16`) under the pipeline's bf16 autocast, as `--precision bf16` runs it.

- default: the full-size `Sam3Model` (840 M parameters, transformers' default config). One image at 150 names
  takes half an hour here, so its parts are timed once each and the per-image cost is composed from them: the
  1008-px and 672-px image encodings, `--bucket` prompts decoded at 1008 px (masks, ActiveSAM's 4 context
  tokens) and `--bucket` presence-only prompts at 672 px, each divided by the bucket. sam3 at N names = encode
  + N decoded prompts; activesam = the same up to 40 names; above, preview (672-px encoding + N presence-only
  prompts) + encode + the kept prompts (the 0.8 quantile keeps N / 5: 30 of 150). Peak RSS is the process's.
With random weights few instances pass the confidence, so the per-instance work (masks resized to the image) is
left out; it is the same in both pipelines for the names both decode. The tests' tiny model is no cost model:
its time goes to image-size operations, not the network.

`--beside` adds the same image through the CLIP presets `sclip` and `corrclipv2` (with a synthetic bank of 1000
regions and 30 given regions: `bench --suites pipeline`) at 21 and 150 classes, timed the same way (wall time,
the same threads), for the table's scale.

    python benchmarks/activesam_cost.py [--threads 2] [--bucket 8] [--precision fp32 bf16] [--beside]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
NAMES = ROOT / "clipseg_sparse" / "data" / "class_names"


def vocabularies():
    from clipseg_sparse.segment.vocabulary import Vocabulary

    return {21: Vocabulary.from_file(NAMES / "segearth" / "voc21.txt"), 150: Vocabulary.from_file(NAMES / "sclip" / "ade20k.txt")}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def full(bucket: int, precisions: list[str]) -> None:
    from transformers import Sam3Config, Sam3Model

    torch.manual_seed(0)
    model = Sam3Model(Sam3Config()).eval()
    for precision in precisions:  # one model, one process: the precisions timed minutes apart
        parts_of(model, bucket, precision)


def parts_of(model, bucket: int, precision: str) -> None:
    from clipseg_sparse.methods.activesam import PREVIEW, ActiveSamSegmenter
    from clipseg_sparse.models.sam3 import TransformersPrompter
    from clipseg_sparse.models.sam3.hf import offline_processor

    prompter = TransformersPrompter(model, offline_processor(), precision=precision)
    rgb = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    seg = ActiveSamSegmenter(prompter, vocabularies()[150])
    names, (tokens, valid) = seg.names[:bucket], seg.context
    with torch.inference_mode():
        parts = {"encode 1008": timed(lambda: prompter.set_image(rgb)), "encode 672": timed(lambda: prompter.set_image(rgb, size=PREVIEW))}
        full_state, preview_state = prompter.set_image(rgb), prompter.set_image(rgb, size=PREVIEW)
        parts["prompt decoded 1008"] = timed(lambda: prompter.run(full_state, names, extra=(tokens[:bucket], valid[:bucket]))) / bucket
        parts["prompt presence 672"] = timed(lambda: prompter.run(preview_state, names, with_masks=False)) / bucket
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{precision}: parts (s; a prompt: its share of a bucket of {bucket}): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + f"; peak RSS so far {peak:.0f} MiB")
    e, e6, p, q = parts["encode 1008"], parts["encode 672"], parts["prompt decoded 1008"], parts["prompt presence 672"]
    rows = [("sam3", 21, e + 21 * p), ("activesam", 21, e + 21 * p), ("sam3", 150, e + 150 * p),
            ("activesam", 150, e6 + 150 * q + e + 30 * p), ("activesam, no preview", 150, e + 150 * p)]  # fmt: skip
    print(f"| pipeline ({precision}) | names | s per image (composed) | ratio to sam3 |")
    print("|---|---|---|---|")
    for name, n, seconds in rows:
        print(f"| {name} | {n} | {seconds:.0f} | {seconds / (e + n * p):.2f} |")
    print(f"preview at 150 names: {e6 + 150 * q:.0f} s spent, {120 * p:.0f} s of decoding saved (120 of 150 prompts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=8)
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32"], help="one table each, in this order")
    parser.add_argument("--beside", action="store_true", help="also time sclip and corrclipv2 on the same image size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.beside:
        beside()
    full(args.bucket, args.precision)


def beside() -> None:
    from clipseg_sparse.bench.pipeline import bench_pipeline

    print("| preset | classes | s per image (wall) |")
    print("|---|---|---|")
    for family in ("sclip", "corrclipv2+bank"):
        for classes in (21, 150):
            print(f"| {family} | {classes} | {bench_pipeline(family, classes, (480, 640), memory=False).whole:.1f} |", flush=True)


if __name__ == "__main__":
    main()
