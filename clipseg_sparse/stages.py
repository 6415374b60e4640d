"""Stages outside the attention spec, registered by name, and what a tap, a spec or a stage needs to run.

A stage is written as `NAME` or `NAME:ARGS` (e.g. `pamr`, `pamr:10:8,16`); its canonical text form is
what result files record (`config["stages"]`), so a run says which stages made its numbers. Each kind is one
call, written as a `typing.Protocol` below (`CALLS`), and runs at one point of the Segmenter's fixed chain,
in the order of `KINDS`:

- token: `TokenCall`, once per batch of windows on the hidden states entering the edited block(s).
- text: `TextCall`, once on the N_names x D text embeddings.
- match: `MatchCall`, per batch of windows on their cosine maps (CLIP Surgery's feature surgery).
- windows: `WindowsCall`, once per image on all windows' patch cosines (LPOSS's joint patch graph).
- global: `GlobalCall`, once per image on the windows' tokens spliced onto the image grid (Trident's SAM).
- retrieval: `RetrievalCall`, once per image at the network input's size (CorrCLIPv2's image bank).
- input: `InputCall`, once per image at the network input's size on its RGB image (LPOSS+'s pixel graph);
  the result is resized bilinearly to the original size.
- post: `PostCall`, once per image on the whole N_names x H x W cosine at the original size (PAMR, PEARL's
  TLP); post stages are not row-tiled, so they cost about (N_names + 20) x H x W floats of memory.
- labels: `LabelsCall`, on the H x W labels after the background rules (CorrCLIP's map correction).
- refine: `RefineCall`, on the labels with the class probabilities (Trident's SAM prompt refinement).

Stages that need more than tensors read the image's `ImageRun` (the original image, the network input, the
text and the vocabulary it embeds, the spec's normalizer, the image's region map, the backbones, the image bank). A stage declares what it
needs (`Stage.needs`): the external backbones it runs (`backbones`, loaded before any image and recorded in
results), a `load` hook for what it loads itself (SAM's predictor), the forward it must run in (`forward`:
the global stage runs only in the forward that splices the windows); labels and retrieval stages read region
maps, retrieval stages the image bank. A spec names the stages its method needs with `hook:` (token, match,
windows, global, retrieval, input and post kinds); the settings' stages (`InferenceSettings.stages`) replace
a spec's stage of the same name (a protocol's per-dataset constants) and add text, labels and refine stages.

PAMR (Araslanov & Roth, CVPR 2020, `visinf/1-stage-wseg`) is the first post stage, with the arithmetic of
`sinahmr/NACLIP@0cac3a6:pamr.py` (= `wangf3014/SCLIP:pamr.py`), quirks included (see `pamr`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UserValueError
from .registry import ENTRY_POINT_GROUP, Registry, caller_module
from .runtime import native

KINDS = ("token", "text", "match", "windows", "global", "retrieval", "input", "post", "labels", "refine")


# --- what a tap, a spec or a stage needs -----------------------------------------------------------------
def _union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a + b))


@dataclass(frozen=True)
class Needs:
    """What running a score tap, a spec or a stage takes besides CLIP and the pixels, in one value that
    unions (`a | b`): external backbones it runs per window (`ext:NAME`, a stage's), backbones whose
    whole-image features it reads (`ext:NAME.image`), and, as the text of what asks for them (for error
    messages; None: nothing does), region maps, an image bank and a forward other than the plain windows;
    `models`: other models it loads itself, by name (CLIPer's Stable Diffusion), for what `ls presets` says a
    preset needs."""

    backbones: tuple[str, ...] = ()
    image_features: tuple[str, ...] = ()
    regions: str | None = None
    bank: str | None = None
    forward: tuple[tuple[str, str], ...] = ()  # (forward name, what asks for it)
    models: tuple[str, ...] = ()

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(
            _union(self.backbones, other.backbones),
            _union(self.image_features, other.image_features),
            self.regions or other.regions,
            self.bank or other.bank,
            tuple(dict.fromkeys(self.forward + other.forward)),
            _union(self.models, other.models),
        )


# --- each kind's call ----------------------------------------------------------------------------------------
class ImageRun(Protocol):
    """What a stage may read of the image being segmented (`segment.run.ImageRun` implements it)."""

    image: np.ndarray  # the original H x W x 3 uint8 RGB image
    pixels: torch.Tensor  # the 1 x 3 x H' x W' CLIP-normalised network input
    text: torch.Tensor  # N_names x D L2-normalised text embeddings
    regions: torch.Tensor | None  # H' x W' region ids at the network input's size (-1 unsegmented)
    vocabulary: Any  # segment.vocabulary.Vocabulary: the names `text` embeds (flat_names), their classes (name_to_class)
    kept: dict[str, Any]  # what a stage leaves a later stage of this image, under a key of its own

    @property
    def clip(self) -> Any: ...  # the DenseCLIP (its `mean` / `std` normalise the pixels)

    @property
    def patch(self) -> int: ...  # CLIP's patch size

    @property
    def normalizer(self) -> str: ...  # the spec's normalizer

    @property
    def backbones(self) -> Any: ...  # the run's external backbones (`models.proxies.ProxyBackbones`)

    def backbone(self, name: str) -> Any: ...  # one of them, loaded on CLIP's device (`models.backbones.Backbone`)

    def retrieve(self, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # (R x N_names bank support logits per region, H' x W' region index)


class TokenCall(Protocol):
    """x = B x (1 + h*w) x C hidden states entering the edited block(s), CLS first; grid = (h, w). Per-window
    statistics are the stage's job. A stage with `taps=True` also gets `taps`: block index -> the hidden states
    the spec's score terms read (SC-CLIP's mid map), to edit at the same token positions (in place in the dict).
    A stage with `maps` gets `taps` and `maps`: each block it names -> CLIP's own B x H x N x N attention there
    (SFP's outlier finder reads the block before the edited one)."""

    def __call__(
        self, x: torch.Tensor, grid: tuple[int, int], taps: dict[int, torch.Tensor] = ..., maps: dict[int, torch.Tensor] = ..., /
    ) -> torch.Tensor: ...


class TextCall(Protocol):
    """text = N_names x D L2-normalised text embeddings."""

    def __call__(self, text: torch.Tensor, /) -> torch.Tensor: ...


class MatchCall(Protocol):
    """cosine = B x N_names x h x w (patch features against the text), cls = B x D the windows' L2-normalised
    CLS embeddings, text = N_names x D. Not in a forward that splices or stitches the windows."""

    def __call__(self, cosine: torch.Tensor, cls: torch.Tensor, text: torch.Tensor, /) -> torch.Tensor: ...


class WindowsCall(Protocol):
    """cosine = B x h x w x N_names raw patch cosines of all B windows (row-major over the window grid, as
    `window_boxes` lists them), boxes = their (y1, y2, x1, x2) on the network input (`run.pixels`); patch (i, j)
    of a window is centred at (y1 + patch // 2 + i * patch, x1 + patch // 2 + j * patch), patch = `run.patch`.
    Runs before the windows' maps are upsampled and averaged; only in the plain windows forward."""

    def __call__(self, cosine: torch.Tensor, boxes: Sequence[tuple[int, int, int, int]], run: ImageRun, /) -> torch.Tensor: ...


class GlobalCall(Protocol):
    """tokens = 1 x h x w x C last-block patch tokens before ln_post, every window's placed on the resized
    image's patch grid (overlaps averaged). Returns 1 x h' x w' x C tokens on a grid covering the whole image
    (ln_post, proj and the cosine follow; that map is resized bilinearly to the original size)."""

    def __call__(self, tokens: torch.Tensor, run: ImageRun, /) -> torch.Tensor: ...


class RetrievalCall(Protocol):
    """cosine = N_names x h x w raw cosine at the network input's size, after the forward; `run.retrieve(k)`
    gives the bank's support logits per region and each pixel's region index there (paint by gather),
    `run.regions` the region ids there."""

    def __call__(self, cosine: torch.Tensor, run: ImageRun, /) -> torch.Tensor: ...


class InputCall(Protocol):
    """cosine = N_names x h x w at the network input's size, rgb = that input as RGB in [0, 1] (3 x h x w)."""

    def __call__(self, cosine: torch.Tensor, rgb: torch.Tensor, run: ImageRun, /) -> torch.Tensor: ...


class PostCall(Protocol):
    """cosine = N_names x H x W raw cosine at the original image size (before the logit scale, the softmax and
    the max over synonyms); guide = 3 x H x W, the CLIP-normalised network input resized bilinearly back to the
    original size (published PAMR's guide); `run.text` the text embeddings (PEARL's TLP)."""

    def __call__(self, cosine: torch.Tensor, guide: torch.Tensor, run: ImageRun, /) -> torch.Tensor: ...


class LabelsCall(Protocol):
    """labels = H x W int64 class labels at the original size (after the background rules), regions = the
    image's H x W region ids (-1 unsegmented) from the region source. The saved probabilities are the ones
    before this stage (as CorrCLIP's seg_logit)."""

    def __call__(self, labels: torch.Tensor, regions: torch.Tensor, /) -> torch.Tensor: ...


class RefineCall(Protocol):
    """labels = H x W int64 labels (after the background rules, before labels stages), maps = the image's
    `segment.labels.ClassMaps` (C x H x W probabilities, a band of rows at a time). The saved probabilities
    are the ones before this stage."""

    def __call__(self, labels: torch.Tensor, maps: Any, run: ImageRun, /) -> torch.Tensor: ...


CALLS: Mapping[str, type] = {
    "token": TokenCall, "text": TextCall, "match": MatchCall, "windows": WindowsCall, "global": GlobalCall,
    "retrieval": RetrievalCall, "input": InputCall, "post": PostCall, "labels": LabelsCall, "refine": RefineCall,
}  # fmt: skip


@dataclass(frozen=True)
class Stage:
    """One configured stage: its kind, canonical text form and function (its call: `CALLS[kind]`).

    taps: token stages only: also edits the hidden states the spec reads. maps: token stages only: the blocks
    whose CLIP attention maps the stage reads, 1-based, or counted back from the first edited block (-1: the
    block before it). backbones: external backbones the stage runs (`ls backbones`; loaded before any image,
    recorded in results). forward: the registered forward it runs in (None: any that runs its kind). load:
    `load(backbones, device)` loads, before any image, what the stage loads itself (so missing weights fail
    first), given the run's `models.proxies.ProxyBackbones`."""

    kind: str
    name: str
    fn: Callable[..., torch.Tensor]
    taps: bool = False
    maps: tuple[int, ...] = ()
    backbones: tuple[str, ...] = ()
    forward: str | None = None
    load: Callable[[Any, Any], None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"stage kind must be one of {', '.join(KINDS)} (got {self.kind!r})")

    def __call__(self, *args) -> torch.Tensor:
        return self.fn(*args)

    @property
    def needs(self) -> Needs:
        what = f"stage {self.name}"
        return Needs(
            backbones=self.backbones,
            regions=what if self.kind in ("labels", "retrieval") else None,
            bank=what if self.kind == "retrieval" else None,
            forward=((self.forward, what),) if self.forward else (),
        )

    @property
    def family(self) -> str:
        """The name before the first ':' (a settings' stage replaces a spec's stage of the same family)."""
        return self.name.partition(":")[0]


# name -> factory: the text after "NAME:" (empty when absent) -> Stage; UserValueError for bad arguments.
# The published methods' stages register in their rooms (`clipseg_sparse.methods`); PAMR is here, below the
# engine, because ResCLIP's first pass (attention/feedback.py) runs it inside the attention.
STAGES: Registry[Callable[[str], Stage]] = Registry(
    "stage", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP, help_column="kind and meaning"
)


def parse_stage(text: str) -> Stage:
    """`NAME[:ARGS]` -> the configured Stage (UnknownNameError / UserValueError name the problem)."""
    name, _, args = text.strip().partition(":")
    return STAGES.get(name)(args)


#: stage kinds a spec may name with `hook:` (the others belong to the settings: text, labels, refine)
HOOK_KINDS = ("token", "match", "windows", "global", "retrieval", "input", "post")


def check_hook(text: str) -> str:
    """The canonical text of a stage a spec's `hook:` may name (HOOK_KINDS); UserValueError naming them."""
    try:
        stage = parse_stage(text)
    except UserValueError as e:
        raise UserValueError(f"{e}" if text.partition(":")[0] in STAGES else f"unknown hook {text!r}; hooks: {_hook_stages()}") from None
    if stage.kind not in HOOK_KINDS:
        raise UserValueError(f"hook {text!r} is a {stage.kind} stage; hooks: {_hook_stages()} (text, labels and refine stages run with InferenceSettings.stages)")
    return stage.name


def _hook_stages() -> str:
    return ", ".join(n for n in STAGES.names() if STAGES.help(n).startswith(HOOK_KINDS))


def resolve_stages(texts: Sequence[str]) -> tuple[Stage, ...]:
    """Parse each stage text; a stage given twice is an error (it would run twice)."""
    stages = tuple(parse_stage(t) for t in texts)
    names = [s.name for s in stages]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserValueError(f"stage(s) given more than once: {', '.join(repeated)}")
    return stages


def merged_stages(spec_stages: Sequence[Stage], given: Sequence[Stage]) -> tuple[Stage, ...]:
    """The stages a run runs, in order: a spec's (`hook:`), except those a given stage of the same kind and
    family replaces (a protocol's per-dataset constants), then the given ones."""
    named = {(s.kind, s.family) for s in given}
    return tuple(s for s in spec_stages if (s.kind, s.family) not in named) + tuple(given)


# --- PAMR -------------------------------------------------------------------------------------------

PAMR_ITERATIONS = 10
PAMR_DILATIONS = (8, 16)
PAMR_BAND = 8  # classes per band (two band buffers of 480 x 640: 20 MB)
# the 8 neighbours of a 3 x 3 grid (centre excluded), row-major, as the published shift kernels
_RING = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


def _shifted(x: torch.Tensor, dilations: Sequence[int], centre: bool = False) -> list[torch.Tensor]:
    """Views of x (C x H x W) shifted to each neighbour of each dilation, replicate padding (clamped
    indices): element [c, y, x] of the view for offset (dy, dx), dilation d is x[c, y + dy*d, x + dx*d]
    with the indices clamped into the image. Dilation-major, row-major within a dilation; with
    `centre` the 3 x 3 grid includes the centre (9 views per dilation, else 8)."""
    pad = max(dilations)
    H, W = x.shape[-2:]
    padded = F.pad(x[None], [pad] * 4, mode="replicate")[0]
    grid = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)] if centre else _RING
    return [padded[:, pad + dy * d : pad + dy * d + H, pad + dx * d : pad + dx * d + W] for d in dilations for dy, dx in grid]


