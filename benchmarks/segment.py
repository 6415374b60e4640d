"""(c) images/s of Segmenter.predict on a folder of generated images vs the bare model forward over the
same window batches (the cost of everything that is not the model).

    python benchmarks/segment.py [--model ViT-B-16] [--images 4] [--classes 150] [--device cuda]
"""

import argparse
import tempfile
from pathlib import Path

from rich.console import Console

from clipseg_sparse.bench.run import add_run_arguments, bench_segment, random_clip, rich_tables

from clipseg_sparse.bench.timing import write_images
from clipseg_sparse.segment.settings import InferenceSettings

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_run_arguments(parser)
parser.add_argument("--images", type=int, default=4)
parser.add_argument("--classes", type=int, default=150)
parser.add_argument("--spec", default="sclip")
parser.add_argument("--resolution", type=int, default=336)
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()
clip = random_clip(args)
settings = InferenceSettings(resolution=args.resolution, batch_size=args.batch_size)
with tempfile.TemporaryDirectory() as tmp:
    paths = write_images(Path(tmp), args.images)
    rows = bench_segment(clip, paths, args.classes, args.spec, settings, args.repeat)
for table in rich_tables(rows):
    Console().print(table)
