"""(b) patched forward: qq/entmax:1.5 vs qq/softmax vs the unpatched model (random-init weights).

    python benchmarks/forward.py [--model ViT-B-16] [--px 448] [--device cuda --precision bf16]
"""

import argparse

from rich.console import Console

from clipseg_sparse.bench.run import add_run_arguments, bench_forward, random_clip, rich_tables

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_run_arguments(parser)
parser.add_argument("--px", type=int, default=448)
parser.add_argument("--batch", type=int, default=1)
args = parser.parse_args()
rows = bench_forward(random_clip(args), args.px, repeat=args.repeat, batch=args.batch)
for table in rich_tables(rows):
    Console().print(table)
