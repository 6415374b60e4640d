"""Image banks (CorrCLIPv2): bank build images/s, retrieval time per image at two bank sizes, and the resident
memory of a memory-mapped bank much larger than what the process keeps, side by side in one run.

1. build: `build_bank` on N random images (random weights: --clip ViT-B-16, DINO ViT-B/8 for the values'
   CorrCLIP body, C-RADIOv3 --keys as the key backbone), short side --short, 336/112 windows; images/s and the
   share of each network and of the region reductions (`bench.pipeline.PartTimer`).
2. retrieval: `retrieval_logits` for one image's region map (--regions regions) at the network input
   (336 x 448), 150 classes, against synthetic banks of 1 000 and 100 000 regions (1024-d keys, 512-d
   values): flat index at 1k, the published IVF-PQ (nlist 8 sqrt(N), m 32, 8 bits, nprobe 256) at 100k;
   median seconds per image (search + reading the neighbours' values + painting the logits).
3. memory: a bank of --big regions (512-d float16 values on disk, 32-d keys in a flat index) opened
   memory-mapped; peak resident set of a child process that opens it and retrieves for 20 images, next to
   the values file's size, and how much of the resident set is mapped file pages.

    python benchmarks/bank.py [--images 4] [--short 336] [--keys c_radio_v3_b] [--big 2000000] [--threads 2] [--cpu-time] [--skip build]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clipseg_sparse.segment import bank as banks


def synthetic_bank(folder: Path, rows: int, key_dim: int, value_dim: int, index: str, seed: int = 0) -> banks.ImageBank:
    """A bank folder with random clustered keys and random unit values (no images), opened."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    centres = rng.standard_normal((256, key_dim)).astype(np.float32)
    keys = np.lib.format.open_memmap(folder / banks.KEYS, mode="w+", dtype=np.float16, shape=(rows, key_dim))
    values = np.lib.format.open_memmap(folder / banks.values_file(0), mode="w+", dtype=np.float16, shape=(rows, value_dim))
    for start in range(0, rows, 100_000):
        n = min(100_000, rows - start)
        keys[start : start + n] = centres[rng.integers(0, 256, n)] + 0.5 * rng.standard_normal((n, key_dim), dtype=np.float32)
        v = rng.random((n, value_dim), dtype=np.float32) - 0.5  # uniform: cheaper to draw than normal
        values[start : start + n] = v / np.linalg.norm(v, axis=1, keepdims=True)
    keys.flush(), values.flush()
    del values
    index_obj = banks.build_index(keys, index)
    banks._faiss().write_index(index_obj, str(folder / banks.INDEX))
    manifest = {"format": banks.BANK_FORMAT, "keys": {"backbone": "synthetic"}, "values": [{"clip": "synthetic"}], "rows": rows, "hash": "synthetic"}
    (folder / banks.MANIFEST).write_text(json.dumps(manifest))
    return banks.ImageBank.open(folder)


