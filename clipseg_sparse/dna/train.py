"""`dna train`: fit DnA's negative branch (Q-, V-, alpha) of the last N blocks on a frozen CLIP.

Objectives:
- `dense`: per-patch cross-entropy of the dense features against the frozen text classifier of a
  segmentation dataset's class names (a class's logit = the max over its synonyms' logits, as inference
  takes the max over synonyms), on a training split; labels reduced to the patch grid by majority.
- `image`: cross-entropy of the pooled image embedding (open_clip's own `encode_image`) against the
  class names of an ImageFolder (the zero-shot head).

AdamW on the new parameters only; linear warmup then cosine decay to `min_lr`; autocast (bf16 / fp16 with
a grad scaler) only on CUDA. `out/checkpoint.pt` holds the adapter tensors, optimizer, scheduler, scaler,
step, RNG states and losses, written atomically every `save_every` steps and at the end; `out/settings.json`
claims the folder for one configuration at start (a run with other settings is refused at once); running the same
command again resumes from it (same batches, same state) and a finished run is not recomputed. Under
torchrun each rank takes its share of every global batch and DDP averages the gradients (NCCL on GPUs,
gloo on CPU). Rank 0 writes `out/adapter.safetensors` and `out/train.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserValueError
from ..datasets import DATASETS, IGNORE_INDEX, class_vocabulary
from ..runtime.distributed import init_from_env
from ..files.results import WEIGHTS_KEY
from ..runtime.atomic import atomic_path, create_json_exclusive, write_json_atomic
from ..runtime.fingerprint import file_digest
from ..runtime.weights import is_checkpoint_path
from ..segment.vocabulary import embed_names
from .adapter import save_adapter
from .convert import convert_to_dna
from .data import StepBatches, TrainingSet, image_folder

OBJECTIVES = ("dense", "image")
CLAIM = "settings.json"  # OUT's settings record, claimed at start (claim_run)
AMP = ("auto", "off", "bf16", "fp16")


class TrainError(UserValueError):
    """A training setting or output folder that cannot be used; the message is one line."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that changes the trained adapter (written to train.json and checked on resume)."""

    objective: str = "dense"
    data: str = ""  # dataset root (dense) or ImageFolder (image)
    dataset: str | None = None  # registered segmentation dataset (dense)
    split: str = "train"
    class_names: str = "sclip"
    model: str = "ViT-B-16"
    pretrained: str = "openai"
    blocks: int = 1
    eps: float = 1e-4
    negative: str = "softmax"
    sign: int | None = None
    shared_values: bool = False
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-4
    min_lr: float = 0.0
    warmup: int = 0
    weight_decay: float = 0.0
    resolution: int = 224
    templates: str = "openai"
    logit_scale: float | None = None  # None = the model's own
    amp: str = "auto"
    seed: int = 0
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise TrainError(f"--objective {self.objective!r}: choose {' or '.join(OBJECTIVES)}")
        if self.objective == "dense" and not self.dataset:
            raise TrainError("--objective dense needs --dataset (a registered segmentation dataset) and --root")
        if self.amp not in AMP:
            raise TrainError(f"--amp {self.amp!r}: choose from {', '.join(AMP)}")
        for name in ("steps", "batch_size", "resolution", "blocks"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if not 0 <= self.warmup < self.steps:
            raise TrainError(f"--warmup must be in [0, steps) (got {self.warmup})")
        if not self.lr > 0 or not self.eps > 0:
            raise TrainError("--lr and --eps must be > 0")


def config_patch_size(model: str) -> int | None:
    """The patch size `model`'s open_clip config gives (read without building it), None if it gives none;
    ValueError for an unknown or unsupported model, as loading it would."""
    import open_clip

    from ..models.clip import check_model_name

    patch = ((open_clip.get_model_config(check_model_name(model)) or {}).get("vision_cfg") or {}).get("patch_size")
    if isinstance(patch, (list, tuple)):
        patch = patch[0]
    return int(patch) if patch else None


def check_resolution(config: TrainConfig, patch: int | None) -> None:
    """Refuse crops with no whole patch per side (the patch grid would be 0 x 0: a reshape error deep in
    the data loader), and, for the dense objective, crops that are not whole patches (labels are reduced
    to the patch grid by majority, which needs H and W multiples of the patch)."""
    if not patch:
        return
    r = config.resolution
    if r < patch:
        raise TrainError(f"--resolution {r}: smaller than one {patch}-pixel patch of {config.model} per side; the smallest valid resolution is {patch}")
    if config.objective == "dense" and r % patch:
        low, high = r // patch * patch, (r // patch + 1) * patch
        raise TrainError(f"--resolution {r}: the dense objective needs whole {patch}-pixel patches per side (labels are reduced to the patch grid); use {low} or {high}")


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the base lr at `step`: linear warmup, then cosine from 1 to min_lr / lr."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    t = (step - config.warmup) / max(config.steps - config.warmup, 1)
    floor = config.min_lr / config.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


class Objective(nn.Module):
    """loss(pixels, targets) for one batch; holds the converted open_clip model so DDP sees its parameters."""

    def __init__(self, clip, text: torch.Tensor, name_to_class: list[int], num_classes: int, dense: bool, logit_scale: float) -> None:
        super().__init__()
        self.clip, self.model = clip, clip.model
        self.register_buffer("text", text)
        self.register_buffer("name_to_class", torch.tensor(name_to_class))
        self.num_classes, self.dense, self.logit_scale = num_classes, dense, logit_scale

    def forward(self, pixels: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the cross-entropies over labelled targets, their number); the caller divides by the
        count over all ranks, so any number of ranks computes the same mean as one process."""
        if self.dense:
            feats = self.clip.dense_forward(pixels)  # B x h x w x D, L2-normalised
        else:
            feats = F.normalize(self.model.encode_image(pixels).float(), dim=-1)  # B x D
        names = self.logit_scale * feats.float() @ self.text.T
        index = self.name_to_class.expand(*names.shape[:-1], -1)
        logits = names.new_full((*names.shape[:-1], self.num_classes), -torch.inf).scatter_reduce(-1, index, names, "amax")
        targets = targets.reshape(-1).to(logits.device)
        ce = F.cross_entropy(logits.reshape(-1, self.num_classes), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return ce, (targets != IGNORE_INDEX).sum()


def _training_data(config: TrainConfig) -> tuple[list, list[str], list[int], int, object]:
    """(training items, prompt names, name -> class, number of classes, benchmark or None); read before
    the model loads and before --out is claimed, so a missing dataset claims nothing and loads nothing."""
    if config.objective == "dense":
        bench = DATASETS.get(config.dataset)
        items = bench.samples(config.data, config.split)
        vocab, _ = class_vocabulary(config.dataset, config.class_names)
        names, name_to_class, num_classes = list(vocab.flat_names), vocab.name_to_class, len(vocab)
    else:
        bench = None
        classes, items = image_folder(config.data)
        names, name_to_class, num_classes = classes, list(range(len(classes))), len(classes)
    items = items[: config.limit] if config.limit else items
    return items, names, name_to_class, num_classes, bench


def claim_run(out: Path, wanted: dict, overwrite: bool) -> None:
    """Claim `out` for these settings at start (OUT/settings.json, created exclusively as `segment` claims
    each image): a run with other settings on the same --out is refused at once, naming them, instead of
    both training and the last writer winning; the same settings go on (resume). --overwrite re-claims."""
    path = out / CLAIM
    record = {"config": wanted}
    if overwrite:
        write_json_atomic(path, record)
        return
    if create_json_exclusive(path, record):
        return
    try:
        held = json.loads(path.read_text(encoding="utf-8"))["config"]
        changed = sorted(k for k in {*wanted, *held} if held.get(k) != wanted.get(k))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise TrainError(f"{path}: not a settings record of dna train; use another --out, or --overwrite to start over") from None
    if changed:
        raise TrainError(f"{out}: holds a DnA training run with other settings ({', '.join(changed)}); use another --out, or --overwrite to start over")


def _autocast(config: TrainConfig, device: torch.device):
    """(autocast context, dtype or None): mixed precision only on CUDA."""
    import contextlib

    amp = config.amp
    if amp == "auto":
        amp = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "off"
    if amp != "off" and device.type != "cuda":
        raise TrainError(f"--amp {amp} needs a CUDA device (running on {device.type}); use --amp off or auto")
    if amp == "off":
        return contextlib.nullcontext(), None
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast("cuda", dtype=dtype), dtype


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainResult:
    adapter: Path
    step: int
    losses: list[float]
    resumed_from: int
    trainable_parameters: int
    seconds_per_step: float | None


def train(
    config: TrainConfig,
    out: str | Path,
    device: str = "auto",
    progress: bool = True,
    stop_after: int | None = None,
    save_every: int = 100,
    workers: int = 0,
    overwrite: bool = False,
) -> TrainResult:
    """Train (or resume) into the folder `out`; see the module docstring. stop_after: stop once this step
    is reached (an interruption, for tests and time-boxed jobs); the checkpoint lets the next call go on."""
    from ..models.clip import load_clip
    from ..runtime.device import resolve_device

    out = Path(out)
    ckpt_path, adapter_path, log_path = out / "checkpoint.pt", out / "adapter.safetensors", out / "train.json"
    wanted = dataclasses.asdict(config)
    if is_checkpoint_path(config.pretrained) and Path(config.pretrained).is_file():  # its content, not only its path
        wanted[WEIGHTS_KEY] = file_digest(config.pretrained)
    state = None
    if ckpt_path.is_file() and not overwrite:
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if state["config"] != wanted:
            changed = sorted(k for k in wanted if state["config"].get(k) != wanted[k])
            raise TrainError(f"{out}: holds a DnA training run with other settings ({', '.join(changed)}); use another --out, or --overwrite to start over")
    check_resolution(config, config_patch_size(config.model))  # before the model loads
    rank, world = init_from_env()
    if config.batch_size % world:
        raise TrainError(f"--batch-size {config.batch_size} is the global batch: it must be divisible by the {world} ranks")
    if state is not None and state["step"] >= config.steps and adapter_path.is_file():
        return TrainResult(adapter_path, state["step"], state["losses"], state["step"], _count(state["adapter"]), state.get("seconds_per_step"))
    items, names, name_to_class, num_classes, bench = _training_data(config)
    claim_run(out, wanted, overwrite)  # every rank: the same record, so whichever claims first, all agree
    dev = resolve_device(device)
    if dev.type == "cuda" and world > 1:
        import os

        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

    torch.manual_seed(config.seed)
    clip = load_clip(config.model, pretrained=config.pretrained, device=dev)
    check_resolution(config, clip.patch_size)  # the built model's own patch (a config without one)
    text = embed_names(clip, names, config.templates, use_cache=clip.pretrained != "none").clone()  # out of inference mode
    modules = convert_to_dna(clip, config.blocks, config.eps, negative=config.negative, sign=config.sign, shared_values=config.shared_values)
    params = [p for m in modules.values() for p in m.negative_parameters().values()]
    scale = config.logit_scale if config.logit_scale is not None else clip.logit_scale
    objective = Objective(clip, text, name_to_class, num_classes, config.objective == "dense", scale)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    autocast, amp_dtype = _autocast(config, dev)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    step, losses, start = 0, [], 0
    if state is not None:
        _load_adapter_tensors(modules, state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"])
        step = start = state["step"]
        losses = list(state["losses"])
    model = objective
    if world > 1:
        model = nn.parallel.DistributedDataParallel(objective, device_ids=[dev.index] if dev.type == "cuda" else None)

    dataset = TrainingSet(items, config.resolution, clip.mean, clip.std, config.seed, bench, clip.patch_size)
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    sampler = StepBatches(len(items), config.batch_size, end, config.seed, start, rank, world)
    # its own generator: the global RNG state must not depend on how many times the run was resumed
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, generator=torch.Generator().manual_seed(config.seed))
    trainable = sum(p.numel() for p in params)

    def save() -> None:
        if rank != 0:
            return
        tensors = {f"blocks.{i}.{n}": p.detach().cpu().clone() for i, m in modules.items() for n, p in m.negative_parameters().items()}
        blob = {"config": wanted, "step": step, "adapter": tensors, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": _rng_state(),
                "losses": losses, "seconds_per_step": seconds_per_step}
        with atomic_path(ckpt_path) as tmp:
            torch.save(blob, tmp)

    seconds_per_step = state.get("seconds_per_step") if state else None
    started = time.perf_counter()
    bar = _bar(progress and rank == 0, config.steps, start)
    stop = _StopBetweenSteps()
    with bar, stop:
        for pixels, targets in loader:
            with autocast:
                ce, count = model(pixels.to(dev), targets.to(dev))
            total = _sum_over_ranks(count.detach().float(), world).clamp(min=1)
            loss = ce * world / total  # DDP averages over ranks: the global mean over labelled targets
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            losses.append(float(_sum_over_ranks(ce.detach().float(), world) / total))
            seconds_per_step = (time.perf_counter() - started) / (step - start)
            bar.advance(losses[-1])
            stopping = stop.requested(world, dev)
            if step % save_every == 0 or step == end or stopping:
                save()
            if stopping:
                break
    if stop.signum is not None:  # the checkpoint of the last whole step is saved: now stop as the signal asks
        if rank == 0:
            from ..runtime.progress import err_console

            err_console.print(f"dna train: stopped by signal {stop.signum} after step {step} of {config.steps}; checkpoint {ckpt_path} saved", highlight=False, soft_wrap=True)
        stop.deliver()
    if start == end:  # nothing left to run in this call (stop_after reached before)
        save()
    if rank == 0 and step >= config.steps:
        save_adapter(clip, adapter_path, training={**wanted, "steps_done": step})
        record = {"config": wanted, "steps_done": step, "losses": losses, "trainable_parameters": trainable,
                  "blocks": list(modules), "seconds_per_step": seconds_per_step, "world_size": world, "device": str(dev)}
        with atomic_path(log_path) as tmp:
            tmp.write_text(json.dumps(record, indent=1))
    return TrainResult(adapter_path, step, losses, start, trainable, seconds_per_step)


class _StopBetweenSteps:
    """Ctrl-C or SIGTERM during the steps (Slurm's time limit, docker stop) ends the step under way, then the
    loop saves a checkpoint and `deliver` stops the run as the signal would have: nothing trained is lost,
    even before the first `save_every` checkpoint. A second signal stops at once. Main thread only (signal
    handlers cannot be set elsewhere); under torchrun the ranks agree to stop after the same step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "_StopBetweenSteps":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # an ignored signal stays ignored (nohup, `cmd &`)
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _note(self, signum: int, frame) -> None:
        if self.signum is not None:  # asked twice: do not wait for the step
            self.deliver(signum)
        self.signum = signum

    def _restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def requested(self, world: int, device: torch.device) -> bool:
        """Whether any rank was asked to stop (one small all-reduce per step under torchrun)."""
        flag = torch.tensor(float(self.signum is not None), device=device)
        return bool(_sum_over_ranks(flag, world) > 0)

    def deliver(self, signum: int | None = None) -> None:
        """Put the handlers back and raise the signal again, for them (the CLI's: exit 130 / 143)."""
        import signal

        self._restore()
        signal.raise_signal(signum or self.signum or signal.SIGTERM)


def _count(tensors: dict) -> int:
    return sum(t.numel() for t in tensors.values())


def _load_adapter_tensors(modules: dict, tensors: dict) -> None:
    with torch.no_grad():
        for i, m in modules.items():
            for n, p in m.negative_parameters().items():
                p.copy_(tensors[f"blocks.{i}.{n}"])


def _sum_over_ranks(value: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
    return value


class _bar:
    """A progress bar over steps with the running loss (stderr, rank 0), or nothing."""

    def __init__(self, show: bool, total: int, done: int) -> None:
        self.progress = None
        if show:
            from ..runtime.progress import progress_bar

            self.progress = progress_bar("steps")
            self.task = self.progress.add_task("dna train", total=total, completed=done)

    def __enter__(self) -> "_bar":
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.__exit__(*exc)

    def advance(self, loss: float) -> None:
        if self.progress:
            self.progress.update(self.task, advance=1, description=f"dna train  loss {loss:.4f}")

