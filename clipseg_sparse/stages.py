"""Stages outside the attention spec: token hooks, text hooks and post stages, registered by name.

A stage is written as `NAME` or `NAME:ARGS` (e.g. `pamr`, `pamr:10:8,16`); its canonical text form is
what result files record (`config["stages"]`), so a run says which stages made its numbers. Kinds, and
the call each kind's function receives:

- token: `fn(x, grid) -> x`, x = B x (1 + h*w) x C hidden states entering the edited block(s), CLS first;
  grid = (h, w). Runs once per batch of windows (per-window statistics are the hook's job). A stage
  with `taps=True` is called `fn(x, grid, taps)`: `taps` maps block indices to the hidden states that
  the spec's score terms read (e.g. SC-CLIP's mid map), to be edited at the same token positions (the
  stage replaces the dict's values). A spec names the token stages its method needs (`hook:lof`).
- text:  `fn(text) -> text`, text = N_names x D L2-normalised text embeddings.
- match: `fn(cosine, cls, text) -> cosine` per batch of windows: cosine = B x N_names x h x w (patch
  features against the text), cls = B x D the windows' L2-normalised CLS embeddings, text = N_names x D.
  Named by a spec (`hook:surgery`, CLIP Surgery's feature surgery).
- windows: `fn(cosine, boxes, pixels, patch) -> cosine` once per image, before the windows' maps are
  upsampled and averaged: cosine = B x h x w x N_names raw patch cosines of all B windows (row-major over
  the window grid, as `window_boxes` lists them), boxes = their (y1, y2, x1, x2) on the network input,
  pixels = that 1 x 3 x H x W CLIP-normalised input, patch = CLIP's patch size (patch (i, j) of a window
  is centred at (y1 + patch // 2 + i * patch, x1 + patch // 2 + j * patch)); e.g. LPOSS's joint patch-graph
  propagation `lp:patch`. Not with a global stage (no per-window maps there). A spec may name one
  (`hook:lp:patch`); one given in the settings replaces the spec's of the same name.
- post:  `fn(cosine, guide) -> cosine`, cosine = N_names x H x W raw cosine at the original image size
  (before the logit scale, the softmax and the max over synonyms); guide = 3 x H x W, the CLIP-normalised
  network input resized bilinearly back to the original size. Post stages see the whole image at once
  (they are not row-tiled), so they cost about (N_names + 20) x H x W floats of memory. A post stage with
  `text=True` is called `fn(cosine, guide, text)`, text = the N_names x D text embeddings (PEARL's TLP);
  one with `at_input=True` runs first, at the network input's size: cosine = N_names x h x w there, guide
  = the network input as RGB in [0, 1] (3 x h x w), and its result is resized bilinearly to the original
  size (LPOSS+'s pixel graph). A spec may name post stages (`hook:tlp`); they run before the settings'.
- retrieval: `fn(cosine, regions, retrieve) -> cosine` once per image at the network input's size, after the
  windows' maps are averaged and before the at-input post stages: cosine = N_names x h x w raw cosine there,
  regions = the h x w region ids there (nearest; -1 unsegmented), retrieve(k) = the N_names x h x w support
  logits of the Segmenter's image bank (`segment/bank.py`: per region, the stored CLIP embeddings of its k
  nearest bank regions by the bank's key-backbone features, cosine with the text). The result is resized
  bilinearly to the original size. Needs a bank (`Segmenter(bank=...)`, `--bank`) and region maps; e.g.
  CorrCLIPv2's `retrieve`. A spec may name it (`hook:retrieve`).
- global: `fn(tokens, image, normalizer) -> tokens` once per image, with splicing: tokens = 1 x h x w x C
  last-block patch tokens before ln_post, every window's placed on the resized image's patch grid
  (overlaps averaged); image = the original H x W x 3 uint8 RGB image; normalizer = the spec's. Returns
  1 x h' x w' x C tokens on a grid covering the whole image (ln_post, proj and the cosine follow; that
  map is resized bilinearly to the original size). A spec names the one its method needs (`hook:sam`,
  Trident); one given in the settings (a protocol's per-dataset constants) replaces the spec's of the
  same name. `backbones`: the external backbones it runs (loaded before any image, recorded in results).
- labels: `fn(labels, regions) -> labels`, labels = H x W int64 class labels at the original size (after
  the background rules), regions = the image's H x W region ids (-1 unsegmented) from the region source
  (`Segmenter(regions=...)`); e.g. `regionvote`, CorrCLIP's map correction. The saved probabilities are
  the ones before this stage (as CorrCLIP's seg_logit).
- refine: `fn(labels, maps, image) -> labels`, labels = H x W int64 class labels at the original size
  (after the background rules, before labels stages), maps = the image's `segment.labels.ClassMaps` (C x H x W
  probabilities, read a band of rows at a time), image = the original H x W x 3 uint8 RGB image; e.g.
  `samrefine`, Trident's SAM prompt refinement. The saved probabilities are the ones before this stage.

PAMR (Araslanov & Roth, CVPR 2020, `visinf/1-stage-wseg`) is the first post stage, with the arithmetic of
`sinahmr/NACLIP@0cac3a6:pamr.py` (= `wangf3014/SCLIP:pamr.py`), quirks included (see `pamr`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .registry import ENTRY_POINT_GROUP, Registry, caller_module

KINDS = ("token", "text", "match", "windows", "retrieval", "post", "global", "labels", "refine")


@dataclass(frozen=True)
class Stage:
    """One configured stage: its kind, canonical text form and function (signature per kind above)."""

    kind: str
    name: str
    fn: Callable[..., torch.Tensor]
    taps: bool = False  # token stages only: also edits the hidden states the spec reads (see above)
    backbones: tuple[str, ...] = ()  # external backbones the stage runs (`ls backbones`)
    text: bool = False  # post stages only: also receives the text embeddings (see above)
    at_input: bool = False  # post stages only: runs at the network input's size on its RGB image (see above)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"stage kind must be one of {', '.join(KINDS)} (got {self.kind!r})")

    def __call__(self, *args) -> torch.Tensor:
        return self.fn(*args)


# name -> factory: the text after "NAME:" (empty when absent) -> Stage; ValueError for bad arguments.
# The published methods' stages register in their rooms (`clipseg_sparse.methods`); PAMR is here, below the
# engine, because ResCLIP's first pass (attention/feedback.py) runs it inside the attention.
STAGES: Registry[Callable[[str], Stage]] = Registry(
    "stage", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP, help_column="kind and meaning"
)


def parse_stage(text: str) -> Stage:
    """`NAME[:ARGS]` -> the configured Stage (UnknownNameError / ValueError name the problem)."""
    name, _, args = text.strip().partition(":")
    return STAGES.get(name)(args)


#: stage kinds a spec may name with `hook:` (the others belong to the settings: text, labels, refine)
HOOK_KINDS = ("token", "match", "global", "windows", "retrieval", "post")


def check_hook(text: str) -> str:
    """The canonical text of a token, match, global, windows, retrieval or post stage named by a spec's `hook:`; ValueError naming them."""
    try:
        stage = parse_stage(text)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{e}" if text.partition(":")[0] in STAGES else f"unknown hook {text!r}; hooks: {_hook_stages()}") from None
    if stage.kind not in HOOK_KINDS:
        raise ValueError(f"hook {text!r} is a {stage.kind} stage; hooks: {_hook_stages()} (text, labels and refine stages run with InferenceSettings.stages)")
    return stage.name


