"""From an image to a label map: resize, sliding windows, text matching, background rule.

The steps and their defaults follow the published training-free code (SCLIP / mmseg): keep-ratio resize
so the short side is `resolution` (long side capped at 2048), 224 x 224 windows with stride 112 and the
last window shifted back inside the image, cosine maps upsampled bilinearly to each window and averaged
where windows overlap, then upsampled to the original size; probabilities are
softmax(logit_scale * cosine) over all names, then the max over each class's synonyms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec
from .images import load_image
from ..models.clip import POS_INTERP_RULES, DenseCLIP
from ..attention.grid import resize_regions
from ..models.proxies import PROXIES, proxy_config, spec_backbones
from .regions import region_reader
from ..stages import Stage, resolve_stages
from .vocabulary import Vocabulary, embed_names, resolve_templates, templates_id


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
    # how the published mmseg code differs from our defaults (the protocols choose theirs):
    resize: str = "torch"  # torch: bilinear on floats; opencv: cv2.resize on the uint8 image (mmcv)
    pos_interp: str = "size"  # positional embeddings: "size" (exact grid) or "scale" ((n + 0.1) / native)
    remainder: str = "pad"  # window pixels past the last whole patch: pad, centre or drop (see window_geometry)
    renormalize: bool = False  # saved probabilities divided by their sum after the synonym max (NACLIP)
    # resized sides rounded up to a multiple of this and to >= window (Trident: 16); 0: off, or the patch size
    # when a global stage splices the windows
    size_multiple: int = 0

    def __post_init__(self) -> None:
        for name, choices in (("resize", RESIZE_METHODS), ("pos_interp", POS_INTERP_RULES), ("remainder", REMAINDER_RULES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)} (got {getattr(self, name)!r})")
        if isinstance(self.stages, str):
            raise ValueError(f"stages must be a list of stage names (got the string {self.stages!r})")
        object.__setattr__(self, "stages", tuple(self.stages))
        resolve_stages(self.stage_texts())  # unknown names and bad arguments fail here
        for name in ("resolution", "window", "max_long_side", "size_multiple"):
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


RESIZE_METHODS = ("torch", "opencv")
REMAINDER_RULES = ("pad", "centre", "drop")


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


def round_up_pixels(pixels: torch.Tensor, multiple: int, minimum: int = 0) -> torch.Tensor:
    """Trident's `preprocess_image`: B x 3 x H x W resized bilinearly (align_corners False) so that both
    sides are multiples of `multiple` (rounded up) and at least `minimum` (the window); unchanged if so."""
    H, W = pixels.shape[-2:]
    size = tuple(max(-(-side // multiple) * multiple, minimum) for side in (H, W))
    return pixels if size == (H, W) else F.interpolate(pixels, size=size, mode="bilinear", align_corners=False)


def to_pixels(image: np.ndarray, clip: DenseCLIP, size: tuple[int, int], method: str = "torch") -> torch.Tensor:
    """uint8 H x W x 3 -> 1 x 3 x size CLIP-normalised fp32, resized bilinearly (align_corners=False).

    method "torch": resize the float image (no rounding). "opencv": what mmcv's `imresize` does in the
    published pipelines, `cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)` on the uint8 image,
    whose fixed-point result is rounded to uint8 (up to about 0.8 grey levels from the float resize).
    """
    if method not in RESIZE_METHODS:
        raise ValueError(f"unknown resize method {method!r}; choose {', '.join(RESIZE_METHODS)}")
    if method == "opencv" and tuple(image.shape[:2]) != tuple(size):
        import cv2

        image = cv2.resize(np.ascontiguousarray(image), (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()  # a copy: inputs may be read-only
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False).clamp(0, 255)
    mean = torch.tensor(clip.mean).view(1, 3, 1, 1) * 255
    std = torch.tensor(clip.std).view(1, 3, 1, 1) * 255
    return (x - mean) / std


def window_geometry(side: int, patch: int, rule: str = "pad", whole_image: bool = False) -> tuple[int, int, int, int]:
    """How a window side that is not a whole number of patches is encoded: (patches, pad before, pad
    after, upsampled size). A negative pad after drops pixels. The patch map is upsampled bilinearly to
    `upsampled` pixels and rows `pad before` .. `pad before + side` of it are the window's.

    pad (our default): zero-pad at the end; patch i covers pixels i*patch .. (i+1)*patch.
    centre (ClearCLIP's sliding windows, `compute_padsize`): zero-pad half before (rounded down), half
    after, then crop the upsampled map; a whole image (no windows) is encoded as with drop, as there.
    drop (SCLIP, NACLIP and ClearCLIP without windows): the patch convolution ignores the last
    side % patch pixels and the floor(side / patch) patch map is stretched over the whole side.
    """
    if rule not in REMAINDER_RULES:
        raise ValueError(f"unknown remainder rule {rule!r}; choose {', '.join(REMAINDER_RULES)}")
    extra = -side % patch
    if rule == "drop" or (rule == "centre" and whole_image):
        if side < patch:
            raise ValueError(f"a {side}-pixel window side is smaller than one {patch}-pixel patch")
        return side // patch, 0, -(side % patch), side
    before = extra // 2 if rule == "centre" else 0
    return (side + extra) // patch, before, extra - before, side + extra


def iter_window_features(
    clip: DenseCLIP,
    pixels: torch.Tensor,
    spec: AttentionSpec,
    window: int = 224,
    stride: int = 112,
    batch_size: int = 16,
    token_stages: Sequence[Stage] = (),
    pos_interp: str = "size",
    remainder: str = "pad",
    encode: Callable[[torch.Tensor, AttentionSpec], torch.Tensor] | None = None,
    with_cls: bool = False,
    context: dict | None = None,
    regions: torch.Tensor | None = None,
) -> Iterator[tuple]:
    """Dense features of the sliding windows of `pixels` (1 x 3 x H x W), one batch at a time.

    Yields (window boxes (y1, y2, x1, x2), B x h x w x D features), plus the windows' B x D CLS
    embeddings when `with_cls`. Windows whose sides are not multiples of the patch size follow
    `remainder` (see `window_geometry`); with the default, pad, they are zero-padded at the bottom and
    right, so patch (i, j) of a window covers pixels
    y1 + i*patch .. y1 + (i+1)*patch (and likewise in x) and its grid may reach past the window.
    encode(crops, spec) replaces `clip.encode_dense` (e.g. attention maps for the analysis). context:
    passed to `clip.encode_dense` (the text a `feedback` term's first pass reads).
    regions: H x W integer region ids of `pixels` (-1 unsegmented), cropped like each window; padded
    pixels form one more region (CorrCLIP pads its masks with 10000), for specs that read regions.
    """
    _, _, H, W = pixels.shape
    boxes = window_boxes(H, W, window, stride)
    wh, ww = boxes[0][1] - boxes[0][0], boxes[0][3] - boxes[0][2]
    _, top, bottom, _ = window_geometry(wh, clip.patch_size, remainder, not window)
    _, left, right, _ = window_geometry(ww, clip.patch_size, remainder, not window)
    for i in range(0, len(boxes), batch_size):
        chunk = boxes[i : i + batch_size]
        windows = torch.cat([pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
        crops = F.pad(windows, (left, right, top, bottom))
        crop_regions = None
        if regions is not None:
            crop_regions = torch.stack([regions[y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
            crop_regions = F.pad(crop_regions, (left, right, top, bottom), value=int(regions.max()) + 1)
        if encode is not None:
            yield chunk, encode(crops, spec)
        else:
            # ResCLIP's first pass upsamples to the whole window, also where `drop` cuts it to whole patches
            ctx = dict(context, windows=windows) if context and min(right, bottom) < 0 else context
            out = clip.encode_dense(crops, spec, token_stages, with_cls, pos_interp=pos_interp, context=ctx, regions=crop_regions)
            yield (chunk, *out) if with_cls else (chunk, out)


#: elements of one band of rows of the N x H x W cosine map (and of each temporary made from it): the final
#: resize is computed a band at a time, so memory does not grow with classes x image size (16 MiB float32:
#: small enough for the C library to reuse freed bands instead of mapping fresh pages for each)
BAND_ELEMENTS = 1 << 22


#: rows per matrix-product call: every call has this shape, so a row's result never depends on the band
ROW_BLOCK = 8


@dataclass(frozen=True)
class CosineMap:
    """N_names x H x W cosine between patch features and text at the output size, kept factored.

    Bilinear resizing is separable and linear, so every output row is a weighted sum of a few rows of
    the window grid (a row of `rows_from`, H' x R), and each of its pixels a weighted sum of the grid's
    K columns (`cols`, W x K). `pieces` computes any ROW_BLOCK rows alone with the same two matrix
    products for every block, whatever the band, so a band (`rows`) equals the same rows of the whole map
    bit for bit and no N x H x W tensor is ever needed.
    """

    grid: torch.Tensor  # R x K x N: every window's patch cosines, laid out as window rows x window columns
    rows_from: torch.Tensor  # H' x R, H' = H rounded up to a multiple of ROW_BLOCK (zero rows)
    cols: torch.Tensor  # W x K
    height: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.grid.shape[2], self.height, self.cols.shape[0]

    @property
    def device(self) -> torch.device:
        return self.grid.device

    def scaled(self, factor: float) -> "CosineMap":
        """The same map times `factor` (scaling the small grid, not every pixel)."""
        return dataclasses.replace(self, grid=self.grid * factor)

    def rows(self, y0: int, y1: int) -> torch.Tensor:
        """N x (y1 - y0) x W, a fresh tensor seen through a view of a (y1 - y0) x W x N tensor: reductions over names then run along
        contiguous memory, about twice as fast as over the leading dimension of a C x H x W tensor."""
        first, last = y0 - y0 % ROW_BLOCK, -(-y1 // ROW_BLOCK) * ROW_BLOCK
        out = torch.empty(last - first, self.cols.shape[0], self.grid.shape[2], device=self.grid.device, dtype=self.grid.dtype)
        for start, block in self.pieces(first, last):
            out[start - first : start - first + ROW_BLOCK] = block.permute(1, 2, 0)
        return out[y0 - first : y1 - first].permute(2, 0, 1)

    def pieces(self, y0: int, y1: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, N x ROW_BLOCK x W) for the blocks of rows covering y0..y1 (whole blocks, so the first
        may start before y0 and the last end after y1, past the map's height): fresh tensors, names
        contiguous. Each is two matrix products, the same calls for every block: ROW_BLOCK x R @ R x (K N)
        for the rows, then W x K @ K x (ROW_BLOCK N) for the columns of all its rows at once."""
        R, K, N = self.grid.shape
        grid = self.grid.view(R, K * N)
        for start in range(y0 - y0 % ROW_BLOCK, y1, ROW_BLOCK):
            block = torch.mm(self.rows_from[start : start + ROW_BLOCK], grid).view(ROW_BLOCK, K, N)
            block = torch.mm(self.cols, block.transpose(0, 1).reshape(K, ROW_BLOCK * N))  # W x (ROW_BLOCK N)
            yield start, block.view(-1, ROW_BLOCK, N).permute(2, 1, 0)


@dataclass(frozen=True)
class DenseMap:
    """An N x H x W map held whole (what post stages such as PAMR return), with CosineMap's interface."""

    values: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def scaled(self, factor: float) -> "DenseMap":
        return DenseMap(self.values * factor)

    def rows(self, y0: int, y1: int) -> torch.Tensor:
        """N x (y1 - y0) x W, a fresh copy (callers may overwrite it)."""
        return self.values[:, y0:y1].clone()

    def pieces(self, y0: int, y1: int) -> Iterator[tuple[int, torch.Tensor]]:
        """CosineMap.pieces' interface: the band itself, one piece."""
        yield y0, self.rows(y0, y1)


def row_bands(height: int, row_elements: int, budget: int = BAND_ELEMENTS) -> list[tuple[int, int]]:
    """(y0, y1) bands of rows covering 0..height, each a multiple of ROW_BLOCK rows holding at most
    `budget` elements (ROW_BLOCK rows at least)."""
    step = max(1, budget // max(row_elements * ROW_BLOCK, 1)) * ROW_BLOCK
    return [(y, min(y + step, height)) for y in range(0, height, step)]


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
    pos_interp: str = "size",
    remainder: str = "pad",
    logit_scale: float = 40.0,
    regions: torch.Tensor | None = None,
) -> CosineMap:
    """Cosine between patch features and each text embedding, N_names x H x W at the pixels' size
    (or at `out_size`, as if that map were then resized bilinearly), as a CosineMap (rows on demand).

    Windows run as batches of `batch_size` through the model; each window's patch map is upsampled
    bilinearly to the window (by default zero-padded up to a multiple of the patch size, then cropped;
    `remainder` and `pos_interp` as in `iter_window_features`) and the overlaps are averaged. Bilinear resizing is separable and linear, and the windows form a grid of row
    and column intervals, so upsample -> place -> average -> resize is one product per name,
    Ly @ G @ Lx^T, with G the grid of all windows' patch maps (rows*h x cols*w per name) and Ly, Lx
    small interpolation matrices: no per-window work or window-sized temporaries beyond the model call,
    and any band of rows is a band of Ly's rows, which is what CosineMap uses.
    Match stages the spec names (`hook:surgery`) rewrite each window's cosine map before that. A spec
    with a `feedback` term (ResCLIP) gets the text and `logit_scale` for its first pass.
    regions: H x W region ids of `pixels`, for specs that read regions (see `iter_window_features`).
    """
    _, _, H, W = pixels.shape
    text = text.to(clip.device)
    match = [st for st in resolve_stages(spec.hooks) if st.kind == "match"]  # e.g. CLIP Surgery's
    boxes, cos = [], []
    context = {"text": text, "logit_scale": logit_scale}
    windows = iter_window_features(
        clip, pixels, spec, window, stride, batch_size, token_stages, pos_interp, remainder, with_cls=bool(match), context=context, regions=regions
    )
    for chunk, feats, *cls in windows:
        boxes += chunk
        window_cos = torch.einsum("bhwd,nd->bhwn", feats, text)
        for stage in match:  # match stages see B x N_names x h x w
            window_cos = stage(window_cos.permute(0, 3, 1, 2), cls[0], text).permute(0, 2, 3, 1)
        cos.append(window_cos)
    cos = torch.cat(cos)  # windows row-major over the grid of row and column intervals
    rows = sorted({(y1, y2) for y1, y2, _, _ in boxes})
    cols = sorted({(x1, x2) for _, _, x1, x2 in boxes})
    _, h, w, n = cos.shape
    grid = cos.view(len(rows), len(cols), h, w, n).permute(0, 2, 1, 3, 4).reshape(len(rows) * h, len(cols) * w, n)
    out_h, out_w = out_size or (H, W)
    # a window's map covers the window's encoded pixels (`window_geometry`): h x w patches of CLIP, or
    # the finer grid of an external backbone's attention (ProxyCLIP's DINO B/8 gives 2h x 2w)
    _, top, _, up_h = window_geometry(rows[0][1] - rows[0][0], clip.patch_size, remainder, not window)
    _, left, _, up_w = window_geometry(cols[0][1] - cols[0][0], clip.patch_size, remainder, not window)
    ly = _window_interpolation(rows, H, h, up_h, top, out_h)
    lx = _window_interpolation(cols, W, w, up_w, left, out_w)
    return _factored(grid, ly, lx)


def _factored(grid: torch.Tensor, ly: torch.Tensor, lx: torch.Tensor) -> CosineMap:
    """The CosineMap Ly @ grid @ Lx^T of an R x K x N grid (ly: out_h x R, lx: out_w x K)."""
    out_h = ly.shape[0]
    to = dict(device=grid.device, dtype=grid.dtype)
    rows_from = F.pad(ly, (0, 0, 0, -out_h % ROW_BLOCK))  # whole blocks of rows
    return CosineMap(grid.contiguous(), rows_from.to(**to), lx.to(**to), out_h)


def spliced_tokens(
    clip: DenseCLIP,
    pixels: torch.Tensor,
    spec: AttentionSpec,
    window: int = 224,
    stride: int = 112,
    batch_size: int = 16,
    token_stages: Sequence[Stage] = (),
    pos_interp: str = "size",
) -> torch.Tensor:
    """Trident's splice: every window's last-block tokens before ln_post (`DenseCLIP.dense_tokens`,
    h x w cells per window) placed at the window's corner on the image's grid of cells, overlaps
    averaged: 1 x Gh x Gw x C. Windows must tile that grid: the window side a whole number of cells and
    every corner on a cell boundary (for CLIP's grid: image sides, window and stride multiples of the
    patch size; `InferenceSettings.size_multiple`)."""
    from ..attention.grid import splice_windows

    _, _, H, W = pixels.shape
    encode = lambda crops, spec: clip.dense_tokens(crops, spec, token_stages, pos_interp)  # noqa: E731
    boxes, feats = [], []
    for chunk, f in iter_window_features(clip, pixels, spec, window, stride, batch_size, encode=encode):
        boxes += chunk
        feats.append(f)
    feats = torch.cat(feats)
    (y1, y2, x1, x2), (h, w) = boxes[0], feats.shape[1:3]
    cell_h, cell_w = (y2 - y1) // h, (x2 - x1) // w
    if (y2 - y1) % h or (x2 - x1) % w or H % cell_h or W % cell_w or any(b[0] % cell_h or b[2] % cell_w for b in boxes):
        raise ValueError(
            f"splicing windows needs the image ({H}x{W}), window and stride on the {cell_h}x{cell_w}-pixel cell grid "
            f"(set size_multiple={clip.patch_size}, a window and stride multiple of {clip.patch_size})"
        )
    corners = [(b[0] // cell_h, b[2] // cell_w) for b in boxes]
    return splice_windows(feats, corners, (H // cell_h, W // cell_w))[None]


def grid_cosine(feats: torch.Tensor, text: torch.Tensor, out_size: tuple[int, int]) -> CosineMap:
    """Cosine of one h x w x D feature grid covering the whole image with N_names x D text, resized
    bilinearly (align_corners False) to `out_size`, as a CosineMap (Trident's logits on the SAM grid)."""
    h, w, _ = feats.shape
    grid = torch.einsum("hwd,nd->hwn", feats, text.to(feats.device))
    return _factored(grid, _resize_matrix(h, out_size[0]), _resize_matrix(w, out_size[1]))


def _resize_matrix(src: int, dst: int) -> torch.Tensor:
    """dst x src weights of 1-D linear resizing (align_corners=False), the per-axis part of bilinear."""
    return F.interpolate(torch.eye(src)[None], size=dst, mode="linear", align_corners=False)[0].T


def _window_interpolation(
    spans: list[tuple[int, int]], size: int, patches: int, upsampled: int, offset: int, out: int
) -> torch.Tensor:
    """out x (len(spans) * patches): upsample each window's `patches` to `upsampled` pixels, keep the
    window's rows from `offset` on, place them at its span, average where spans overlap, then resize
    `size` -> `out` (all along one axis)."""
    up = _resize_matrix(patches, upsampled)[offset:]
    place = torch.zeros(size, len(spans) * patches)
    coverage = torch.zeros(size, 1)
    for i, (a, b) in enumerate(spans):
        place[a:b, i * patches : (i + 1) * patches] = up[: b - a]
        coverage[a:b] += 1
    place /= coverage
    return place if out == size else _resize_matrix(size, out) @ place


def class_probabilities(logits: torch.Tensor, name_to_class: Sequence[int], num_classes: int) -> torch.Tensor:
    """softmax over all names of N x H x W logits (logit_scale x cosine), then the max over each class's
    names: C x H x W. Overwrites `logits`: the softmax runs in place (a third faster than torch.softmax
    over dim 0 at C x H x W sizes, and no second N x H x W tensor)."""
    probs = logits
    probs -= probs.amax(0, keepdim=True)
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
    keep = None
    if area_threshold > 0 and probs.shape[0] > 1:
        keep = kept_classes(torch.bincount(probs.argmax(0).flatten(), minlength=probs.shape[0]), area_threshold)
    return masked_labels(probs, bg_threshold, keep)


def kept_classes(areas: torch.Tensor, area_threshold: float) -> torch.Tensor:
    """C 0/1 weights from the C predicted areas (argmax pixel counts): class 0 is kept, classes 1.. only
    if their area is above `area_threshold` x the non-background area (SCLIP's area_thd)."""
    area = areas[1:]
    return torch.cat([torch.ones(1, device=areas.device), (area > area_threshold * area.sum()).float()])


def masked_labels(probs: torch.Tensor, bg_threshold: float = 0.0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Labels of C x H x W probabilities: argmax over the classes `keep` (C 0/1 weights) leaves, and
    class 0 where the top probability is below `bg_threshold`."""
    if keep is not None:
        probs = probs * keep.to(probs.dtype).view(-1, 1, 1)
    if bg_threshold <= 0:
        return probs.argmax(0)  # the first of equal maxima, as max(0) picks
    top, labels = probs.max(0)
    if bg_threshold > 0:
        labels[top < bg_threshold] = 0
    return labels


class ClassMaps:
    """The C x H x W class probabilities of one image (softmax over names, max over synonyms), computed a
    band of rows at a time from its CosineMap, so that no temporary exceeds about `budget` elements
    whatever the image size and vocabulary; `rows` of any band equal those of the whole map exactly."""

    def __init__(
        self,
        cosine: CosineMap | DenseMap,
        name_to_class: Sequence[int],
        num_classes: int,
        logit_scale: float,
        budget: int = BAND_ELEMENTS,
        area_threshold: float = 0.0,
        renormalize: bool = False,
    ) -> None:
        self.area_threshold, self.renormalize = area_threshold, renormalize  # what the saved probabilities show
        self.logits = cosine.scaled(logit_scale)
        self.name_to_class = name_to_class
        names, height, width = cosine.shape
        self.shape = (num_classes, height, width)
        self.bands = row_bands(height, max(names, num_classes) * width, budget)
        self._whole: torch.Tensor | None = None  # kept when one band is the whole image: computed once

    @torch.inference_mode()
    def rows(self, y0: int, y1: int) -> torch.Tensor:
        """C x (y1 - y0) x W probabilities of rows y0..y1 (on the model's device)."""
        if self._whole is not None and (y0, y1) == (0, self.shape[1]):
            return self._whole
        probs = class_probabilities(self.logits.rows(y0, y1), self.name_to_class, self.shape[0])
        if (y0, y1) == (0, self.shape[1]):
            self._whole = probs
        return probs

    @torch.inference_mode()
    def labels(self, bg_threshold: float = 0.0, area_threshold: float = 0.0) -> np.ndarray:
        """H x W int64 labels by `probabilities_to_labels`'s rules, band by band (two passes over the bands
        when an area threshold needs the whole image's class areas first)."""
        _, height, width = self.shape
        labels = torch.empty((height, width), dtype=torch.int64)
        for start, piece in self._label_pieces(bg_threshold, self._kept(area_threshold)):
            labels[start : start + piece.shape[0]] = piece.cpu()
        return labels.numpy()

    def _label_pieces(self, bg_threshold: float, keep: torch.Tensor | None) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, h x W labels) of the logits' pieces (`CosineMap.pieces`), band by band, cut at the
        image's height, by `_piece_labels`."""
        height = self.shape[1]
        names = torch.as_tensor(self.name_to_class, device=self.logits.device)
        dropped = None if keep is None else keep.to(names.device)[names].view(-1, 1, 1) == 0
        for y0, y1 in self.bands:
            for start, logits in self.logits.pieces(y0, y1):
                yield start, self._piece_labels(logits, names, bg_threshold, dropped)[: height - start]

    @staticmethod
    def _piece_labels(logits: torch.Tensor, names: torch.Tensor, bg_threshold: float, dropped: torch.Tensor | None) -> torch.Tensor:
        """h x W labels of `masked_labels` on the probabilities of N x h x W `logits` (overwritten), read off
        the logits instead. names: the class of each name; dropped: N x 1 x 1, True for the names of the
        classes the area threshold drops (None: none).

        The softmax over names and the max over each class's names preserve order, and names are listed
        class by class, so the class of the first arg-max name is the first arg-max class; the top
        probability the background rule needs is exp(l_top - l_max) / sum exp(l - l_max), the same
        arithmetic as that entry of `class_probabilities`. No probability map is made: a third of the
        passes over names x pixels. Only a tie between probabilities that are equal in float32 while
        their logits differ could pick another label.
        """
        if bg_threshold <= 0:
            if dropped is not None:  # the classes the area threshold drops cannot win
                logits.masked_fill_(dropped, float("-inf"))
            return names[logits.argmax(0)]
        top_all = logits.amax(0)
        top, best = (logits if dropped is None else logits.masked_fill(dropped, float("-inf"))).max(0)
        total = logits.sub_(top_all).exp_().sum(0)  # over every name, dropped ones included
        labels = names[best]
        labels[top.sub_(top_all).exp_().div_(total) < bg_threshold] = 0
        return labels

    def _kept(self, area_threshold: float) -> torch.Tensor | None:
        """`kept_classes` from the whole image's argmax areas (None without an area threshold)."""
        classes = self.shape[0]
        if area_threshold <= 0 or classes < 2:
            return None
        areas = sum(torch.bincount(piece.flatten(), minlength=classes) for _, piece in self._label_pieces(0.0, None))
        return kept_classes(areas, area_threshold)

    @torch.inference_mode()
    def numpy_bands(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(y0, y1, C x (y1 - y0) x W float32 array) for every band, top to bottom: the probabilities
        the labels come from, with the classes the area threshold drops zeroed (SCLIP stores these), and
        with `renormalize` divided by their per-pixel sum (NACLIP; it changes no label)."""
        keep = self._kept(self.area_threshold)
        for y0, y1 in self.bands:
            probs = self.rows(y0, y1)
            if keep is not None:
                probs = probs * keep.to(probs.dtype).view(-1, 1, 1)
            if self.renormalize:
                probs = probs / probs.sum(0, keepdim=True)
            yield y0, y1, probs.float().cpu().numpy()


@dataclass
class SegmentationResult:
    """labels: H x W int64 at the original size. maps: the C x H x W class probabilities (after the max
    over synonyms), either an array or the ClassMaps `predict` returns, which computes them only when
    asked: `probs` makes the whole float32 array (C x H x W x 4 bytes), `prob_bands` streams it."""

    labels: np.ndarray
    maps: np.ndarray | ClassMaps
    class_names: tuple[str, ...]
    settings: dict = field(default_factory=dict)

    @property
    def probs(self) -> np.ndarray:
        """C x H x W float32 probabilities (computed on first use, then kept)."""
        if isinstance(self.maps, ClassMaps):
            out = np.empty(self.maps.shape, dtype=np.float32)
            for y0, y1, band in self.maps.numpy_bands():
                out[:, y0:y1] = band
            self.maps = out
        return self.maps

    def prob_bands(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(y0, y1, C x (y1 - y0) x W float32) bands of `probs`, top to bottom, without making the whole array."""
        if isinstance(self.maps, ClassMaps):
            yield from self.maps.numpy_bands()
        else:
            yield 0, self.maps.shape[1], self.maps

    def present(self) -> dict[str, float]:
        """Pixel fraction of each class present, largest first."""
        counts = np.bincount(self.labels.ravel(), minlength=len(self.class_names))
        total = max(int(counts.sum()), 1)
        order = np.argsort(-counts, kind="stable")
        return {self.class_names[i]: counts[i] / total for i in order if counts[i] > 0}


def global_stage(spec: AttentionSpec, stages: Sequence[Stage]) -> Stage | None:
    """The global stage to run (see stages.py): one given in the settings replaces the spec's of the same
    name (a protocol's per-dataset constants); ValueError if two different ones would run."""
    given = [s for s in stages if s.kind == "global"]
    named = {s.name.partition(":")[0] for s in given}
    found = given + [s for s in resolve_stages(spec.hooks) if s.kind == "global" and s.name.partition(":")[0] not in named]
    if len(found) > 1:
        raise ValueError(f"one global stage at a time (got {', '.join(s.name for s in found)})")
    match = [s.name for s in resolve_stages(spec.hooks) if s.kind == "match"]
    if found and match:
        raise ValueError(f"match stage {match[0]} works on each window's cosine map; it cannot run with the global stage {found[0].name}")
    return found[0] if found else None


class Segmenter:
    """Open-vocabulary segmentation of single images with a fixed model, spec, vocabulary and settings.

        seg = Segmenter(load_clip("ViT-B-16"), "cat,dog,grass", spec="sclip")
        result = seg.predict("photo.jpg")        # result.labels, result.probs, result.class_names

    The vocabulary is embedded once (and cached on disk) when the segmenter is built; `progress` shows a
    progress bar on stderr while it is (or a note that the cache is reused).
    regions: where region maps come from, for specs and stages that read them (CorrCLIP): a callable
    (rgb, name) -> H x W integer ids (-1 unsegmented) with a `source()` text for result files, e.g.
    `regions.RegionFolder` or `regions.Sam2Regions`; `predict(image, name)` passes the image's name.
    A source is required when the spec or a stage reads regions, and ignored (not recorded) otherwise.
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
        regions: Callable[[np.ndarray, str], np.ndarray] | None = None,
    ) -> None:
        if isinstance(vocabulary, str):
            vocabulary = Vocabulary.parse(vocabulary)
        elif not isinstance(vocabulary, Vocabulary):
            vocabulary = Vocabulary.from_names([[n] for n in vocabulary])
        self.clip = clip
        self.vocabulary = vocabulary
        self.spec = resolve_spec(spec)
        clip.check_spec(self.spec)
        self.settings = settings or InferenceSettings()
        self.templates = resolve_templates(templates)
        self.stages = resolve_stages(self.settings.stage_texts())
        reader = region_reader(self.spec, self.settings.stage_texts())
        if reader and regions is None:
            raise ValueError(f"{reader} needs region masks for each image: give a region source (--regions FOLDER or --regions sam2)")
        self.regions = regions if reader else None  # read (and recorded) only when something uses them
        self.global_stage = global_stage(self.spec, self.stages)
        s, patch = self.settings, clip.patch_size
        if self.global_stage and s.window and (s.window % patch or s.stride % patch):
            raise ValueError(f"stage {self.global_stage.name} splices the windows: window and stride must be multiples of the patch size {patch} (got {s.window} / {s.stride})")
        if self.backbones():  # ext: terms see this CLIP's crops (its normalisation, precision)
            PROXIES.configure(clip)
        self.text = embed_names(clip, vocabulary.flat_names, self.templates, cache_dir=cache_dir, progress=progress)
        for stage in self._stages("text"):
            self.text = stage(self.text)
        self.band_elements = BAND_ELEMENTS  # per band of the final resize; lower it to save memory

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
            **proxy_config(self.backbones()),  # backbones of ext: terms and stages, their tags and weights
            **({"regions": self.regions.source()} if self.regions is not None else {}),
        }

    def backbones(self) -> list[str]:
        """External backbones this segmenter runs: the spec's (`spec_backbones`), its global stage's, then
        its other stages' (samrefine: SAM's weights)."""
        extra = [*(self.global_stage.backbones if self.global_stage else ()), *(b for s in self.stages for b in s.backbones)]
        return list(dict.fromkeys(spec_backbones(self.spec) + extra))

    def _stages(self, kind: str) -> list[Stage]:
        return [s for s in self.stages if s.kind == kind]

    def region_map(self, image: np.ndarray, name: str | None) -> np.ndarray | None:
        """The image's H x W region ids from the region source (None without one)."""
        if self.regions is None:
            return None
        return self.regions(image, name if name is not None else "image")

    def cosine(self, image: np.ndarray, regions: np.ndarray | None = None) -> CosineMap | DenseMap:
        """N_names x H x W cosine at the original image size, for an RGB uint8 image: factored (see
        CosineMap), or whole after the post stages (PAMR), which run on the whole full-size map (their
        memory then grows with names x pixels). regions: the image's H x W region ids, resized
        nearest with the image (CorrCLIP), for specs that read them."""
        s = self.settings
        height, width = image.shape[:2]
        size = resized_shape(height, width, s.resolution, s.max_long_side)
        pixels = to_pixels(image, self.clip, size, s.resize)
        multiple = s.size_multiple or (self.clip.patch_size if self.global_stage else 0)  # splicing needs whole patches
        if multiple:
            pixels = round_up_pixels(pixels, multiple, s.window)
        scaled = None if regions is None else resize_regions(torch.from_numpy(np.asarray(regions, dtype=np.int64)), tuple(pixels.shape[-2:]))
        if self.global_stage is not None:  # splice the windows, then one stage over the whole image
            tokens = spliced_tokens(self.clip, pixels, self.spec, s.window, s.stride, s.batch_size, self._stages("token"), s.pos_interp)
            tokens = self.global_stage(tokens, image, self.spec.normalizer)
            factored = grid_cosine(self.clip.project(tokens[0]), self.text, (height, width))
        else:
            factored = dense_cosine(
                self.clip, pixels, self.text, self.spec, s.window, s.stride, s.batch_size, (height, width),
                self._stages("token"), s.pos_interp, s.remainder, s.logit_scale, scaled,
            )  # fmt: skip
        post = self._stages("post")
        if not post:
            return factored
        cos = factored.rows(0, height)
        # the guide of published PAMR: the network input brought back to the original size
        guide = F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False)[0].to(cos.device)
        for stage in post:
            cos = stage(cos, guide)
        return DenseMap(cos)

    @torch.inference_mode()
    def class_maps(self, rgb: np.ndarray, regions: np.ndarray | None = None) -> ClassMaps:
        """The C x H x W class probabilities at the original size, computed band by band on demand."""
        s = self.settings
        return ClassMaps(
            self.cosine(rgb, regions), self.vocabulary.name_to_class, len(self.vocabulary), s.logit_scale, self.band_elements,
            s.area_threshold, s.renormalize,
        )  # fmt: skip

    def _labels(self, image, name: str | None) -> tuple[ClassMaps, np.ndarray]:
        rgb = load_image(image)
        if name is None and isinstance(image, (str, Path)):
            name = Path(image).name
        regions = self.region_map(rgb, name)
        maps = self.class_maps(rgb, regions)
        labels = maps.labels(self.settings.bg_threshold, self.settings.area_threshold)
        for stage in self._stages("refine"):  # e.g. Trident's SAM prompt refinement, on the probabilities
            labels = stage(torch.from_numpy(labels), maps, rgb).numpy()
        for stage in self._stages("labels"):  # e.g. CorrCLIP's map correction, on the original regions
            labels = stage(torch.from_numpy(labels), torch.from_numpy(np.asarray(regions, dtype=np.int64))).numpy()
        return maps, labels

    def predict(self, image, name: str | None = None) -> SegmentationResult:
        """Segment one image (a path, a PIL image or an H x W x 3 array). Memory stays bounded at any
        image size: labels are computed a band of rows at a time, and `result.probs` only when used.
        name: the image's name for the region source (default: a path's file name)."""
        maps, labels = self._labels(image, name)
        return SegmentationResult(labels, maps, self.class_names, self.config())

    def predict_labels(self, image, name: str | None = None) -> np.ndarray:
        """H x W int64 labels only (what `eval` scores), computed a band of rows at a time."""
        return self._labels(image, name)[1]
