"""Peak memory of one `predict` (random-init model): python benchmarks/memory.py --batch-size 16.

Run one configuration per process (the peak RSS of a process only grows).
"""

import argparse
import json

from clipseg_sparse.bench.run import segment_peak_rss
from clipseg_sparse.segment.settings import InferenceSettings

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--model", default="ViT-L-14")
parser.add_argument("--classes", type=int, default=150)
parser.add_argument("--resolution", type=int, default=448)
parser.add_argument("--window", type=int, default=224)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--height", type=int, default=480)
parser.add_argument("--width", type=int, default=640)
parser.add_argument("--spec", default="sclip-entmax")
args = parser.parse_args()
settings = InferenceSettings(resolution=args.resolution, window=args.window, stride=args.window // 2, batch_size=args.batch_size)
result = segment_peak_rss(args.model, args.classes, (args.height, args.width), settings, args.spec)
print(json.dumps({**vars(args), **{k: round(v, 1) for k, v in result.items()}}))
