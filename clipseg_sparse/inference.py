"""From an image to a label map: resize, sliding windows, text matching, background rule.

The steps and their defaults follow the published training-free code (SCLIP / mmseg): keep-ratio resize
so the short side is `resolution` (long side capped at 2048), 224 x 224 windows with stride 112 and the
last window shifted back inside the image, cosine maps upsampled bilinearly to each window and averaged
where windows overlap, then upsampled to the original size; probabilities are
softmax(logit_scale * cosine) over all names, then the max over each class's synonyms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .attention import AttentionSpec, resolve_spec
from .images import load_image
from .model import DenseCLIP
from .proxy_source import PROXIES, ext_backbones, proxy_config
from .stages import Stage, resolve_stages
from .text import Vocabulary, embed_names, resolve_templates, templates_id


@dataclass(frozen=True)
class InferenceSettings:
    """Every knob between pixels and labels. 0 disables resolution (keep size) and window (whole image)."""

    resolution: int = 336
    max_long_side: int = 2048
    window: int = 224
    stride: int = 112
    logit_scale: float = 40.0
    bg_threshold: float = 0.0
    area_threshold: float = 0.0
    batch_size: int = 16
    pamr: bool = False  # PAMR post stage (stages.py), NACLIP's default
    stages: tuple[str, ...] = ()  # further registered stages (`ls stages`), as text: NAME[:ARGS]

    def __post_init__(self) -> None:
        if isinstance(self.stages, str):
            raise ValueError(f"stages must be a list of stage names (got the string {self.stages!r})")
        object.__setattr__(self, "stages", tuple(self.stages))
        resolve_stages(self.stage_texts())  # unknown names and bad arguments fail here
        for name in ("resolution", "window", "max_long_side"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.window and not 0 < self.stride <= self.window:
            raise ValueError(f"stride must be in (0, window] (got stride {self.stride}, window {self.window})")
        if not 0.0 <= self.bg_threshold <= 1.0 or not 0.0 <= self.area_threshold <= 1.0:
            raise ValueError("bg_threshold and area_threshold must be in [0, 1]")
        if self.batch_size < 1 or self.logit_scale <= 0:
            raise ValueError("batch_size must be >= 1 and logit_scale > 0")

    def stage_texts(self) -> tuple[str, ...]:
        """Every stage to run, in order: `stages`, then PAMR when `pamr` is on."""
        return self.stages + (("pamr",) if self.pamr else ())

    def replace(self, **changes: object) -> "InferenceSettings":
        """A validated copy with `changes`; None values are ignored (an option left unset). Unknown names
        raise ValueError listing the settings."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(f"unknown inference setting(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def resized_shape(height: int, width: int, short_side: int, long_cap: int = 2048) -> tuple[int, int]:
    """mmcv's keep-ratio rescale to (long_cap, short_side): scale = min(long_cap/long, short/short)."""
    if not short_side:
        return height, width
    scale = min(short_side / min(height, width), (long_cap or math.inf) / max(height, width))
    return int(height * scale + 0.5), int(width * scale + 0.5)


def window_boxes(height: int, width: int, window: int, stride: int) -> list[tuple[int, int, int, int]]:
    """(y1, y2, x1, x2) of mmseg's sliding windows; the last one is shifted back inside the image."""
    if not window:
        return [(0, height, 0, width)]
    rows = max(height - window + stride - 1, 0) // stride + 1
    cols = max(width - window + stride - 1, 0) // stride + 1
    boxes = []
    for r in range(rows):
        for c in range(cols):
            y2, x2 = min(r * stride + window, height), min(c * stride + window, width)
            boxes.append((max(y2 - window, 0), y2, max(x2 - window, 0), x2))
    return boxes


def to_pixels(image: np.ndarray, clip: DenseCLIP, size: tuple[int, int]) -> torch.Tensor:
    """uint8 H x W x 3 -> 1 x 3 x size CLIP-normalised fp32 (bilinear resize, as mmcv does)."""
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()  # a copy: inputs may be read-only
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False).clamp(0, 255)
    mean = torch.tensor(clip.mean).view(1, 3, 1, 1) * 255
    std = torch.tensor(clip.std).view(1, 3, 1, 1) * 255
    return (x - mean) / std