def _hook_stages() -> str:
    return ", ".join(n for n in STAGES.names() if STAGES.help(n).startswith(HOOK_KINDS))


def resolve_stages(texts: Sequence[str]) -> tuple[Stage, ...]:
    """Parse each stage text; a stage given twice is an error (it would run twice)."""
    stages = tuple(parse_stage(t) for t in texts)
    names = [s.name for s in stages]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"stage(s) given more than once: {', '.join(repeated)}")
    return stages


# --- PAMR -------------------------------------------------------------------------------------------

PAMR_ITERATIONS = 10
PAMR_DILATIONS = (8, 16)
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


def pamr(
    cosine: torch.Tensor, guide: torch.Tensor, iterations: int = PAMR_ITERATIONS, dilations: Sequence[int] = PAMR_DILATIONS
) -> torch.Tensor:
    """Pixel-adaptive mask refinement: `iterations` times, every pixel's N_names values become the
    affinity-weighted sum of its neighbours' values (the pixel itself excluded), replicate padding.

    cosine: N x H x W raw cosine; guide: 3 x H x W normalised image (same H x W). Returns N x H x W fp32.
    Copied from the published code: the centre is not a neighbour but is in the std; the std is
    unbiased; affinities are averaged over colour channels before the softmax; the guide is the resized
    network input brought back to the original size, not the original image (the caller's job).
    Not copied: NACLIP skips PAMR silently when it runs out of GPU memory, and on GPU in fp16 casts the
    refined logits to fp16; here PAMR always runs, in fp32.
    """
    if cosine.shape[-2:] != guide.shape[-2:]:
        raise ValueError(f"pamr: cosine {tuple(cosine.shape[-2:])} and guide {tuple(guide.shape[-2:])} differ in size")
    weights = pamr_affinity(guide.to(cosine.device), dilations)
    mask = cosine.float()
    for _ in range(iterations):
        out = torch.zeros_like(mask)
        for w, neighbour in zip(weights, _shifted(mask, dilations)):
            out.addcmul_(neighbour, w)
        mask = out
    return mask


def _pamr_stage(args: str) -> Stage:
    """`pamr[:ITERATIONS[:D1,D2,...]]`, default pamr:10:8,16 (NACLIP's)."""
    usage = "expected pamr[:ITERATIONS[:D1,D2,...]] with positive integers, e.g. pamr:10:8,16"
    parts = args.split(":") if args else []
    if len(parts) > 2:
        raise ValueError(f"bad stage 'pamr:{args}': {usage}")
    try:
        iterations = int(parts[0]) if parts else PAMR_ITERATIONS
        dilations = tuple(int(d) for d in parts[1].split(",")) if len(parts) > 1 else PAMR_DILATIONS
    except ValueError:
        raise ValueError(f"bad stage 'pamr:{args}': {usage}") from None
    if iterations < 1 or not dilations or min(dilations) < 1:
        raise ValueError(f"bad stage 'pamr:{args}': {usage}")
    name = f"pamr:{iterations}:{','.join(map(str, dilations))}"
    return Stage("post", name, lambda cosine, guide: pamr(cosine, guide, iterations, dilations))


STAGES.register(
    "pamr",
    _pamr_stage,
    help="post: PAMR refinement of the raw cosine at the original size (default 10 iterations, dilations 8,16; NACLIP's)",
)


def register_plain_stage(name: str, kind: str, fn: Callable[..., torch.Tensor], help: str, module: str | None = None) -> None:
    """Register a stage that takes no arguments (`NAME` only)."""

    def factory(args: str) -> Stage:
        if args:
            raise ValueError(f"bad stage '{name}:{args}': {name} takes no arguments")
        return Stage(kind, name, fn)

    STAGES.register(name, factory, help=help, module=module or caller_module())
