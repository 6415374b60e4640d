"""torchrun with the gloo backend on CPU: sharded evaluation equals the single-process result."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from clipseg_sparse import load_clip
from clipseg_sparse.distributed import shard
from clipseg_sparse.evaluate import evaluate
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark


def test_shard_partitions_in_order():
    items = list(range(7))
    parts = [shard(items, r, 3) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum(parts, [])) == items


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_two_ranks_equals_one_process(tiny_clip, tmp_path):
    make_benchmark("ade20k", tmp_path / "data", n=5, size=(40, 56))
    weights = tmp_path / "tiny.safetensors"  # identical weights in every process
    save_file({k: v.contiguous() for k, v in tiny_clip.model.state_dict().items()}, weights)
    args = ["eval", "--dataset", "ade20k", "--root", str(tmp_path / "data"), "--model", TINY_CONFIG,
            "--pretrained", str(weights), "--device", "cpu", "--templates", "single",
            "--resolution", "64", "--window", "32", "--stride", "16"]
    env = dict(os.environ, CLIPSEG_SPARSE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    # the single-process reference runs here, through the library, with the same weights and settings
    one = tmp_path / "one.json"
    evaluate(load_clip(TINY_CONFIG, pretrained=str(weights), device="cpu"), "ade20k", tmp_path / "data", templates="single",
             overrides=dict(resolution=64, window=32, stride=16), out=one, progress=False, cache_dir=tmp_path / "cache")
    two = tmp_path / "two.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "clipseg_sparse", *args, "--out", str(two)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["num_images"] == 5
    assert b["metrics"] == a["metrics"] and b["per_class"] == a["per_class"]
    # each rank checkpointed its own shard: 3 + 2 images
    logs = sorted((tmp_path).glob("two.progress.rank*of2.jsonl"))
    assert [len(p.read_text().splitlines()) - 1 for p in logs] == [3, 2]
