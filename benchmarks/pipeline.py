"""One image's run by part, for each preset family and class count: each network's forward, each stage, the
label map, writing outputs; the whole run over the networks' forwards (`clipseg_sparse/bench/pipeline.py`,
`clipseg-sparse bench --suites pipeline`). Each (family, classes) runs in a fresh process (its own allocator
and peak memory); random weights on the real architectures, one thread by default.

    python benchmarks/pipeline.py [--families sclip naclip+pamr ...] [--classes 21 150] [--size 480x640] [--threads 1] [--cpu-time] [--json rows.jsonl]

Prints, per run, the parts table, then one summary row per run: networks' seconds, whole seconds, their ratio,
the largest part outside the networks, and the run's peak memory over the resident set before it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from clipseg_sparse.bench.pipeline import FAMILIES, NETWORK


def one(family: str, classes: int, size: str, threads: int, cpu_time: bool) -> None:
    from rich.console import Console

    from clipseg_sparse.bench.pipeline import bench_pipeline, rich_pipeline_table

    torch.set_num_threads(threads)
    report = bench_pipeline(family, classes, tuple(int(v) for v in size.split("x")), cpu_time=cpu_time)
    Console(stderr=True, width=160).print(rich_pipeline_table(report))
    print(json.dumps(report.as_dict()))


def summary(rows: list[dict]) -> None:
    print("| family | classes | networks s | whole s | whole / networks | largest other part (s) | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        others = [p for p in r["parts"] if p["kind"] != NETWORK]
        top = max(others, key=lambda p: p["own"])
        peak = max((p["peak_mib"] or 0) for p in r["parts"])
        print(f"| {r['family']} | {r['classes']} | {r['networks']:.2f} | {r['whole']:.2f} | **{r['whole'] / r['networks']:.2f}** | "
              f"{top['name']} ({top['own']:.2f}) | {peak:.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--classes", nargs="*", type=int, default=[21, 150])
    parser.add_argument("--size", default="480x640")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="append each run's JSON line to this file")
    parser.add_argument("--cpu-time", action="store_true", help="time by process CPU time (a machine loaded by other jobs; one thread)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # family classes: run here, print its JSON line
    args = parser.parse_args()
    if args.one:
        return one(args.one[0], int(args.one[1]), args.size, args.threads, args.cpu_time)
    rows = []
    for family in args.families:
        for classes in args.classes:
            cmd = [sys.executable, __file__, "--one", family, str(classes), "--size", args.size, "--threads", str(args.threads)]
            cmd += ["--cpu-time"] if args.cpu_time else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            sys.stderr.write(done.stderr)
            if done.returncode:
                print(f"{family} {classes}: failed (exit {done.returncode})", flush=True)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    summary(rows)


if __name__ == "__main__":
    main()