def pamr_affinity(guide: torch.Tensor, dilations: Sequence[int] = PAMR_DILATIONS) -> torch.Tensor:
    """P x H x W neighbour weights (P = 8 per dilation, softmax over P) from a 3 x H x W guide image.

    a(p, n) = mean over channels c of -|I_c(p) - I_c(n)| / (1e-8 + 0.1 * sigma_c(p)), with sigma_c(p) the
    unbiased std of the 9 x len(dilations) samples of the 3 x 3 grids *including* the centre (so the
    centre counts once per dilation), as the published LocalStDev. The std is accumulated in two passes
    (mean, then squared deviations) rather than over a stacked tensor, to keep memory at a few images.
    """
    guide = guide.float()
    samples = _shifted(guide, dilations, centre=True)
    mean = sum(samples) / len(samples)
    var = sum((s - mean).square() for s in samples) / (len(samples) - 1)
    scale = 1e-8 + 0.1 * var.sqrt()  # 3 x H x W
    logits = torch.stack([(-(guide - n).abs() / scale).mean(0) for n in _shifted(guide, dilations)])
    return torch.softmax(logits, dim=0)


def _clamped_spans(n: int, shift: int) -> list[tuple[slice, slice]]:
    """(target, source) slice pairs along an axis of length n that together read source index
    clamp(t + shift, 0, n - 1) at every target t: the unclamped run, then the ends that read the first or
    last index (a slice of length 1, broadcast)."""
    low = min(max(-shift, 0), n)  # targets [0, low) read index 0
    high = max(min(n - shift, n), low)  # targets [high, n) read index n - 1
    spans = [(slice(low, high), slice(low + shift, high + shift))] if high > low else []
    if low:
        spans.append((slice(0, low), slice(0, 1)))
    if high < n:
        spans.append((slice(high, n), slice(n - 1, n)))
    return spans


