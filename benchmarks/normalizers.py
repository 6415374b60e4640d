"""(a) fast entmax vs entmax.entmax_bisect vs entmax.entmax15 vs softmax on last-block attention scores.

    python benchmarks/normalizers.py [--models ViT-B-16 ViT-L-14] [--sizes 224 336 448] [--device cuda --precision fp16]
"""

import argparse

import torch
from rich.console import Console

from clipseg_sparse.bench.run import add_run_arguments, bench_normalizers, rich_tables, score_cases

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--models", nargs="+", default=["ViT-B-16", "ViT-L-14"])
parser.add_argument("--sizes", nargs="+", type=int, default=[224, 336, 448])
parser.add_argument("--alphas", nargs="+", type=float, default=[1.5, 1.25])
add_run_arguments(parser, model=None)
args = parser.parse_args()
dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
rows = bench_normalizers(score_cases(args.models, args.sizes, args.device, dtype), args.alphas, args.repeat)
for table in rich_tables(rows):
    Console().print(table)
