"""Time to first mask: a new 150-class vocabulary (ADE20K names) x 80 templates from a cold cache, then
one 480x640 image; the text side against open_clip's plain encode_text in the same run.

    python benchmarks/ttfm.py [--model ViT-B-16] [--plain-prompts 240 | 0 for all 12,000] [--repeat 2]
"""

import argparse

from rich.console import Console

from clipseg_sparse.bench.run import add_run_arguments, random_clip, rich_tables
from clipseg_sparse.bench.ttfm import bench_ttfm

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_run_arguments(parser)
parser.add_argument("--plain-prompts", type=int, default=240, help="prompts timed through plain open_clip (0 = all)")
args = parser.parse_args()
rows, summary = bench_ttfm(random_clip(args), plain_prompts=args.plain_prompts, repeat=args.repeat)
for table in rich_tables(rows):
    Console().print(table)
Console().print({k: round(v, 9) if isinstance(v, float) else v for k, v in summary.items()})