def pamr(
    cosine: torch.Tensor, guide: torch.Tensor, iterations: int = PAMR_ITERATIONS, dilations: Sequence[int] = PAMR_DILATIONS,
    band: int = PAMR_BAND,
) -> torch.Tensor:
    """Pixel-adaptive mask refinement: `iterations` times, every pixel's N_names values become the
    affinity-weighted sum of its neighbours' values (the pixel itself excluded), replicate padding.

    cosine: N x H x W raw cosine; guide: 3 x H x W normalised image (same H x W). Returns N x H x W fp32.
    Copied from the published code: the centre is not a neighbour but is in the std; the std is
    unbiased; affinities are averaged over colour channels before the softmax; the guide is the resized
    network input brought back to the original size, not the original image (the caller's job).
    Not copied: NACLIP skips PAMR silently when it runs out of GPU memory, and on GPU in fp16 casts the
    refined logits to fp16; here PAMR always runs, in fp32.

    Classes are independent, so all iterations run on `band` classes at a time in two band buffers (no
    padded copy of the map, no new map per iteration), each neighbour multiplied in from shifted slices of
    the band (clamped ends broadcast from the edge row or column): the same products and sums, in the same
    order, as adding the 16 shifted views of the whole padded map to zeros.
    """
    if cosine.shape[-2:] != guide.shape[-2:]:
        raise ValueError(f"pamr: cosine {tuple(cosine.shape[-2:])} and guide {tuple(guide.shape[-2:])} differ in size")
    weights = pamr_affinity(guide.to(cosine.device), dilations)
    N, H, W = cosine.shape
    offsets = [(dy * d, dx * d) for d in dilations for dy, dx in _RING]
    library = native.kernel("pamr") if cosine.device.type == "cpu" else None
    if library is not None:
        return _pamr_native(library, cosine, weights, offsets, iterations, band)
    shifts = [(w, _clamped_spans(H, oy), _clamped_spans(W, ox)) for w, (oy, ox) in zip(weights, offsets)]
    out = torch.empty(N, H, W, dtype=torch.float32, device=cosine.device)
    buffers = [torch.empty(min(band, N), H, W, dtype=torch.float32, device=cosine.device) for _ in range(2)]
    for start in range(0, N, band):
        src = cosine[start : start + band].float().contiguous()  # the map may be H x W x N memory (the windows forward's)
        for step in range(iterations):
            dst = out[start : start + band] if step == iterations - 1 else buffers[step % 2][: len(src)]
            for k, (w, rows, cols) in enumerate(shifts):
                for ty, sy in rows:
                    for tx, sx in cols:
                        if k:
                            dst[:, ty, tx].addcmul_(src[:, sy, sx], w[ty, tx])
                        else:  # 0 + 1 * s * w, exactly
                            torch.mul(src[:, sy, sx], w[ty, tx], out=dst[:, ty, tx])
            src = dst
    return out


