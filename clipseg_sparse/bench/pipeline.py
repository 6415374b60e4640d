"""`bench --suites pipeline`: where one image's run of a preset spends its time and memory.

For a preset run with its protocol's settings (ADE20K's where they differ per dataset), a class count and an
image size, one image goes through what `segment` runs (`Segmenter.predict`, then `write_outputs`) while the
library's calls are timed as named parts: each network's forward (CLIP's, each external backbone's, SAM's
predictor), each stage, the forward's own work around them (windows, upsampling, averaging), the label map, the
image run's set-up and writing the outputs. Nested parts are subtracted from the part around them (`own`), so
the parts add up to the run. The networks' forwards are the network parts' own times; the table's last line is
the whole run over them. Memory: per part the most its calls allocated above the resident set at their start
(Linux VmHWM, reset at each part's start; nothing elsewhere).

Random weights (`pretrained=None`, backbones' `none`) on the real architectures; a preset that reads region
masks gets a fixed blocky map of 30 regions (no mask generator runs), one that reads an image bank a synthetic
bank of 1000 regions (flat index). The parts are found by wrapping library callables for the duration of the
run (`PartTimer.wrapped`), so nothing in the pipeline knows it is measured.

The SAM 3 pipelines (`sam3`, `activesam`: `segment/pipelines.py`, not Segmenter presets) run as `eval` runs them:
the pipeline its protocol names for ADE20K, built on `Pipeline.load` (random weights of the released
configuration unless `model` gives SAM 3 weights), the first `classes` classes of the protocol's ADE20K names,
`predict_labels` on the image file, then the label PNG `eval --save-pred` writes. Their networks are Sam3Model's
vision and text encoders, the detector (`run_prompts`: geometry and fusion encoders, DETR decoder, scoring) and
the mask decoder; the processor's resize, the answers' resize to the image, the fusion, the buckets, ActiveSAM's
preview glue and the label map are other parts. With random weights few instances pass the confidence, so the
per-instance work (masks resized to the image) is nearly absent.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

NETWORK, STAGE, OTHER = "network", "stage", "other"
#: the families issue 33 asks for: name -> (preset, protocol)
FAMILIES = {
    "sclip": ("sclip", "sclip"),
    "naclip+pamr": ("naclip", "naclip"),
    "proxyclip": ("proxyclip", "proxyclip"),
    "trident": ("trident", "trident"),
    "trident+samrefine": ("trident", "trident-samrefine"),
    "corrclip": ("corrclip", "corrclip"),
    "ovstitcher": ("ovstitcher", "ovstitcher"),
    "corrclipv2+bank": ("corrclipv2", "corrclipv2"),
    "lposs": ("lposs", "lposs"),
    "lposs+": ("lposs+", "lposs+"),
    "pearl": ("pearl", "pearl"),
    "sam3": ("sam3", "sam3"),  # SAM 3 pipelines (module docstring)
    "activesam": ("activesam", "activesam"),
}


def _status_mib(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _malloc_trim() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set restarts from the current one


@dataclass
class Part:
    """One named part: its calls, seconds in them (inclusive), seconds less the parts inside them (own), and
    the most MiB its calls allocated above the resident set at their start, or at a nested part's start where
    that is lower (its trim returned free heap: so a part's peak includes its nested parts'; None: not
    measurable here)."""

    name: str
    kind: str
    calls: int = 0
    seconds: float = 0.0
    own: float = 0.0
    peak_mib: float | None = None


@dataclass
class _Open:
    part: Part
    start: float
    rss: float | None
    high: float | None  # the highest VmHWM seen while open
    inner: float = 0.0  # seconds of the parts inside


@dataclass
class PartTimer:
    """Times named parts; `part(name, kind)` is a context manager, `wrapped(owner, attr, label, kind)` times
    every call of `owner.attr` (a method: label(self) names the part) while its `with` block runs."""

    parts: dict[str, Part] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter  # time.process_time: CPU time, on a machine other jobs load
    trim: bool = False  # return freed heap to the system at each part's start, so its peak counts its own pages
    _open: list[_Open] = field(default_factory=list)

    def _observe(self) -> None:
        """Fold the peak since the last reset into every open part, then reset it."""
        high = _status_mib("VmHWM")
        for o in self._open:
            o.high = high if o.high is None or high is None else max(o.high, high)
        _reset_peak()

    @contextlib.contextmanager
    def part(self, name: str, kind: str) -> Iterator[None]:
        if self.trim:
            _malloc_trim()
        self._observe()
        rss = _status_mib("VmRSS")
        for o in self._open:  # the trim may have returned free heap pages: the parts around count from what is left
            if o.rss is not None and rss is not None:
                o.rss = min(o.rss, rss)
        entry = _Open(self.parts.setdefault(name, Part(name, kind)), self.clock(), rss, None)
        self._open.append(entry)
        try:
            yield
        finally:
            self._observe()
            self._open.pop()
            took = self.clock() - entry.start
            part = entry.part
            part.calls += 1
            part.seconds += took
            part.own += took - entry.inner
            if entry.high is not None and entry.rss is not None:
                part.peak_mib = max(part.peak_mib or 0.0, entry.high - entry.rss)
            if self._open:
                self._open[-1].inner += took

    @contextlib.contextmanager
    def wrapped(self, owner: Any, attr: str, label: Callable[[Any], str] | str, kind: str) -> Iterator[None]:
        original = getattr(owner, attr)
        timer = self

        def timed(*args, **kwargs):
            name = label if isinstance(label, str) else label(args[0])
            with timer.part(name, kind):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        try:
            yield
        finally:
            setattr(owner, attr, original)


@dataclass(frozen=True)
class PipelineReport:
    """One run's parts, whole seconds and the networks' seconds (network parts' own times)."""

    family: str
    preset: str
    protocol: str
    classes: int
    size: tuple[int, int]
    parts: tuple[Part, ...]
    whole: float
    networks: float
    model: str = "ViT-B-16"

    def as_dict(self) -> dict:
        return {
            "family": self.family, "preset": self.preset, "protocol": self.protocol, "classes": self.classes, "size": list(self.size),
            "whole": self.whole, "networks": self.networks, "model": self.model, "parts": [vars(p) for p in self.parts],
        }  # fmt: skip


class _GivenRegions:
    """A region source that gives every image the same map."""

    def __init__(self, regions: np.ndarray) -> None:
        self.regions = regions

    def __call__(self, rgb, name) -> np.ndarray:
        return self.regions

    def source(self) -> str:
        return "bench"


def blocky_regions(size: tuple[int, int], count: int = 30, cell: int = 32, seed: int = 0) -> np.ndarray:
    """H x W region ids: random ids in [-1, count) on cells of `cell` pixels (-1: unsegmented)."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(-1, count, (size[0] // cell + 1, size[1] // cell + 1))
    return np.kron(cells, np.ones((cell, cell), dtype=np.int64))[: size[0], : size[1]]


def synthetic_bank(folder: Path, clip, backbones, key_backbone: str, rows: int = 1000, seed: int = 0):
    """A bank folder for `clip` and the key backbone's random weights: random unit keys and values, flat index."""
    from ..runtime.fingerprint import file_stamp
    from ..segment import bank as banks

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    key_dim = int(backbones.get(key_backbone, clip.device).image_feature_map(torch.zeros(32, 32, 3, dtype=torch.uint8)).shape[1])
    value_dim = int(clip.visual.proj.shape[1])
    keys, values = (rng.standard_normal((rows, d)).astype(np.float32) for d in (key_dim, value_dim))
    np.save(folder / banks.KEYS, keys.astype(np.float16))
    np.save(folder / banks.values_file(0), (values / np.linalg.norm(values, axis=1, keepdims=True)).astype(np.float16))
    banks._faiss().write_index(banks.build_index(keys, "flat"), str(folder / banks.INDEX))
    record = backbones.config([key_backbone])[key_backbone]
    manifest = {"format": banks.BANK_FORMAT, "keys": {"backbone": key_backbone, **record}, "values": [{"clip": banks.clip_id(clip)}], "rows": rows,
                "files": {name: file_stamp(folder / name) for name in (banks.KEYS, banks.values_file(0), banks.INDEX)}}  # fmt: skip
    manifest["hash"] = banks.content_hash(manifest)  # what opening a bank checks
    (folder / banks.MANIFEST).write_text(json.dumps(manifest))
    return banks.ImageBank.open(folder)


@contextlib.contextmanager
def timed_library(timer: PartTimer) -> Iterator[None]:
    """Wrap the library callables that make the parts (see the module docstring)."""
    from ..files import outputs
    from ..methods import cliper, ovstitcher, rfclip
    from ..models.backbones import Backbone
    from ..models.clip import DenseCLIP
    from ..segment import images, segmenter
    from ..segment.labels import ClassMaps
    from ..segment.maps import CosineMap
    from ..segment.plan import FORWARDS, ImageRun
    from ..stages import Stage

    clip_label = lambda clip: f"CLIP {clip.model_name} forward"  # noqa: E731
    with contextlib.ExitStack() as stack:
        enter = lambda *a: stack.enter_context(timer.wrapped(*a))  # noqa: E731
        enter(DenseCLIP, "encode_dense", clip_label, NETWORK)
        enter(DenseCLIP, "dense_tokens", clip_label, NETWORK)
        enter(ovstitcher, "stitched_features", "CLIP stitched forward (image-wide attention included)", NETWORK)
        enter(rfclip, "refocused", "CLIP refocus forward (every block, both guided inputs)", NETWORK)
        enter(cliper, "fused_features", "CLIP fused forward (every block's input through the last)", NETWORK)
        enter(Backbone, "features", lambda b: f"{b.info.name} forward", NETWORK)
        enter(Backbone, "image_feature_map", lambda b: f"{b.info.name} whole-image forward", NETWORK)
        with contextlib.suppress(ImportError):
            from segment_anything import SamPredictor

            enter(SamPredictor, "set_image", "SAM encoder (samrefine)", NETWORK)
            enter(SamPredictor, "predict_torch", "SAM prompt decoder (samrefine)", NETWORK)
        enter(Stage, "__call__", lambda s: f"stage {s.name}", STAGE)
        for forward in {type(FORWARDS.get(name)) for name in FORWARDS.names()}:
            enter(forward, "cosine", "forward: windows, upsampling, averaging", OTHER)
        enter(ImageRun, "of", "image run: network input, whole-image maps", OTHER)
        enter(CosineMap, "rows", "cosine map rows at the output size (bilinear resize)", OTHER)
        enter(ClassMaps, "labels", "label map: resize, softmax, argmax, background rules", OTHER)
        enter(segmenter, "load_image", "load image", OTHER)
        enter(outputs, "write_outputs", "write outputs (label PNG, overlay, JSON)", OTHER)
        with contextlib.suppress(ImportError):  # transformers: the SAM 3 pipelines
            timed_sam3(enter)
        yield


def timed_sam3(enter: Callable[..., None]) -> None:
    """Wrap (through `enter(owner, attr, label, kind)`) what makes the parts of a SAM 3 pipeline's run."""
    from transformers.models.sam3.modeling_sam3 import Sam3MaskDecoder, Sam3Model

    from ..methods import activesam, sam3
    from ..models.sam3 import hf

    enter(Sam3Model, "get_vision_features", "SAM 3 vision encoder (get_vision_features)", NETWORK)
    enter(Sam3Model, "get_text_features", "SAM 3 text encoder (get_text_features)", NETWORK)
    enter(hf, "run_prompts", "SAM 3 detector (run_prompts: geometry and fusion encoders, DETR decoder, scoring)", NETWORK)
    enter(Sam3MaskDecoder, "forward", "SAM 3 mask decoder (mask_decoder)", NETWORK)
    enter(hf.TransformersPrompter, "set_image", "set_image: the processor's resize and normalisation", OTHER)
    enter(hf.TransformersPrompter, "tokens", "tokens: the tokenizer", OTHER)
    for module in (hf, activesam):  # each module calls the name it imported
        enter(module, "answers", "answers: instance and semantic logits resized to the image, sigmoid", OTHER)
    for module in (sam3, activesam):
        enter(module, "fuse_prompt", "fuse_prompt: instances, semantic map, presence", OTHER)
        enter(module, "load_image", "load image", OTHER)
    enter(activesam.ActiveSamSegmenter, "active", "active: the presence preview's buckets and decision", OTHER)
    for segmenter in (sam3.Sam3Segmenter, activesam.ActiveSamSegmenter):
        enter(segmenter, "scores", "scores: prompt buckets, max over a class's names", OTHER)
        enter(segmenter, "predict_labels", "label map: argmax, background rule", OTHER)


#: where the measured cost of every preset is kept (`benchmarks/pipeline.py --cost-file`): what `ls presets` shows
COST_FILE = Path(__file__).resolve().parent.parent / "data" / "preset_cost.json"


def preset_target(name: str) -> tuple[str, str]:
    """(preset, protocol) that `bench_pipeline` runs for `name`: a family of FAMILIES, or any attention preset
    with the protocol its paper publishes (the one of its own name first; a variant `NAME-...` without its own,
    NAME's), SCLIP's where no protocol runs it."""
    from ..attention import PRESETS
    from ..errors import UserValueError
    from ..evaluation.protocols import PROTOCOLS

    if name in FAMILIES:
        return FAMILIES[name]
    if name not in PRESETS.names():
        raise UserValueError(f"unknown pipeline family or preset {name!r}; families: {', '.join(FAMILIES)}; presets: `clipseg-sparse ls presets`")
    base = name.removesuffix("-entmax")
    while True:  # scclip-l14 runs with scclip's protocol where none is its own
        own = [p for p in PROTOCOLS.names() if PROTOCOLS.get(p).attention == base]
        if own or "-" not in base:
            return name, base if base in own else (own[0] if own else "sclip")
        base = base.rsplit("-", 1)[0]


def preset_costs() -> dict:
    """The measured costs (COST_FILE): {"presets": {name: {"whole": s, "networks": s, "model": ...}}, and how
    they were measured}; empty where nothing was measured."""
    return json.loads(COST_FILE.read_text(encoding="utf-8")) if COST_FILE.is_file() else {"presets": {}}


def relative_cost(name: str, costs: dict | None = None) -> float | None:
    """Preset `name`'s whole run over `sclip`'s, as measured (COST_FILE); None where either was not measured."""
    rows = (costs or preset_costs())["presets"]
    return rows[name]["whole"] / rows["sclip"]["whole"] if name in rows and "sclip" in rows else None


def bench_model(spec, protocol) -> str:
    """The CLIP a preset is timed on: ViT-B/16, else (a spec reading more blocks: `-l14` presets) the
    protocol's CLIP or ViT-L/14, whichever has the blocks."""
    import open_clip

    from ..attention.blocks import min_depth

    depth = min_depth(spec)
    return next(m for m in ("ViT-B-16", protocol.model, "ViT-L-14") if m and open_clip.get_model_config(m)["vision_cfg"]["layers"] >= depth)


def bench_pipeline(
    family: str, classes: int = 150, size: tuple[int, int] = (480, 640), model: str | None = None, device: str = "cpu",
    cpu_time: bool = False, memory: bool = True,
) -> PipelineReport:
    """One image of `size` through the preset and protocol of `family` (a FAMILIES name or a preset:
    `preset_target`) with `classes` classes, by part (module docstring): run twice, the first for memory (each
    part's freed heap returned before it: its peak counts the pages it touches), the second for time (the
    allocator warm, as a run over many images); `memory=False` runs the second alone (no peaks).
    model: None is ViT-B/16, or where the preset needs more blocks (`-l14` presets) the protocol's CLIP or ViT-L/14;
    for a SAM 3 pipeline its weights (`--proxy-weights sam3=W`; None: random, the released configuration).
    cpu_time: time by this process's CPU time (one thread: the work, whatever else loads the machine)."""
    from ..evaluation.protocols import PROTOCOLS
    from ..segment.pipelines import find_pipeline
    from .timing import keep_freed_memory, smooth_image

    preset, protocol_name = preset_target(family)
    protocol = PROTOCOLS.get(protocol_name)
    keep_freed_memory()
    torch.manual_seed(0)
    rgb = smooth_image(size)
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "image.png"
        from PIL import Image

        Image.fromarray(rgb).save(image)
        if find_pipeline(preset) is not None:
            model, run = _sam3_run(protocol, classes, model, device, image)
        else:
            model, run = _segmenter_run(preset, protocol, classes, size, model, device, image, rgb)
        clock = time.process_time if cpu_time else time.perf_counter
        runs = [PartTimer(trim=True)] * memory + [PartTimer(clock=clock)]  # memory (freed heap returned at each part), then time (warm)
        for i, timer in enumerate(runs):
            with timed_library(timer), timer.part("whole run", OTHER):
                run(timer, Path(tmp) / f"out{i}")
    timer, peaks = runs[-1], runs[0].parts if memory else {}
    whole = timer.parts.pop("whole run")
    networks = sum(p.own for p in timer.parts.values() if p.kind == NETWORK)
    for name, part in timer.parts.items():
        part.peak_mib = peaks[name].peak_mib if name in peaks else None
    parts = tuple(sorted(timer.parts.values(), key=lambda p: ({NETWORK: 0, STAGE: 1, OTHER: 2}[p.kind], -p.own)))
    rest = whole.seconds - sum(p.own for p in parts)
    parts += (Part("rest of predict (untimed glue)", OTHER, 1, rest, rest),)
    return PipelineReport(family, preset, protocol_name, classes, size, parts, whole.seconds, networks, model)


#: one timed run: (the timer, the output base) -> None
Run = Callable[[PartTimer, Path], None]


def _segmenter_run(preset: str, protocol, classes: int, size: tuple[int, int], model: str | None, device: str, image: Path,
                   rgb: np.ndarray) -> tuple[str, Run]:  # fmt: skip
    """(the CLIP's name, a run of what `segment` runs) for an attention preset: its Segmenter with random
    weights and the resources its plan needs, `predict`, then `write_outputs`."""
    from ..files import outputs
    from ..models.clip import load_clip
    from ..models.proxies import ProxyBackbones
    from ..segment.plan import Plan
    from ..segment.resources import Resources
    from ..segment.segmenter import Segmenter

    settings = protocol.settings("ade20k")
    spec = protocol.spec_for("ade20k", preset)
    model = model or bench_model(spec, protocol)
    clip = load_clip(model, pretrained=None, device=device)
    plan = Plan.of(spec, settings)
    backbones = ProxyBackbones.following(clip, "none")
    bank = synthetic_bank(image.parent / "bank", clip, backbones, plan.needs.image_features[0]) if plan.needs.bank else None
    regions = _GivenRegions(blocky_regions(size)) if plan.needs.regions else None
    resources = Resources(regions=regions, bank=bank, proxy_weights="none", backbones=backbones).bind(plan, clip, [])
    seg = Segmenter(clip, [f"class {i}" for i in range(classes)], spec=spec, settings=settings, templates="single", resources=resources)
    options = outputs.OutputOptions(overwrite=True)
    return model, lambda timer, out: outputs.write_outputs(out, image, rgb, seg.predict(image), options)


def _sam3_run(protocol, classes: int, weights: str | None, device: str, image: Path) -> tuple[str, Run]:
    """(the weights, a run of what `eval` runs) for a SAM 3 pipeline (module docstring): the first `classes`
    of the protocol's ADE20K classes (real names: ActiveSAM looks up their hypernyms)."""
    from ..datasets import class_vocabulary
    from ..datasets.labels import write_label_png
    from ..errors import UserValueError
    from ..segment.pipelines import find_pipeline
    from ..segment.vocabulary import Vocabulary

    every = class_vocabulary("ade20k", protocol.class_names)[0]
    if not 2 <= classes <= len(every):
        raise UserValueError(f"{protocol.name}: between 2 and {len(every)} classes (ADE20K's names); got {classes}")
    vocabulary = Vocabulary(every.names[:classes], every.labels[:classes])
    pipeline = find_pipeline(protocol.pipeline_text("ade20k"))
    weights = weights or "none"
    seg = pipeline.build(pipeline.load(weights, device, "fp32"), vocabulary, protocol.settings("ade20k"))

    def run(timer: PartTimer, out: Path) -> None:
        labels = seg.predict_labels(image)
        with timer.part("write outputs (label PNG)", OTHER):  # what `eval --save-pred` writes
            write_label_png(out.with_suffix(".png"), labels)

    return f"{pipeline.backbone}:{weights}", run


def rich_pipeline_table(report: PipelineReport):
    """A rich Table of one report: each part's calls, own seconds, share of the whole, peak MiB."""
    from rich.table import Table

    title = (f"{report.family} ({report.preset}, protocol {report.protocol}): {report.classes} classes, {report.size[0]}x{report.size[1]}, "
             f"whole {report.whole:.2f} s = {report.whole / max(report.networks, 1e-9):.2f} x the networks' {report.networks:.2f} s")  # fmt: skip
    table = Table("part", "kind", "calls", "own s", "share", "peak MiB", title=title)
    for p in report.parts:
        peak = f"{p.peak_mib:.0f}" if p.peak_mib is not None else "-"
        table.add_row(p.name, p.kind, str(p.calls), f"{p.own:.3f}", f"{p.own / report.whole:.1%}", peak)
    return table
