"""What DnA costs on a CLIP ViT: parameters per converted block, forward time, and a training step.

Random weights (open_clip `pretrained=None`); the forward is `encode_dense` at the given size with the
unmodified model vs the model with the last N blocks converted (interleaved repeats, median); the
training step is one `dna train`-style step (dense cross-entropy against 150 random text embeddings,
backward into Q-, V-, alpha only, AdamW) at batch `--batch`.

    python benchmarks/dna_cost.py --model ViT-B-16 --size 224 --blocks 1,12
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

from clipseg_sparse import load_clip
from clipseg_sparse.dna import convert_to_dna


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--blocks", default="1,12", help="numbers of last blocks to convert, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = load_clip(args.model, pretrained=None, device="cpu")
    x = torch.randn(args.batch, 3, args.size, args.size)
    print(f"{args.model}, {args.size} px, batch {args.batch}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print("| blocks converted | new parameters | forward s (plain) | forward s (DnA) | ratio | train step s |")
    print("|---|---|---|---|---|---|")
    for n in (int(b) for b in args.blocks.split(",")):
        clip = copy.deepcopy(base)
        modules = convert_to_dna(clip, n)
        params = [p for m in modules.values() for p in m.negative_parameters().values()]
        plain, dna = [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            plain.append(_median_seconds(lambda: base.encode_dense(x), 1))
            dna.append(_median_seconds(lambda: clip.encode_dense(x), 1))
        text = F.normalize(torch.randn(150, clip.embed_dim), dim=-1)
        labels = torch.randint(0, 150, (args.batch, args.size // clip.patch_size, args.size // clip.patch_size))
        opt = torch.optim.AdamW(params, lr=1e-4)

        def step() -> None:
            loss = F.cross_entropy((100 * clip.dense_forward(x) @ text.T).flatten(0, 2), labels.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()

        step()  # warm-up
        train = _median_seconds(step, max(2, args.repeats // 2))
        p, d = statistics.median(plain), statistics.median(dna)
        print(f"| last {n} | {sum(q.numel() for q in params):,} | {p:.3f} | {d:.3f} | {d / p:.2f} | {train:.2f} |", flush=True)


if __name__ == "__main__":
    main()
