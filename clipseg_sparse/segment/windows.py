"""Sliding windows -> dense features -> the cosine with the text at the output size, kept factored.

Bilinear upsampling, placing windows and averaging their overlaps are linear and separable, so the whole
N_names x H x W map is Ly @ G @ Lx^T of the small window grid G: `CosineMap` computes any band of rows
alone, bit-identical to the same rows of the whole map, and no names x pixels tensor is ever made.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..attention import AttentionSpec
from ..models.clip import DenseCLIP
from ..stages import Stage, resolve_stages
from .preprocess import window_boxes, window_geometry, window_padding


#: told (windows done, windows of the image) after each batch of windows, in this context (`window_progress`)
_WINDOW_LISTENER: ContextVar[Callable[[int, int], None] | None] = ContextVar("window_listener", default=None)


@contextmanager
def window_progress(listener: Callable[[int, int], None]) -> Iterator[None]:
    """Call `listener(done, total)` after each batch of windows any image runs within the block: progress
    inside one image (a 4000 x 3000 photo with a heavy preset is minutes of windows), for the CLI's bars."""
    token = _WINDOW_LISTENER.set(listener)
    try:
        yield
    finally:
        _WINDOW_LISTENER.reset(token)


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
    encode: Callable[..., torch.Tensor] | None = None,
    with_cls: bool = False,
    context: dict | None = None,
    regions: torch.Tensor | None = None,
    image_features: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple]:
    """Dense features of the sliding windows of `pixels` (1 x 3 x H x W), one batch at a time.

    Yields (window boxes (y1, y2, x1, x2), B x h x w x D features), plus the windows' B x D CLS
    embeddings when `with_cls`. Windows whose sides are not multiples of the patch size follow
    `remainder` (see `window_geometry`); with the default, pad, they are zero-padded at the bottom and
    right, so patch (i, j) of a window covers pixels
    y1 + i*patch .. y1 + (i+1)*patch (and likewise in x) and its grid may reach past the window.
    encode(crops, spec, pos_interp=...) replaces `clip.encode_dense` (e.g. `clip.attention_maps` for the
    analysis, which then sees the windows and positional embeddings `encode_dense` would; and the region
    crops, as `regions=`, when `regions` is given; and the context, as `context=`, when there is one).
    context: passed to `clip.encode_dense` (the text a `feedback` term's first pass reads).
    regions: H x W integer region ids of `pixels` (-1 unsegmented), cropped like each window; padded
    pixels form one more region (CorrCLIP pads its masks with 10000), for specs that read regions.
    image_features: backbone name -> 1 x C x H x W whole-image features of `pixels` (`ext:NAME.image`), cropped
    like each window and padded by replicating the border (CorrCLIPv2), given to the taps through the context.
    """
    _, _, H, W = pixels.shape
    boxes = window_boxes(H, W, window, stride)
    left, right, top, bottom = window_padding(boxes[0], clip.patch_size, remainder, not window)
    for i in range(0, len(boxes), batch_size):
        chunk = boxes[i : i + batch_size]
        windows = torch.cat([pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
        crops = F.pad(windows, (left, right, top, bottom))
        crop_regions = None
        if regions is not None:
            crop_regions = torch.stack([regions[y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
            crop_regions = F.pad(crop_regions, (left, right, top, bottom), value=int(regions.max()) + 1)
        if image_features:
            crops_of = {name: pad_replicate(torch.cat([f[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk]), (left, right, top, bottom)) for name, f in image_features.items()}
            context = dict(context or {}, image_features=crops_of)
        if encode is not None:
            given = {**({"regions": crop_regions} if regions is not None else {}), **({"context": context} if context else {})}
            yield chunk, encode(crops, spec, pos_interp=pos_interp, **given)
        else:
            # ResCLIP's first pass upsamples to the whole window, also where `drop` cuts it to whole patches
            ctx = dict(context, windows=windows) if context and min(right, bottom) < 0 else context
            out = clip.encode_dense(crops, spec, token_stages, with_cls, pos_interp=pos_interp, context=ctx, regions=crop_regions)
            _told(i + len(chunk), len(boxes))
            yield (chunk, *out) if with_cls else (chunk, out)


def _told(done: int, total: int) -> None:
    listener = _WINDOW_LISTENER.get()
    if listener is not None:
        listener(done, total)


def pad_replicate(x: torch.Tensor, pad: tuple[int, int, int, int]) -> torch.Tensor:
    """F.pad (left, right, top, bottom) repeating the border for positive amounts; negative amounts cut."""
    x = F.pad(x, tuple(min(p, 0) for p in pad))
    return F.pad(x, tuple(max(p, 0) for p in pad), mode="replicate") if max(pad) > 0 else x


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
    window_stages: Sequence[Stage] = (),
    image_features: dict[str, torch.Tensor] | None = None,
    raw: bool = False,
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
    window_stages: windows stages (stages.py) run on all windows' patch cosines at once, before the
    upsampling (LPOSS's joint patch graph). image_features: whole-image backbone features (see
    `iter_window_features`). raw: the patch features unnormalised (with `text` the identity, the map is
    the dense feature map itself: CorrCLIPv2's bank values).
    """
    _, _, H, W = pixels.shape
    text = text.to(clip.device)
    match = [st for st in resolve_stages(spec.hooks) if st.kind == "match"]  # e.g. CLIP Surgery's
    boxes, cos = [], []
    context = {"text": text, "logit_scale": logit_scale, **({"raw_features": True} if raw else {})}
    windows = iter_window_features(
        clip, pixels, spec, window, stride, batch_size, token_stages, pos_interp, remainder, with_cls=bool(match), context=context, regions=regions,
        image_features=image_features,
    )
    for chunk, feats, *cls in windows:
        boxes += chunk
        window_cos = torch.einsum("bhwd,nd->bhwn", feats, text)
        for stage in match:  # match stages see B x N_names x h x w
            window_cos = stage(window_cos.permute(0, 3, 1, 2), cls[0], text).permute(0, 2, 3, 1)
        cos.append(window_cos)
    cos = torch.cat(cos)  # windows row-major over the grid of row and column intervals
    for stage in window_stages:  # B x h x w x N_names, every window of the image at once
        cos = stage(cos, boxes, pixels, clip.patch_size)
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


def resized_cosine(cos: torch.Tensor, out_size: tuple[int, int]) -> CosineMap:
    """An N x h x w map resized bilinearly to `out_size`, kept factored (no N x H x W map at that size):
    the map after a post stage that runs at the network input's size (LPOSS+'s pixel graph)."""
    _, h, w = cos.shape
    return _factored(cos.permute(1, 2, 0).contiguous(), _resize_matrix(h, out_size[0]), _resize_matrix(w, out_size[1]))


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
    _, _, H, W = pixels.shape
    encode = lambda crops, spec, pos_interp: clip.dense_tokens(crops, spec, token_stages, pos_interp)  # noqa: E731
    boxes, feats = [], []
    for chunk, f in iter_window_features(clip, pixels, spec, window, stride, batch_size, pos_interp=pos_interp, encode=encode):
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


def splice_windows(feats: torch.Tensor, corners: list[tuple[int, int]], grid: tuple[int, int]) -> torch.Tensor:
    """Trident's splice: window features W x h x w x C placed at their top-left patch corners on an
    image grid (H x W patches), overlaps averaged: H x W x C. Every cell must be covered."""
    total = GridSum(grid)
    total.add(feats, corners)
    return total.mean()


class GridSum:
    """Windows' features placed on an image grid and summed, with a count per cell, so windows can arrive
    a batch at a time; `mean()` averages the overlaps (the splice and OV-Stitcher's stitch)."""

    def __init__(self, grid: tuple[int, int]) -> None:
        self.grid = tuple(grid)
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, feats: torch.Tensor, corners: Sequence[tuple[int, int]]) -> None:
        """feats: W x h x w x C, window i's cells placed from corners[i] = (row, col) on."""
        _, h, w, C = feats.shape
        if self.total is None:
            self.total = feats.new_zeros(*self.grid, C)
            self.count = feats.new_zeros(*self.grid, 1)
        for f, (y, x) in zip(feats, corners):
            self.total[y : y + h, x : x + w] += f
            self.count[y : y + h, x : x + w] += 1

    def mean(self) -> torch.Tensor:
        """H x W x C, overlaps averaged; ValueError if a cell is not covered."""
        if self.count is None or bool((self.count == 0).any()):
            raise ValueError("windows do not cover the whole grid")
        return self.total / self.count


def grid_cosine(feats: torch.Tensor, text: torch.Tensor, out_size: tuple[int, int], via: tuple[int, int] | None = None) -> CosineMap:
    """Cosine of one h x w x D feature grid covering the whole image with N_names x D text, resized
    bilinearly (align_corners False) to `out_size`, as a CosineMap (Trident's logits on the SAM grid).
    via: resized to this size first, then to `out_size` (OV-Stitcher: the network input's, then the original)."""
    h, w, _ = feats.shape
    grid = torch.einsum("hwd,nd->hwn", feats, text.to(feats.device))
    ly, lx = _resize_matrix(h, out_size[0]), _resize_matrix(w, out_size[1])
    if via is not None:
        ly = _resize_matrix(via[0], out_size[0]) @ _resize_matrix(h, via[0])
        lx = _resize_matrix(via[1], out_size[1]) @ _resize_matrix(w, via[1])
    return _factored(grid, ly, lx)


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
