"""`clipseg-sparse dna train|stats`: fit DnA's negative branch on a frozen CLIP, and inspect its subspaces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import Device, DeviceOpt, ModelOpt, Precision, PretrainedOpt, TemplatesOpt, check_out, fail, load_model, out_console, user_errors
from ..runtime.progress import err_console

dna_app = typer.Typer(help="DnA (Denoising Attention): train its negative branch on a frozen CLIP; subspace statistics.", no_args_is_help=True)


@dna_app.command("train", no_args_is_help=True)
@user_errors()
def train_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run folder: settings.json (claimed at start: another run with other settings is refused), checkpoint.pt (resume), adapter.safetensors, train.json.")],
    root: Annotated[Path, typer.Option("--root", help="Dataset folder (dense: the dataset's mmseg layout) or an ImageFolder (image: one sub-folder per class).")],
    objective: Annotated[str, typer.Option("--objective", help="dense: per-patch cross-entropy on a segmentation dataset; image: zero-shot-head classification on an ImageFolder.")] = "dense",
    dataset: Annotated[Optional[str], typer.Option("--dataset", "-d", help="Segmentation dataset for --objective dense (ade20k, coco-stuff, voc21, ...; `ls datasets`).")] = None,
    split: Annotated[str, typer.Option("--split", help="Dataset split: train (every dataset) or aug (VOC: train + SBD aug, 10582 images).")] = "train",
    class_names: Annotated[str, typer.Option("--class-names", help="Prompt names: sclip, plain, or a file with one class per line.")] = "sclip",
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    blocks: Annotated[int, typer.Option("--blocks", help="Convert and train the last N blocks.")] = 1,
    eps: Annotated[float, typer.Option("--eps", help="Warm start: Q- = eps Q+, V- = -eps V+.")] = 1e-4,
    negative: Annotated[str, typer.Option("--negative", help="Negative map over -S: softmax (softmin, published) or entmax:ALPHA / sparsemax (sparse softmin).")] = "softmax",
    sign: Annotated[Optional[int], typer.Option("--sign", help="+1: out = pos + alpha neg (vit/dna_models.py); -1: pos - alpha neg (vit/dna.py); default: the variant's published sign.")] = None,
    shared_values: Annotated[bool, typer.Option("--shared-values", help="Ablation: one V, (softmax(S+) - alpha softmin(S-)) V.")] = False,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Global batch (split over torchrun ranks).")] = 16,
    lr: Annotated[float, typer.Option("--lr", help="AdamW peak learning rate.")] = 1e-4,
    min_lr: Annotated[float, typer.Option("--min-lr", help="Learning rate at the end of the cosine schedule.")] = 0.0,
    warmup: Annotated[int, typer.Option("--warmup", help="Linear warmup steps.")] = 0,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="AdamW weight decay on Q-, V-, alpha.")] = 0.0,
    resolution: Annotated[int, typer.Option("--resolution", help="Training crops: short side resized to this, then a random square crop of this size (at least one patch; dense: a multiple of the patch size).")] = 224,
    templates: TemplatesOpt = "openai",
    logit_scale: Annotated[Optional[float], typer.Option("--logit-scale", help="Scale on cosines in the loss (default: the model's own).")] = None,
    amp: Annotated[str, typer.Option("--amp", help="Mixed precision: auto (bf16 on CUDA, off elsewhere), bf16, fp16 (CUDA only), off.")] = "auto",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the data order and crops.")] = 0,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Use the first N training items only.")] = None,
    workers: Annotated[int, typer.Option("--workers", min=0, help="DataLoader worker processes.")] = 0,
    save_every: Annotated[int, typer.Option("--save-every", min=1, help="Checkpoint every N steps.")] = 100,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start over even if --out holds a run (with other settings, or finished).")] = False,
) -> None:
    """Train DnA's Q-, V- and alpha of the last N blocks on a frozen CLIP; writes OUT/adapter.safetensors.

    Re-running the same command resumes from OUT/checkpoint.pt; a finished run is shown, not redone.
    Several processes: `torchrun --nproc-per-node N -m clipseg_sparse dna train ...`. Use the adapter with
    `--attn SPEC/dna:OUT/adapter.safetensors` in segment, eval and sweep.
    """
    from ..dna.train import TrainConfig, train

    check_out(out, folder=True)
    config = TrainConfig(
        objective=objective, data=str(root), dataset=dataset, split=split, class_names=class_names, model=model,
        pretrained=pretrained, blocks=blocks, eps=eps, negative=negative, sign=sign, shared_values=shared_values,
        steps=steps, batch_size=batch_size, lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay,
        resolution=resolution, templates=templates, logit_scale=logit_scale, amp=amp, seed=seed, limit=limit,
    )
    result = train(config, out, device=device.value, save_every=save_every, workers=workers, overwrite=overwrite)
    from ..runtime.distributed import rank_and_world

    if rank_and_world()[0] > 0:
        return
    if result.resumed_from >= config.steps:
        err_console.print(f"{out} holds this configuration's finished run: showing it, not retraining (--overwrite retrains)", highlight=False)
    last = result.losses[-1] if result.losses else float("nan")
    first = result.losses[0] if result.losses else float("nan")
    speed = f", {result.seconds_per_step:.3f} s/step" if result.seconds_per_step else ""
    out_console().print(
        f"steps {result.step}/{config.steps}, loss {first:.4f} -> {last:.4f}, trainable parameters {result.trainable_parameters:,}{speed}",
        highlight=False,
    )
    err_console.print(f"adapter: {result.adapter}", highlight=False)


@dna_app.command("stats", no_args_is_help=True)
@user_errors()
def stats_cmd(
    adapter: Annotated[Path, typer.Argument(help="A DnA adapter (.safetensors) written by `dna train`.")],
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    device: DeviceOpt = Device.auto,
    dataset: Annotated[Optional[str], typer.Option("--dataset", "-d", help="Also compare class subspaces of dense features with and without DnA on this dataset.")] = None,
    root: Annotated[Optional[Path], typer.Option("--root", help="Dataset folder (mmseg layout).")] = None,
    split: Annotated[str, typer.Option("--split", help="Dataset split (val, train, aug).")] = "val",
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="First N images only.")] = None,
    rank: Annotated[int, typer.Option("--rank", min=1, help="Dimension of each class subspace (top singular vectors of its features).")] = 5,
    resolution: Annotated[int, typer.Option("--resolution", min=16, help="Centre crops of this size (short side resized to it).")] = 224,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the statistics as JSON here.")] = None,
) -> None:
    """Principal angles between V+ and V- per block and head, their normalised Frobenius inner product,
    and (with --dataset) principal angles between class subspaces without and with DnA."""
    from ..datasets import DATASETS
    from ..dna.adapter import load_adapter
    from ..dna.stats import adapter_stats

    if dataset is not None and root is None:
        fail("--dataset needs --root")
    check_out(out, folder=False)
    if out is not None and out.exists():
        fail(f"--out {out}: exists; choose another file (results are never overwritten)")
    loaded = load_adapter(adapter)
    if dataset is not None:
        DATASETS.get(dataset).samples(root, split)  # fail on missing data before loading the model
    clip = load_model(model, pretrained, device, Precision.fp32)
    with err_console.status("measuring subspaces"):
        record = adapter_stats(clip, loaded, dataset, root, split, limit, rank, resolution)
    out_console().print(_value_table(record))
    if "class_subspaces" in record:
        out_console().print(_class_table(record["class_subspaces"]))
    if out is not None:
        from ..runtime.atomic import atomic_path

        with atomic_path(out) as tmp:
            tmp.write_text(json.dumps(record, indent=1))
        err_console.print(f"statistics: {out}", highlight=False)


def _value_table(record: dict):
    from rich.table import Table

    table = Table("block", "head", "angle mean", "min", "max", "<V+,V->_F norm.", "alpha", title=f"V+ vs V- principal angles (degrees): {record['adapter']}")
    for r in record["value_subspaces"]:
        table.add_row(str(r["block"]), str(r["head"]), f"{r['angle_mean']:.2f}", f"{r['angle_min']:.2f}", f"{r['angle_max']:.2f}", f"{r['frobenius']:+.4f}", f"{r['alpha']:.4f}")
    return table


def _class_table(cs: dict):
    from rich.table import Table

    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    table = Table("", "classes", "pairs", "mean smallest angle", "mean angle",
                  title=f"class subspaces (rank {cs['without']['rank']}) on {cs['dataset']} {cs['split']}, {cs['images']} images (degrees)")
    for name in ("without", "with"):
        s = cs[name]
        table.add_row(f"{name} DnA", str(len(s["classes"])), str(s["pairs"]), fmt(s["min_angle_mean"]), fmt(s["angle_mean"]))
    return table
