"""CPU training check for DnA: a small ViT trained from scratch on generated images, three attentions.

Task: a 32 x 32 image holds one red target shape (square, disc, cross or ring: the label) and several
distractor shapes of any class in other colours, on noise. Classifying it needs attention to the one red
object and to ignore the rest. Test sets: the training distribution (3 distractors) and a shifted one with
6 distractors. Attentions (same ViT otherwise: patch 4, width 64, depth 3, CLS token, pre-LN, MLP x2):

- `softmax`: standard multi-head attention, 4 heads.
- `diff`: Differential Attention (Ye et al. 2024, microsoft/unilm Diff-Transformer/multihead_diffattn.py):
  heads halved (2), per head (softmax(Q1 K1^T s) - lambda softmax(Q2 K2^T s)) V with V of width 2 d_h,
  lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 depth),
  lambda vectors ~ N(0, 0.1); headwise RMSNorm (eps 1e-5, affine), times (1 - lambda_init), out_proj.
- `dna`: clipseg_sparse.dna.DenoisingAttention from scratch (4 heads, alpha 0.5, sign +1 as in
  rjccv/DnA vit/dna_models.py).

Every Linear gets trunc_normal(std 0.02) and zero bias (the published DnA/DeiT init). AdamW lr 1e-3,
weight decay 0.05, cosine schedule, batch 64. Reported per attention over seeds: top-1 accuracy, expected
calibration error (15 equal-width confidence bins, |accuracy - confidence| weighted by bin mass), and for
DnA the principal angles between V+ and V- per block and head and their normalised Frobenius inner product.

    python benchmarks/dna_cpu.py --seeds 3 --out benchmarks/dna_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from clipseg_sparse.dna import DenoisingAttention
from clipseg_sparse.dna.stats import value_subspaces

SIZE, PATCH, DIM, HEADS, DEPTH, CLASSES = 32, 8, 64, 4, 3, 4
TARGET = (0.95, 0.15, 0.1)
DISTRACTOR_COLOURS = ((0.1, 0.8, 0.2), (0.15, 0.3, 0.95), (0.75, 0.75, 0.75), (0.55, 0.2, 0.7))


def _shape_mask(kind: int, cy: int, cx: int) -> np.ndarray:
    yy, xx = np.mgrid[:SIZE, :SIZE]
    dy, dx = yy - cy, xx - cx
    if kind == 0:  # filled square
        return (abs(dy) <= 3) & (abs(dx) <= 3)
    if kind == 1:  # disc
        return dy**2 + dx**2 <= 12
    if kind == 2:  # cross
        return ((abs(dy) <= 3) & (abs(dx) <= 1)) | ((abs(dx) <= 3) & (abs(dy) <= 1))
    return ((abs(dy) <= 3) & (abs(dx) <= 3)) & ~((abs(dy) <= 1) & (abs(dx) <= 1))  # ring (hollow square)


def make_images(n: int, distractors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n x 3 x 32 x 32 images and n labels (the red shape's class)."""
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, 0.12, size=(n, SIZE, SIZE, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=n)
    for i in range(n):
        spots = rng.choice(16, size=distractors + 1, replace=False)  # a 4 x 4 grid of cells, one shape per cell
        for j, spot in enumerate(spots):
            cy, cx = 4 + 8 * (spot // 4) + rng.integers(-1, 2), 4 + 8 * (spot % 4) + rng.integers(-1, 2)
            if j == 0:
                kind, colour = labels[i], np.array(TARGET)
            else:
                kind, colour = rng.integers(0, CLASSES), np.array(DISTRACTOR_COLOURS[rng.integers(0, len(DISTRACTOR_COLOURS))])
            colour = np.clip(colour + rng.normal(0, 0.05, 3), 0, 1)
            images[i][_shape_mask(kind, cy, cx)] = colour
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels)


