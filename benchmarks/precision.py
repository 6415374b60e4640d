"""bf16 (or fp16) against fp32 on the same random weights, in one run: the 2048^3 matrix-product probe,
encode_dense at 448 px per model (unpatched, SCLIP, SCLIP with entmax) with feature cosine, prototype label
agreement and entmax support agreement, the text tower, and `predict_labels`; then the roofline lines.

    python benchmarks/precision.py [--models ViT-B-16 ViT-L-14] [--px 448] [--low bf16] [--device cpu]
    python benchmarks/precision.py --device cuda --low fp16 --repeat 5       # a GPU session
    python benchmarks/precision.py --cpu-time       # a loaded CPU machine: one thread, process CPU time
"""

import argparse
import contextlib

import numpy as np
import torch
from rich.console import Console

from clipseg_sparse.bench.roofline import matmul_rates
from clipseg_sparse.bench.run import bench_precision, rich_tables
from clipseg_sparse.bench.timing import cpu_clock, smooth_image
from clipseg_sparse.runtime.allocator import keep_freed_memory
from clipseg_sparse.segment.settings import InferenceSettings

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--models", nargs="+", default=["ViT-B-16", "ViT-L-14"], help="open_clip names or config JSONs")
parser.add_argument("--px", type=int, default=448, help="square input side of the forward")
parser.add_argument("--low", choices=["bf16", "fp16"], default="bf16", help="the reduced precision compared with fp32")
parser.add_argument("--device", default="cpu")
parser.add_argument("--repeat", type=int, default=3, help="timed rounds (best one kept)")
parser.add_argument("--prompts", type=int, default=240, help="prompts of the 12,000 ADE20K ones timed through the text tower")
parser.add_argument("--images", type=int, default=2, help="480x640 images segmented (150 classes, SCLIP, 336 px)")
parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by process CPU time (an oversubscribed machine)")
args = parser.parse_args()
keep_freed_memory()
if args.cpu_time:
    torch.set_num_threads(1)
images = [smooth_image((480, 640), np.random.default_rng(i)) for i in range(args.images)]
vocabulary = [f"class {i}" for i in range(150)]
with cpu_clock() if args.cpu_time else contextlib.nullcontext():
    rows = matmul_rates(args.device, args.repeat)
    rows += bench_precision(args.models, args.px, images, vocabulary, InferenceSettings(), args.device, args.repeat, args.prompts, args.low)
for table in rich_tables(rows):
    Console(width=250).print(table)