def query_image(regions: int, size=(336, 448), key_dim: int = 1024, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cells = torch.randint(-1, regions, (size[0] // 16, size[1] // 16), generator=g)
    reg = cells.repeat_interleave(16, 0).repeat_interleave(16, 1)
    feats = F.normalize(torch.randn(key_dim, *size, generator=g), dim=0)
    return reg, feats


def time_retrieval(bank: banks.ImageBank, regions: int, key_dim: int, classes: int, repeat: int) -> float:
    reg, feats = query_image(regions, key_dim=key_dim)
    text = {"synthetic": F.normalize(torch.randn(classes, bank.values["synthetic"].shape[1]), dim=-1)}
    banks.retrieval_logits(reg, feats, bank, text)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        banks.retrieval_logits(reg, feats, bank, text)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_child(folder: str, regions: int, classes: int) -> None:
    """Open the big bank and retrieve for 20 images; print the peak resident set (MiB)."""
    bank = banks.ImageBank.open(folder)
    text = {"synthetic": F.normalize(torch.randn(classes, bank.values["synthetic"].shape[1]), dim=-1)}
    for seed in range(20):
        reg, feats = query_image(regions, key_dim=bank.keys.shape[1], seed=seed)
        banks.retrieval_logits(reg, feats, bank, text)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = lambda key: float(status.get(key, "0 kB").split()[0]) / 1024  # noqa: E731
    # VmHWM, not ru_maxrss: after exec ru_maxrss keeps the forking parent's peak (its 2 GB of generated rows)
    print(json.dumps({"peak_mib": kib("VmHWM"), "file_mib": kib("RssFile"), "anon_mib": kib("RssAnon")}))


def build_rate(images: int, short: int, keys: str, clip_name: str, cpu_time: bool = False) -> tuple[float, list]:
    """(images/s of `build_bank` after a one-image warm-up, its parts: `bench.pipeline.PartTimer` over the
    library's network calls and the region reductions)."""
    from clipseg_sparse.bench.pipeline import NETWORK, OTHER, PartTimer, timed_library
    from clipseg_sparse import load_clip
    from clipseg_sparse.attention import resolve_spec
    from clipseg_sparse.methods.corrclipv2 import VALUES
    from clipseg_sparse.segment.settings import InferenceSettings

    clip = load_clip(clip_name, pretrained=None, device="cpu")  # random: its backbones load random weights
    key_backbone = clip.proxies.get(keys, clip.device)
    values = [banks.ValueModel(clip, resolve_spec(VALUES.format(first=6, last=10)), InferenceSettings(resolution=short, window=336, stride=112))]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        from PIL import Image

        jobs, regions = [], {}
        for i in range(images):
            rgb = rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)
            Image.fromarray(rgb).save(Path(tmp) / f"{i}.png")
            jobs.append((Path(tmp) / f"{i}.png", str(i)))
            regions[str(i)] = np.kron(rng.integers(-1, 30, (15, 20)), np.ones((25, 25), dtype=np.int64))
        source = lambda rgb, name: regions[name]  # noqa: E731
        banks.build_bank(jobs[:1], Path(tmp) / "warm", values, key_backbone, {"weights": "none"}, source, "random", "flat")
        timer = PartTimer(clock=time.process_time if cpu_time else time.perf_counter)
        with timed_library(timer), contextlib.ExitStack() as stack:
            for name in ("resized_region_means", "factored_region_means"):
                stack.enter_context(timer.wrapped(banks, name, f"{name} (reduction)", OTHER))
            with timer.part("bank build", OTHER):
                banks.build_bank(jobs, Path(tmp) / "bank", values, key_backbone, {"weights": "none"}, source, "random", "flat")
        whole = timer.parts.pop("bank build")
        rest = whole.seconds - sum(p.own for p in timer.parts.values())
        parts = sorted(timer.parts.values(), key=lambda p: -p.own) + [type(whole)("rest (image loading, writing parts, merging, index)", OTHER, 1, rest, rest)]
        return images / whole.seconds, [(p.name, p.kind == NETWORK, p.own / images, p.own / whole.seconds) for p in parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--short", type=int, default=336)
    parser.add_argument("--keys", default="c_radio_v3_b")
    parser.add_argument("--clip", default="ViT-B-16")
    parser.add_argument("--regions", type=int, default=30)
    parser.add_argument("--classes", type=int, default=150)
    parser.add_argument("--big", type=int, default=2_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="bank build: time by process CPU time (a machine loaded by other jobs; one thread)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], choices=["build", "retrieval", "memory"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return memory_child(args.child, args.regions, args.classes)
    if "build" not in args.skip:
        rate, parts = build_rate(args.images, args.short, args.keys, args.clip, args.cpu_time)
        clock = "CPU" if args.cpu_time else "wall"
        print(f"bank build: {rate:.3f} images/s by {clock} time ({args.images} images 375x500, {args.clip} + DINO ViT-B/8 values at short side {args.short}, {args.keys} keys, random weights, {args.threads} threads)")
        for name, network, seconds, share in parts:
            print(f"  {name:60s} {'network' if network else '':8s} {seconds:8.2f} s/image {share:6.1%}")
    with tempfile.TemporaryDirectory() as tmp:
        if "retrieval" not in args.skip:
            for rows, kind in ((1_000, "flat"), (100_000, "ivfpq")):
                t0 = time.perf_counter()
                bank = synthetic_bank(Path(tmp) / f"b{rows}", rows, 1024, 512, kind)
                built = time.perf_counter() - t0
                seconds = time_retrieval(bank, args.regions, 1024, args.classes, args.repeat)
                print(f"retrieval at {rows} regions ({kind}): {seconds * 1000:.1f} ms per image ({args.regions} regions, {args.classes} classes, 336x448); index built in {built:.1f} s")
        if "memory" not in args.skip:
            folder = Path(tmp) / "big"
            synthetic_bank(folder, args.big, 32, 512, "flat")
            size = (folder / banks.values_file(0)).stat().st_size / 2**20
            child = subprocess.run([sys.executable, __file__, "--child", str(folder), "--regions", str(args.regions), "--classes", str(args.classes)],
                                   capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))  # fmt: skip
            got = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"memory: values store {size:.0f} MiB on disk ({args.big} regions x 512 float16), flat 32-d index in RAM; a process retrieving "
                  f"for 20 images: peak RSS {got['peak_mib']:.0f} MiB ({got['peak_mib'] / size:.2f} x the store), at the end {got['file_mib']:.0f} MiB "
                  f"of it file-backed (mapped store pages) and {got['anon_mib']:.0f} MiB anonymous (torch, faiss, the index)")


if __name__ == "__main__":
    main()