def iter_window_features(
    clip: DenseCLIP,
    pixels: torch.Tensor,
    spec: AttentionSpec,
    window: int = 224,
    stride: int = 112,
    batch_size: int = 16,
    token_stages: Sequence[Stage] = (),
    encode: Callable[[torch.Tensor, AttentionSpec], torch.Tensor] | None = None,
) -> Iterator[tuple[list[tuple[int, int, int, int]], torch.Tensor]]:
    """Dense features of the sliding windows of `pixels` (1 x 3 x H x W), one batch at a time.

    Yields (window boxes (y1, y2, x1, x2), B x h x w x D features). Windows whose sides are not multiples
    of the patch size are zero-padded at the bottom and right, so patch (i, j) of a window covers pixels
    y1 + i*patch .. y1 + (i+1)*patch (and likewise in x) and its grid may reach past the window.
    encode(crops, spec) replaces `clip.encode_dense` (e.g. attention maps for the analysis).
    """
    _, _, H, W = pixels.shape
    boxes = window_boxes(H, W, window, stride)
    wh, ww = boxes[0][1] - boxes[0][0], boxes[0][3] - boxes[0][2]
    ps = clip.patch_size
    pad_h, pad_w = -wh % ps, -ww % ps
    for i in range(0, len(boxes), batch_size):
        chunk = boxes[i : i + batch_size]
        crops = torch.cat([pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
        crops = F.pad(crops, (0, pad_w, 0, pad_h))
        yield chunk, encode(crops, spec) if encode is not None else clip.encode_dense(crops, spec, token_stages)


def dense_cosine(
    clip: DenseCLIP,
    pixels: torch.Tensor,
    text: torch.Tensor,
    spec: AttentionSpec,
    window: int = 224,
    stride: int = 112,
    batch_size: int = 16,
    out_size: tuple[int, int] | None = None,
    token_stages: Sequence[Stage] = (),
) -> torch.Tensor:
    """Cosine between patch features and each text embedding, N_names x H x W at the pixels' size
    (or at `out_size`, as if that map were then resized bilinearly).

    Windows run as batches of `batch_size` through the model; each window's patch map is upsampled
    bilinearly to the window (zero-padded up to a multiple of the patch size, then cropped) and the
    overlaps are averaged. Bilinear resizing is separable and linear, and the windows form a grid of row
    and column intervals, so upsample -> place -> average -> resize is one product per name,
    Ly @ G @ Lx^T, with G the grid of all windows' patch maps (N_names x rows*h x cols*w) and Ly, Lx
    small interpolation matrices: no per-window work or window-sized temporaries beyond the model call.
    """
    _, _, H, W = pixels.shape
    ps = clip.patch_size
    text = text.to(clip.device)
    boxes, cos = [], []
    for chunk, feats in iter_window_features(clip, pixels, spec, window, stride, batch_size, token_stages):
        boxes += chunk
        cos.append(torch.einsum("bhwd,nd->bnhw", feats, text))
    cos = torch.cat(cos)  # windows row-major over the grid of row and column intervals
    rows = sorted({(y1, y2) for y1, y2, _, _ in boxes})
    cols = sorted({(x1, x2) for _, _, x1, x2 in boxes})
    _, n, h, w = cos.shape
    grid = cos.view(len(rows), len(cols), n, h, w).permute(2, 0, 3, 1, 4).reshape(n, len(rows) * h, len(cols) * w)
    out_h, out_w = out_size or (H, W)
    # a window's map covers the window padded to a multiple of CLIP's patch (h x w patches of CLIP, or
    # the finer grid of an external backbone's attention: ProxyCLIP's DINO B/8 gives 2h x 2w)
    padded_h, padded_w = (-(-(span[1] - span[0]) // ps) * ps for span in (rows[0], cols[0]))
    ly = _window_interpolation(rows, H, h, padded_h, out_h).to(clip.device)
    lx = _window_interpolation(cols, W, w, padded_w, out_w).to(clip.device)
    # computed as H x W x N and returned as an N x H x W view: reductions over names (softmax, max) then
    # run along contiguous memory, about twice as fast as over the leading dimension of a C x H x W tensor
    return torch.einsum("hr,nrc,wc->hwn", ly, grid, lx).permute(2, 0, 1)


def _resize_matrix(src: int, dst: int) -> torch.Tensor:
    """dst x src weights of 1-D linear resizing (align_corners=False), the per-axis part of bilinear."""
    return F.interpolate(torch.eye(src)[None], size=dst, mode="linear", align_corners=False)[0].T


def _window_interpolation(spans: list[tuple[int, int]], size: int, patches: int, padded: int, out: int) -> torch.Tensor:
    """out x (len(spans) * patches): upsample each window's `patches` to `padded` pixels, crop to its
    span, place it, average where spans overlap, then resize `size` -> `out` (all along one axis)."""
    up = _resize_matrix(patches, padded)
    place = torch.zeros(size, len(spans) * patches)
    coverage = torch.zeros(size, 1)
    for i, (a, b) in enumerate(spans):
        place[a:b, i * patches : (i + 1) * patches] = up[: b - a]
        coverage[a:b] += 1
    place /= coverage
    return place if out == size else _resize_matrix(size, out) @ place


def class_probabilities(
    cosine: torch.Tensor, name_to_class: Sequence[int], num_classes: int, logit_scale: float
) -> torch.Tensor:
    """softmax(logit_scale * cosine) over all names, then the max over each class's names: C x H x W."""
    probs = cosine * logit_scale  # a fresh tensor, so the softmax can run in place (a third faster
    probs -= probs.amax(0, keepdim=True)  # than torch.softmax over dim 0 at C x H x W sizes)
    probs.exp_()
    probs /= probs.sum(0, keepdim=True)
    if len(name_to_class) == num_classes:
        return probs
    index = torch.as_tensor(name_to_class, device=probs.device).view(-1, 1, 1).expand_as(probs)
    probs = probs.contiguous()  # scatter over the leading dim is several times faster on C x H x W memory
    out = torch.zeros(num_classes, *probs.shape[1:], device=probs.device, dtype=probs.dtype)
    return out.scatter_reduce_(0, index, probs, reduce="amax", include_self=False)


def probabilities_to_labels(probs: torch.Tensor, bg_threshold: float = 0.0, area_threshold: float = 0.0) -> torch.Tensor:
    """Argmax labels with SCLIP's background rules; class 0 is the background class.

    area_threshold: classes 1.. whose predicted area is at most this fraction of all non-background
    predicted pixels are dropped (their probabilities zeroed). bg_threshold: pixels whose top probability
    is below it become class 0.
    """
    if area_threshold > 0 and probs.shape[0] > 1:
        pred = probs.argmax(0)
        area = torch.bincount(pred.flatten(), minlength=probs.shape[0])[1:].to(probs.dtype)
        keep = (area > area_threshold * area.sum()).to(probs.dtype)
        probs = torch.cat([probs[:1], probs[1:] * keep.view(-1, 1, 1)])
    top, labels = probs.max(0)
    if bg_threshold > 0:
        labels[top < bg_threshold] = 0
    return labels


@dataclass
class SegmentationResult:
    """labels: H x W int64 at the original size; probs: C x H x W float32 (after the max over synonyms)."""

    labels: np.ndarray
    probs: np.ndarray
    class_names: tuple[str, ...]
    settings: dict = field(default_factory=dict)

    def present(self) -> dict[str, float]:
        """Pixel fraction of each class present, largest first."""
        counts = np.bincount(self.labels.ravel(), minlength=len(self.class_names))
        total = max(int(counts.sum()), 1)
        order = np.argsort(-counts, kind="stable")
        return {self.class_names[i]: counts[i] / total for i in order if counts[i] > 0}


class Segmenter:
    """Open-vocabulary segmentation of single images with a fixed model, spec, vocabulary and settings.

        seg = Segmenter(load_clip("ViT-B-16"), "cat,dog,grass", spec="sclip")
        result = seg.predict("photo.jpg")        # result.labels, result.probs, result.class_names

    The vocabulary is embedded once (and cached on disk) when the segmenter is built; `progress` shows a
    progress bar on stderr while it is (or a note that the cache is reused).
    """

    def __init__(
        self,
        clip: DenseCLIP,
        vocabulary: Vocabulary | str | Sequence[str],
        spec: AttentionSpec | str | None = "sclip",
        settings: InferenceSettings | None = None,
        templates: str | Sequence[str] = "openai",
        cache_dir: str | Path | None = None,
        progress: bool = False,
    ) -> None:
        if isinstance(vocabulary, str):
            vocabulary = Vocabulary.parse(vocabulary)
        elif not isinstance(vocabulary, Vocabulary):
            vocabulary = Vocabulary.from_names([[n] for n in vocabulary])
        self.clip = clip
        self.vocabulary = vocabulary
        self.spec = resolve_spec(spec)
        clip.check_spec(self.spec)  # e.g. a DnA adapter made for another model: fail before any work
        if ext_backbones(self.spec):  # ext: terms see this CLIP's crops (its normalisation, precision)
            PROXIES.configure(clip)
        self.settings = settings or InferenceSettings()
        self.templates = resolve_templates(templates)
        self.stages = resolve_stages(self.settings.stage_texts())
        self.text = embed_names(clip, vocabulary.flat_names, self.templates, cache_dir=cache_dir, progress=progress)
        for stage in self._stages("text"):
            self.text = stage(self.text)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.vocabulary.labels

    def config(self) -> dict:
        """Everything that changes a prediction, for result files."""
        return {
            **self.clip.config(),
            "attention": str(self.spec),
            "templates": templates_id(self.templates),
            "classes": [list(syn) for syn in self.vocabulary.names],
            **dataclasses.asdict(self.settings),
            "stages": [s.name for s in self.stages],  # canonical names, PAMR included when on
            **proxy_config(self.spec),  # backbones of ext: terms, their tags and weights
        }

    def _stages(self, kind: str) -> list[Stage]:
        return [s for s in self.stages if s.kind == kind]

    def cosine(self, image: np.ndarray) -> torch.Tensor:
        """N_names x H x W cosine at the original image size, for an RGB uint8 image, after the post
        stages (PAMR), which run on the whole full-size map."""
        s = self.settings
        height, width = image.shape[:2]
        size = resized_shape(height, width, s.resolution, s.max_long_side)
        pixels = to_pixels(image, self.clip, size)
        cos = dense_cosine(
            self.clip, pixels, self.text, self.spec, s.window, s.stride, s.batch_size, (height, width), self._stages("token")
        )
        post = self._stages("post")
        if post:
            # the guide of published PAMR: the network input brought back to the original size
            guide = F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False)[0].to(cos.device)
            for stage in post:
                cos = stage(cos, guide)
        return cos

    def _probabilities(self, rgb: np.ndarray) -> torch.Tensor:
        """C x H x W class probabilities at the original size (on the model's device)."""
        return class_probabilities(self.cosine(rgb), self.vocabulary.name_to_class, len(self.vocabulary), self.settings.logit_scale)

    @torch.inference_mode()
    def predict(self, image) -> SegmentationResult:
        """Segment one image (a path, a PIL image or an H x W x 3 array)."""
        probs = self._probabilities(load_image(image))
        labels = probabilities_to_labels(probs, self.settings.bg_threshold, self.settings.area_threshold)
        return SegmentationResult(
            labels=labels.cpu().numpy(),
            probs=probs.float().cpu().numpy(),
            class_names=self.class_names,
            settings=self.config(),
        )

    @torch.inference_mode()
    def predict_labels(self, image) -> np.ndarray:
        """H x W int64 labels only; skips copying the C x H x W probabilities to the host (benchmarks)."""
        probs = self._probabilities(load_image(image))
        return probabilities_to_labels(probs, self.settings.bg_threshold, self.settings.area_threshold).cpu().numpy()
