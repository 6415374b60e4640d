"""`dna train` on a tiny generated ADE20K training split: the loss goes down, resume equals an uninterrupted
run, torchrun with 2 gloo ranks equals one process, the CLI's errors; `dna stats`; training-split readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets import DATASETS
from clipseg_sparse.dna.train import TrainConfig, lr_factor, train
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark

runner = CliRunner()


@pytest.fixture(scope="module")
def ade_train(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ade")
    make_benchmark("ade20k-train", root, n=4, size=(64, 80), seed=3)
    return root


def _config(root: Path, **kw) -> TrainConfig:
    base = dict(dataset="ade20k", data=str(root), model=TINY_CONFIG, pretrained="none", steps=4, batch_size=2,
                lr=2e-2, resolution=64, templates="single", amp="off", seed=5)
    return TrainConfig(**{**base, **kw})


def _fixed_batch_loss(root: Path, adapter: Path | None) -> float:
    """Dense loss of the centre crops of every training image, with or without the trained adapter."""
    from clipseg_sparse import load_clip
    from clipseg_sparse.datasets import class_vocabulary
    from clipseg_sparse.dna import apply_adapter
    from clipseg_sparse.dna.data import TrainingSet
    from clipseg_sparse.dna.train import Objective
    from clipseg_sparse.segment.vocabulary import embed_names

    clip = load_clip(TINY_CONFIG, pretrained=None, device="cpu")
    bench = DATASETS.get("ade20k")
    vocab, _ = class_vocabulary("ade20k")
    text = embed_names(clip, list(vocab.flat_names), "single", use_cache=False).clone()
    if adapter is not None:
        apply_adapter(clip, adapter)
    data = TrainingSet(bench.samples(root, "train"), 64, clip.mean, clip.std, 0, bench, 16, augment=False)
    pixels, labels = zip(*(data[(i, 0, 0)] for i in range(len(data))))
    with torch.no_grad():
        ce, count = Objective(clip, text, vocab.name_to_class, len(vocab), True, clip.logit_scale)(torch.stack(pixels), torch.stack(labels))
    return float(ce / count)


def test_train_lowers_the_loss_and_resume_equals_uninterrupted_run(ade_train, tmp_path):
    cfg = _config(ade_train, warmup=1, weight_decay=0.01)
    whole = train(cfg, tmp_path / "whole", device="cpu", progress=False)
    assert whole.step == 4 and len(whole.losses) == 4
    assert whole.trainable_parameters == 2 * 96 * 96 + 2 * 96 + 3  # one block: Q-, V- with biases, 3 alphas
    before = _fixed_batch_loss(ade_train, None)  # the warm start is the unmodified model up to O(eps)
    after = _fixed_batch_loss(ade_train, whole.adapter)
    assert after < before - 0.05, (before, after)
    log = json.loads((tmp_path / "whole" / "train.json").read_text())
    assert log["steps_done"] == 4 and log["losses"] == whole.losses

    part = train(cfg, tmp_path / "split", device="cpu", progress=False, stop_after=2)
    assert part.step == 2 and not (tmp_path / "split" / "adapter.safetensors").exists()
    rest = train(cfg, tmp_path / "split", device="cpu", progress=False)
    assert rest.resumed_from == 2 and rest.step == 4
    assert rest.losses == whole.losses
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k in a["adapter"]:
        assert torch.equal(a["adapter"][k], b["adapter"][k]), k
    assert a["scheduler"] == b["scheduler"]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][n], sb[i][n]) for i in sa for n in sa[i])
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    # a finished run is returned, not retrained
    again = train(cfg, tmp_path / "whole", device="cpu", progress=False)
    assert again.resumed_from == 4 and again.losses == whole.losses


def test_image_objective_on_an_image_folder(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("golden_retriever", "tabby_cat"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "imgs" / name / f"{i}.jpg")
    cfg = TrainConfig(objective="image", data=str(tmp_path / "imgs"), model=TINY_CONFIG, pretrained="none", steps=2,
                      batch_size=2, lr=1e-2, resolution=64, templates="single", amp="off")
    result = train(cfg, tmp_path / "run", device="cpu", progress=False)
    assert result.step == 2 and all(np.isfinite(result.losses))
    # 2 classes: the loss starts near log 2 (random weights give near-uniform zero-shot probabilities)
    assert 0.3 < result.losses[0] < 1.5
    assert (tmp_path / "run" / "adapter.safetensors").is_file()


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(dataset="ade20k", steps=10, warmup=2, lr=1.0, min_lr=0.1)
    assert [lr_factor(s, cfg) for s in (0, 1)] == [0.5, 1.0]
    assert abs(lr_factor(2, cfg) - 1.0) < 1e-12
    assert abs(lr_factor(6, cfg) - (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 4 / 8)))) < 1e-12


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_two_gloo_ranks_equal_one_process(ade_train, tmp_path):
    cfg = _config(ade_train, steps=2)
    one = train(cfg, tmp_path / "one", device="cpu", progress=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", CLIPSEG_SPARSE_CACHE=str(tmp_path / "cache"))
    args = ["dna", "train", "--out", str(tmp_path / "two"), "--root", str(ade_train), "--dataset", "ade20k", "--model", TINY_CONFIG,
            "--pretrained", "none", "--device", "cpu", "--steps", "2", "--batch-size", "2", "--lr", "2e-2", "--resolution", "64",
            "--templates", "single", "--amp", "off", "--seed", "5"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "clipseg_sparse", *args],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    from clipseg_sparse.dna import load_adapter

    a, b = load_adapter(one.adapter), load_adapter(tmp_path / "two" / "adapter.safetensors")
    # same global batch, gradients averaged over ranks: equal up to float summation order (which Adam's
    # normalisation amplifies on near-zero gradients to ~1e-4 here; one step moves a weight by ~lr = 2e-2)
    for k in a.tensors:
        torch.testing.assert_close(a.tensors[k], b.tensors[k], atol=1e-3, rtol=0)
    log = json.loads((tmp_path / "two" / "train.json").read_text())
    assert log["world_size"] == 2
    np.testing.assert_allclose(log["losses"], one.losses, rtol=1e-5)


def test_cli_train_stats_and_errors(ade_train, tmp_path):
    out = tmp_path / "cli"
    args = ["dna", "train", "--out", str(out), "--root", str(ade_train), "--dataset", "ade20k", "--model", TINY_CONFIG,
            "--pretrained", "none", "--device", "cpu", "--steps", "2", "--batch-size", "2", "--resolution", "64", "--templates", "single"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "steps 2/2" in r.stdout and (out / "adapter.safetensors").is_file()
    r = runner.invoke(app, args)  # finished: shown, not retrained
    assert r.exit_code == 0 and "not retraining" in r.stderr
    r = runner.invoke(app, [*args[:-6], "--steps", "3", "--batch-size", "2", "--resolution", "64", "--templates", "single"])
    assert r.exit_code == 2 and "other settings (steps)" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["dna", "train", "--out", str(tmp_path / "x"), "--root", str(tmp_path / "nothing"), "--dataset", "ade20k",
                            "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu"])
    assert r.exit_code == 2 and "not found" in r.stderr and "Traceback" not in r.output
    # stats: V+/V- table; class subspaces without and with DnA
    r = runner.invoke(app, ["dna", "stats", str(out / "adapter.safetensors"), "--model", TINY_CONFIG, "--pretrained", "none",
                            "--device", "cpu", "--dataset", "ade20k", "--root", str(ade_train), "--split", "train",
                            "--resolution", "64", "--rank", "2", "--out", str(tmp_path / "stats.json")])
    assert r.exit_code == 0, r.output
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [(row["block"], row["head"]) for row in stats["value_subspaces"]] == [(2, 0), (2, 1), (2, 2)]
    assert stats["class_subspaces"]["without"]["pairs"] > 0
    # an adapter for another model: one line, exit code 2
    other = tmp_path / "tiny-other.json"
    other.write_text(Path(TINY_CONFIG).read_text())
    r = runner.invoke(app, ["dna", "stats", str(out / "adapter.safetensors"), "--model", str(other), "--pretrained", "none", "--device", "cpu"])
    assert r.exit_code == 2 and "trained for model 'tiny-vit'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _png(path: Path, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(values.astype(np.uint8), "L").save(path)


def test_training_split_readers(tmp_path):
    # VOC aug = train.txt on SegmentationClass, then aug.txt on SegmentationClassAug (mmseg's ConcatDataset)
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    for i in ("a", "b", "c"):
        Image.new("RGB", (8, 8)).save((voc / "JPEGImages").mkdir(parents=True, exist_ok=True) or voc / "JPEGImages" / f"{i}.jpg")
    _png(voc / "SegmentationClass" / "a.png", np.zeros((8, 8)))
    _png(voc / "SegmentationClassAug" / "b.png", np.ones((8, 8)))
    _png(voc / "SegmentationClassAug" / "c.png", np.ones((8, 8)))
    (voc / "ImageSets" / "Segmentation").mkdir(parents=True)
    (voc / "ImageSets" / "Segmentation" / "train.txt").write_text("a\n")
    (voc / "ImageSets" / "Segmentation" / "aug.txt").write_text("c\nb\n")
    bench = DATASETS.get("voc21")
    aug = bench.samples(tmp_path, "aug")
    assert [(s.id, s.label.parent.name) for s in aug] == [("a", "SegmentationClass"), ("c", "SegmentationClassAug"), ("b", "SegmentationClassAug")]
    assert [s.id for s in bench.samples(tmp_path, "train")] == ["a"]
    # COCO-Stuff train2017 and ADE20K training, by their mmseg file names
    _png(tmp_path / "coco" / "annotations" / "train2017" / "000000000009_labelTrainIds.png", np.zeros((8, 8)))
    Image.new("RGB", (8, 8)).save((tmp_path / "coco" / "images" / "train2017").mkdir(parents=True) or tmp_path / "coco" / "images" / "train2017" / "000000000009.jpg")
    assert [s.id for s in DATASETS.get("coco-stuff").samples(tmp_path / "coco", "train")] == ["000000000009"]
    make_benchmark("ade20k-train", tmp_path / "ade", n=2)
    assert [s.id for s in DATASETS.get("ade20k").samples(tmp_path / "ade", "train")] == ["ADE_train_00000000", "ADE_train_00000001"]
    with pytest.raises(ValueError, match="unknown split 'aug'"):
        DATASETS.get("ade20k").samples(tmp_path / "ade", "aug")


def test_rank_shares_partition_each_global_batch():
    from clipseg_sparse.dna.data import StepBatches

    whole = list(StepBatches(5, 4, 3, seed=1))
    shares = [list(StepBatches(5, 4, 3, seed=1, rank=r, world=2)) for r in range(2)]
    for step, keys in enumerate(whole):
        assert sorted(shares[0][step] + shares[1][step]) == sorted(keys)
        assert [k[1] for k in keys] == [step] * 4
    # epochs are permutations: 12 slots over 5 items visit every item twice before any a third time
    visits = [k[0] for keys in whole for k in keys]
    assert sorted(visits[:10]) == sorted(list(range(5)) * 2)
    assert list(StepBatches(5, 4, 3, seed=1, start=2)) == whole[2:]
