"""The plain sliding windows (mmseg's slide inference) and the forward that runs them (`windows`).

Each window goes through CLIP alone; its patch map is upsampled bilinearly to the window and the windows'
maps are averaged where they overlap. That is linear and separable, so the whole map is a `maps.CosineMap`
of the small grid of all windows' patch maps (`dense_cosine`), and no names x pixels tensor is ever made.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..attention.taps import attention_grid
from .maps import CosineMap, factored, resize_matrix
from .plan import FORWARDS, AttentionWindow, Forward, ImageRun
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
    run: ImageRun, encode: Callable[..., torch.Tensor] | None = None, with_cls: bool = False, window: int | None = None
) -> Iterator[tuple]:
    """Dense features of the sliding windows of the run's network input, one batch at a time.

    Yields (window boxes (y1, y2, x1, x2), B x h x w x D features), plus the windows' B x D CLS
    embeddings when `with_cls`. Windows (`window`: default the settings'; 0 = the whole image) whose sides
    are not multiples of the patch size follow the settings' `remainder` (see `window_geometry`); with the
    default, pad, they are zero-padded at the bottom and right, so patch (i, j) of a window covers pixels
    y1 + i*patch .. y1 + (i+1)*patch (and likewise in x) and its grid may reach past the window.
    encode(crops, spec, pos_interp=..., regions=..., context=...) replaces `clip.encode_dense` (e.g.
    `clip.attention_maps` for the analysis, which then sees the windows, positional embeddings, region crops
    and context `encode_dense` would). The run's region map is cropped like each window (padded pixels form
    one more region: CorrCLIP pads its masks with 10000), its whole-image features of `ext:NAME.image` taps
    cropped like each window and padded by replicating the border (CorrCLIPv2), both given to the taps; the
    settings' token stages run before the edited blocks (the spec's own run inside the encoder).
    """
    clip, pixels, s = run.clip, run.pixels, run.settings
    window = s.window if window is None else window
    _, _, H, W = pixels.shape
    boxes = window_boxes(H, W, window, s.stride)
    left, right, top, bottom = window_padding(boxes[0], clip.patch_size, s.remainder, not window)
    regions, context, image_features = run.regions, run.context(), run.image_features
    token_stages = run.plan.added_token_stages()
    for i in range(0, len(boxes), s.batch_size):
        chunk = boxes[i : i + s.batch_size]
        windows = torch.cat([pixels[..., y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
        crops = F.pad(windows, (left, right, top, bottom))
        crop_regions = None
        if regions is not None:
            crop_regions = torch.stack([regions[y1:y2, x1:x2] for y1, y2, x1, x2 in chunk])
            crop_regions = F.pad(crop_regions, (left, right, top, bottom), value=int(regions.max()) + 1)
        if image_features:
            crops_of = {name: f.windows(chunk, (left, right, top, bottom)) for name, f in image_features.items()}
            context = dict(context, image_features=crops_of)
        if encode is not None:
            yield chunk, encode(crops, run.spec, pos_interp=s.pos_interp, regions=crop_regions, context=context)
        else:
            # ResCLIP's first pass upsamples to the whole window, also where `drop` cuts it to whole patches
            ctx = dict(context, windows=windows) if min(right, bottom) < 0 else context
            out = clip.encode_dense(crops, run.spec, token_stages, with_cls, pos_interp=s.pos_interp, context=ctx, regions=crop_regions)
            _told(i + len(chunk), len(boxes))
            yield (chunk, *out) if with_cls else (chunk, out)


def _told(done: int, total: int) -> None:
    listener = _WINDOW_LISTENER.get()
    if listener is not None:
        listener(done, total)


def dense_cosine(run: ImageRun, out_size: tuple[int, int] | None = None) -> CosineMap:
    """Cosine between the windows' patch features and each text embedding, N_names x H x W at the network
    input's size (or at `out_size`, as if that map were then resized bilinearly), as a CosineMap (rows on
    demand).

    Windows run as batches of `batch_size` through the model; each window's patch map is upsampled
    bilinearly to the window (by default zero-padded up to a multiple of the patch size, then cropped;
    `remainder` and `pos_interp` as in `iter_window_features`) and the overlaps are averaged. Bilinear
    resizing is separable and linear, and the windows form a grid of row and column intervals, so upsample ->
    place -> average -> resize is one product per name, Ly @ G @ Lx^T, with G the grid of all windows' patch
    maps (rows*h x cols*w per name) and Ly, Lx small interpolation matrices: no per-window work or
    window-sized temporaries beyond the model call, and any band of rows is a band of Ly's rows, which is what
    CosineMap uses. The run's match stages (CLIP Surgery's) rewrite each window's cosine map before that, its
    windows stages (LPOSS's joint patch graph) all windows' patch cosines at once. With `run.raw` the patch
    features stay unnormalised (with `run.text` the identity, the map is the dense feature map itself:
    CorrCLIPv2's bank values).
    """
    text = run.text.to(run.clip.device)
    match = run.plan.of_kind("match")
    boxes, cos = [], []
    for chunk, feats, *cls in iter_window_features(run, with_cls=bool(match)):
        boxes += chunk
        window_cos = torch.einsum("bhwd,nd->bhwn", feats, text)
        for stage in match:  # match stages see B x N_names x h x w
            window_cos = stage(window_cos.permute(0, 3, 1, 2), cls[0], text).permute(0, 2, 3, 1)
        cos.append(window_cos)
    return window_cosine_map(run, boxes, torch.cat(cos), out_size)


def window_cosine_map(run: ImageRun, boxes: Sequence[tuple[int, int, int, int]], cos: torch.Tensor, out_size: tuple[int, int] | None = None) -> CosineMap:
    """Every window's B x h x w x N_names patch cosine (windows row-major over the grid of row and column
    intervals, as `window_boxes` lists them; h x w CLIP's patch grid or a finer one) -> the image's CosineMap
    (see `dense_cosine`): the run's windows stages first, then each window's map upsampled, placed and
    averaged as one product per name. For forwards whose windows are not each encoded alone (GLA-CLIP's
    keys and values from every window, ITACLIP's views)."""
    clip, s = run.clip, run.settings
    _, _, H, W = run.pixels.shape
    for stage in run.plan.of_kind("windows"):  # B x h x w x N_names, every window of the image at once
        cos = stage(cos, boxes, run)
    rows = sorted({(y1, y2) for y1, y2, _, _ in boxes})
    cols = sorted({(x1, x2) for _, _, x1, x2 in boxes})
    _, h, w, n = cos.shape
    grid = cos.view(len(rows), len(cols), h, w, n).permute(0, 2, 1, 3, 4).reshape(len(rows) * h, len(cols) * w, n)
    out_h, out_w = out_size or (H, W)
    # a window's map covers the window's encoded pixels (`window_geometry`): h x w patches of CLIP, or
    # the finer grid of an external backbone's attention (ProxyCLIP's DINO B/8 gives 2h x 2w)
    _, top, _, up_h = window_geometry(rows[0][1] - rows[0][0], clip.patch_size, s.remainder, not s.window)
    _, left, _, up_w = window_geometry(cols[0][1] - cols[0][0], clip.patch_size, s.remainder, not s.window)
    ly = _window_interpolation(rows, H, h, up_h, top, out_h)
    lx = _window_interpolation(cols, W, w, up_w, left, out_w)
    return factored(grid, ly, lx)


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


def _window_interpolation(
    spans: list[tuple[int, int]], size: int, patches: int, upsampled: int, offset: int, out: int
) -> torch.Tensor:
    """out x (len(spans) * patches): upsample each window's `patches` to `upsampled` pixels, keep the
    window's rows from `offset` on, place them at its span, average where spans overlap, then resize
    `size` -> `out` (all along one axis)."""
    up = resize_matrix(patches, upsampled)[offset:]
    place = torch.zeros(size, len(spans) * patches)
    coverage = torch.zeros(size, 1)
    for i, (a, b) in enumerate(spans):
        place[a:b, i * patches : (i + 1) * patches] = up[: b - a]
        coverage[a:b] += 1
    place /= coverage
    return place if out == size else resize_matrix(size, out) @ place


class WindowsForward(Forward):
    """mmseg's slide inference: each window through CLIP alone (token and match stages inside), the
    windows' patch cosines averaged where they overlap (windows stages see them all first)."""

    name = "windows"
    kinds = frozenset({"token", "match", "windows", "retrieval"})

    def cosine(self, run: "ImageRun") -> CosineMap:
        return dense_cosine(run, run.out_size)

    def attention(self, run: "ImageRun", whole_image: bool = False) -> Iterator[AttentionWindow]:
        s, clip = run.settings, run.clip
        window = 0 if whole_image else s.window
        for boxes, maps in iter_window_features(run, encode=clip.attention_maps, window=window):
            for box, window_maps in zip(boxes, maps):
                pad = window_padding(box, clip.patch_size, s.remainder, not window)
                crop = (box[1] - box[0] + pad[2] + pad[3], box[3] - box[2] + pad[0] + pad[1])
                grid = attention_grid(run.spec, crop, (crop[0] // clip.patch_size, crop[1] // clip.patch_size))
                yield AttentionWindow(box, pad, grid, window_maps)


FORWARDS.register("windows", WindowsForward(), help="sliding windows, each alone, maps averaged where they overlap (mmseg's slide inference)")
