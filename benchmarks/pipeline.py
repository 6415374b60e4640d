"""One image's run by part, for each preset family and class count: each network's forward, each stage, the
label map, writing outputs; the whole run over the networks' forwards (`clipseg_sparse/bench/pipeline.py`,
`clipseg-sparse bench --suites pipeline`). Each (family, classes) runs in a fresh process (its own allocator
and peak memory); random weights on the real architectures, one thread by default.

    python benchmarks/pipeline.py [--families sclip naclip+pamr ...] [--classes 21 150] [--size 480x640] [--threads 1] [--cpu-time] [--json rows.jsonl]
    python benchmarks/pipeline.py --families all-presets --classes 150 --cpu-time --no-memory --cost-file clipseg_sparse/data/preset_cost.json

Prints, per run, the parts table, then one summary row per run: networks' seconds, whole seconds, their ratio,
the largest part outside the networks, and the run's peak memory over the resident set before it. A family is
one of FAMILIES or any preset (`all-presets`: every registered one) with its paper's protocol. The SAM 3 families
(`sam3`, `activesam`) run the full-size random Sam3Model: minutes per run on one CPU thread (half an hour for sam3
at 150 classes). `--cost-file`
keeps each run's whole and networks' seconds by preset in the file `ls presets` reads (its "CPU cost" column:
the whole run over sclip's), merged into what the file holds, written after each run (an interrupted sweep keeps
what it measured; `--skip-measured` resumes it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

from clipseg_sparse.bench.pipeline import FAMILIES, NETWORK


def one(family: str, classes: int, size: str, threads: int, cpu_time: bool, memory: bool) -> None:
    from rich.console import Console

    from clipseg_sparse.bench.pipeline import bench_pipeline, rich_pipeline_table

    torch.set_num_threads(threads)
    report = bench_pipeline(family, classes, tuple(int(v) for v in size.split("x")), cpu_time=cpu_time, memory=memory)
    Console(stderr=True, width=160).print(rich_pipeline_table(report))
    print(json.dumps(report.as_dict()))


def summary(rows: list[dict]) -> None:
    print("| family | classes | networks s | whole s | whole / networks | largest other part (s) | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        others = [p for p in r["parts"] if p["kind"] != NETWORK]
        top = max(others, key=lambda p: p["own"])
        peak = max((p["peak_mib"] or 0) for p in r["parts"]) or float("nan")
        print(f"| {r['family']} | {r['classes']} | {r['networks']:.2f} | {r['whole']:.2f} | **{r['whole'] / r['networks']:.2f}** | "
              f"{top['name']} ({top['own']:.2f}) | {peak:.0f} |")  # fmt: skip


def keep_cost(path: Path, row: dict, args: argparse.Namespace) -> None:
    """Merge one run into the cost file (atomically: the file `ls presets` reads is never half written)."""
    costs = json.loads(path.read_text()) if path.is_file() else {"presets": {}}
    costs["measured"] = (
        f"{date.today()}: one {args.size} image with {row['classes']} classes, random weights, each preset with its "
        f"paper's protocol (ADE20K's settings), {args.threads} thread(s), {'process CPU time' if args.cpu_time else 'wall time'}, "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores); `python benchmarks/pipeline.py` (see its docstring)"
    )
    costs["presets"][row["preset"]] = {"whole": round(row["whole"], 3), "networks": round(row["networks"], 3), "model": row["model"]}
    costs["presets"] = dict(sorted(costs["presets"].items()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(costs, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), help="FAMILIES names, preset names, or all-presets")
    parser.add_argument("--classes", nargs="*", type=int, default=[21, 150])
    parser.add_argument("--size", default="480x640")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="append each run's JSON line to this file")
    parser.add_argument("--cpu-time", action="store_true", help="time by process CPU time (a machine loaded by other jobs; one thread)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory run (time only: half the time)")
    parser.add_argument("--cost-file", type=Path, help="keep each run's seconds by preset in this file (the data `ls presets` reads)")
    parser.add_argument("--skip-measured", action="store_true", help="with --cost-file: skip the presets it already holds")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # family classes: run here, print its JSON line
    args = parser.parse_args()
    if args.one:
        return one(args.one[0], int(args.one[1]), args.size, args.threads, args.cpu_time, not args.no_memory)
    if args.cost_file and len(args.classes) != 1:
        parser.error("--cost-file keeps one class count: give one --classes")
    if args.families == ["all-presets"]:
        from clipseg_sparse.attention import PRESETS

        args.families = PRESETS.names()
    if args.skip_measured and args.cost_file and args.cost_file.is_file():
        measured = json.loads(args.cost_file.read_text())["presets"]
        args.families = [f for f in args.families if f not in measured]
    rows = []
    for family in args.families:
        for classes in args.classes:
            cmd = [sys.executable, __file__, "--one", family, str(classes), "--size", args.size, "--threads", str(args.threads)]
            cmd += ["--cpu-time"] * args.cpu_time + ["--no-memory"] * args.no_memory
            done = subprocess.run(cmd, capture_output=True, text=True)
            sys.stderr.write(done.stderr)
            if done.returncode:
                print(f"{family} {classes}: failed (exit {done.returncode})", flush=True)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{family} {classes}: whole {rows[-1]['whole']:.2f} s, networks {rows[-1]['networks']:.2f} s", file=sys.stderr, flush=True)
            if args.cost_file:
                keep_cost(args.cost_file, rows[-1], args)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    summary(rows)


if __name__ == "__main__":
    main()