class DiffAttention(nn.Module):
    """Differential attention, multihead_diffattn.py with half the heads (batch first, no mask)."""

    def __init__(self, dim: int, heads: int, depth: int) -> None:
        super().__init__()
        self.h = heads // 2
        self.d = dim // heads  # head_dim of each of the two maps; V has 2 d per head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.lq1, self.lk1, self.lq2, self.lk2 = (nn.Parameter(torch.randn(self.d) * 0.1) for _ in range(4))
        self.norm = nn.RMSNorm(2 * self.d, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q = q.view(B, N, 2 * self.h, self.d).transpose(1, 2)
        k = k.view(B, N, 2 * self.h, self.d).transpose(1, 2)
        v = v.view(B, N, self.h, 2 * self.d).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-2, -1) * self.d**-0.5, -1).view(B, self.h, 2, N, N)
        lam = torch.exp((self.lq1 * self.lk1).sum()) - torch.exp((self.lq2 * self.lk2).sum()) + self.lambda_init
        out = (a[:, :, 0] - lam * a[:, :, 1]) @ v
        out = self.norm(out) * (1 - self.lambda_init)
        return self.out_proj(out.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, kind: str, depth: int) -> None:
        super().__init__()
        self.kind = kind
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        if kind == "softmax":
            self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        elif kind == "dna":
            self.attn = DenoisingAttention(DIM, HEADS)
        else:
            self.attn = DiffAttention(DIM, HEADS, depth)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        y = self.attn(y) if self.kind == "diff" else self.attn(y, y, y, need_weights=False)[0]
        x = x + y
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM, PATCH, PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos = nn.Parameter(torch.randn(1, (SIZE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(kind, i) for i in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.MultiheadAttention):
                nn.init.trunc_normal_(m.in_proj_weight, std=0.02)
                nn.init.zeros_(m.in_proj_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x[:, 0]))


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    conf, pred = probs.max(1)
    correct = (pred == labels).float()
    edges = torch.linspace(0, 1, bins + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            ece += inside.float().mean().item() * abs(correct[inside].mean().item() - conf[inside].mean().item())
    return ece


def run(kind: str, seed: int, data: dict, epochs: int, batch: int = 64) -> dict:
    torch.manual_seed(seed)
    model = ViT(kind)
    init_rows = value_subspaces({i: b.attn for i, b in enumerate(model.blocks)}) if kind == "dna" else []
    x, y = data["train"]
    steps = epochs * math.ceil(len(x) / batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    seconds = time.perf_counter() - start
    result = {"attention": kind, "seed": seed, "train_seconds": seconds, "parameters": sum(p.numel() for p in model.parameters())}
    model.eval()
    with torch.no_grad():
        for name in ("test", "test_shift"):
            tx, ty = data[name]
            probs = torch.softmax(torch.cat([model(tx[i : i + 256]) for i in range(0, len(tx), 256)]), 1)
            result[f"{name}_acc"] = (probs.argmax(1) == ty).float().mean().item()
            result[f"{name}_ece"] = expected_calibration_error(probs, ty)
    if kind == "dna":
        rows = value_subspaces({i: b.attn for i, b in enumerate(model.blocks)})
        result["v_angle_mean_init"] = float(np.mean([r["angle_mean"] for r in init_rows]))
        result["v_angle_mean"] = float(np.mean([r["angle_mean"] for r in rows]))
        result["v_angle_min"] = float(np.min([r["angle_min"] for r in rows]))
        result["v_frobenius_abs_mean"] = float(np.mean([abs(r["frobenius"]) for r in rows]))
        result["alpha_mean"] = float(np.mean([r["alpha"] for r in rows]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: on a shared machine 2 threads spin and run 10-40x slower)")
    parser.add_argument("--attentions", default="softmax,diff,dna")
    parser.add_argument("--out", default=None, help="write all runs as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = {"train": make_images(args.train, 3, 0), "test": make_images(args.test, 3, 1), "test_shift": make_images(args.test, 6, 2)}
    runs = []
    for kind in args.attentions.split(","):
        for seed in range(args.seeds):
            runs.append(run(kind, seed, data, args.epochs))
            print(json.dumps(runs[-1]), flush=True)
    load = os.getloadavg()[0]
    print(f"\nload average (1 min) at the end: {load:.1f}; {os.cpu_count()} CPUs; torch threads {args.threads}\n")
    print("| attention | params | acc (3 distractors) | ECE | acc (6 distractors) | ECE | V+/V- mean angle (init -> trained) | train s/run |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.attentions.split(","):
        rs = [r for r in runs if r["attention"] == kind]
        ms = lambda k: f"{100 * np.mean([r[k] for r in rs]):.1f} ± {100 * np.std([r[k] for r in rs]):.1f}"  # noqa: E731
        angle = f"{np.mean([r['v_angle_mean_init'] for r in rs]):.1f}° -> {np.mean([r['v_angle_mean'] for r in rs]):.1f}°" if kind == "dna" else "-"
        print(f"| {kind} | {rs[0]['parameters']:,} | {ms('test_acc')} | {ms('test_ece')} | {ms('test_shift_acc')} | {ms('test_shift_ece')} | {angle} | {np.mean([r['train_seconds'] for r in rs]):.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load_average": load, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