def _pamr_native(
    library, cosine: torch.Tensor, weights: torch.Tensor, offsets: Sequence[tuple[int, int]], iterations: int, band: int
) -> torch.Tensor:
    """`pamr`'s loop in C (`runtime/native/pamr.c`: each image row's neighbours summed in cache, in the torch
    path's order), bands of classes spread over torch's threads (`native.over_threads`)."""
    N, H, W = cosine.shape
    pad = max(max(abs(oy), abs(ox)) for oy, ox in offsets)
    weights = weights.float().contiguous()
    out = torch.empty(N, H, W, dtype=torch.float32)
    oy, ox = ((ctypes.c_int * len(offsets))(*(o[i] for o in offsets)) for i in (0, 1))
    starts = list(range(0, N, band))

    def work(lo: int, hi: int) -> None:  # bands starts[lo:hi], in two band buffers of its own
        a, b = (torch.empty(min(band, N), H + 2 * pad, W + 2 * pad) for _ in range(2))
        for start in starts[lo:hi]:
            n = min(band, N - start)
            a[:n, pad : pad + H, pad : pad + W] = cosine[start : start + n]
            library.pamr_band(
                *(native.float_pointer(t) for t in (a, b, weights, out[start : start + n])), n, H, W, pad, len(offsets), oy, ox, iterations
            )

    native.over_threads(work, len(starts))
    return out


