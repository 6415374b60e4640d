"""(b) patched forward: qq/entmax:1.5 vs qq/softmax vs the unpatched model (random-init weights).

    python benchmarks/forward.py [--model ViT-B-16] [--px 448] [--device cuda --precision bf16]
"""

import argparse

import torch
from rich.console import Console

from clipseg_sparse.bench import bench_forward, rich_tables
from clipseg_sparse.model import load_clip

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="ViT-B-16")
parser.add_argument("--px", type=int, default=448)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--repeat", type=int, default=3)
parser.add_argument("--device", default="cpu")
parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
args = parser.parse_args()
torch.manual_seed(0)
clip = load_clip(args.model, pretrained=None, device=args.device, precision=args.precision)
rows = bench_forward(clip, args.px, repeat=args.repeat, batch=args.batch)
for table in rich_tables(rows):
    Console().print(table)