def _pamr_stage(args: str) -> Stage:
    """`pamr[:ITERATIONS[:D1,D2,...]]`, default pamr:10:8,16 (NACLIP's)."""
    usage = "expected pamr[:ITERATIONS[:D1,D2,...]] with positive integers, e.g. pamr:10:8,16"
    parts = args.split(":") if args else []
    if len(parts) > 2:
        raise UserValueError(f"bad stage 'pamr:{args}': {usage}")
    try:
        iterations = int(parts[0]) if parts else PAMR_ITERATIONS
        dilations = tuple(int(d) for d in parts[1].split(",")) if len(parts) > 1 else PAMR_DILATIONS
    except ValueError:
        raise UserValueError(f"bad stage 'pamr:{args}': {usage}") from None
    if iterations < 1 or not dilations or min(dilations) < 1:
        raise UserValueError(f"bad stage 'pamr:{args}': {usage}")
    name = f"pamr:{iterations}:{','.join(map(str, dilations))}"
    return Stage("post", name, lambda cosine, guide, run: pamr(cosine, guide, iterations, dilations))


STAGES.register(
    "pamr",
    _pamr_stage,
    help="post: PAMR refinement of the raw cosine at the original size (default 10 iterations, dilations 8,16; NACLIP's)",
)


def register_plain_stage(name: str, kind: str, fn: Callable[..., torch.Tensor], help: str, module: str | None = None) -> None:
    """Register a stage that takes no arguments (`NAME` only)."""

    def factory(args: str) -> Stage:
        if args:
            raise UserValueError(f"bad stage '{name}:{args}': {name} takes no arguments")
        return Stage(kind, name, fn)

    STAGES.register(name, factory, help=help, module=module or caller_module())
