"""Cosine maps at the output size, kept factored: no N_names x H x W tensor is made until a band is asked for.

Bilinear upsampling, placing windows and averaging their overlaps are linear and separable, so the whole
N_names x H x W map is Ly @ G @ Lx^T of a small grid G (the windows' patch maps, or one grid covering the
image): `CosineMap` computes any band of rows alone, bit-identical to the same rows of the whole map.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from ..models.backbones import resize_matrix


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


def factored(grid: torch.Tensor, ly: torch.Tensor, lx: torch.Tensor) -> CosineMap:
    """The CosineMap Ly @ grid @ Lx^T of an R x K x N grid (ly: out_h x R, lx: out_w x K)."""
    out_h = ly.shape[0]
    to = dict(device=grid.device, dtype=grid.dtype)
    rows_from = F.pad(ly, (0, 0, 0, -out_h % ROW_BLOCK))  # whole blocks of rows
    return CosineMap(grid.contiguous(), rows_from.to(**to), lx.to(**to), out_h)


def resized_cosine(cos: torch.Tensor, out_size: tuple[int, int]) -> "ResizedMap":
    """An N x h x w map resized bilinearly (align_corners False) to `out_size`, rows on demand (no N x H x W
    map at that size): the map after a stage that runs at the network input's size (retrieval, LPOSS+'s pixel
    graph)."""
    _, h, w = cos.shape
    return ResizedMap(cos.permute(1, 2, 0).contiguous(), _two_taps(h, out_size[0]), _two_taps(w, out_size[1]))


def _two_taps(src: int, dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`resize_matrix`'s rows as (dst x 2 source indices, ascending; dst x 2 weights): linear resizing reads
    at most two neighbours (one at the ends, its second weight 0)."""
    matrix = resize_matrix(src, dst)
    if src == 1:
        return torch.zeros(dst, 2, dtype=torch.int64), torch.cat([matrix, torch.zeros_like(matrix)], dim=1)
    index = matrix.topk(2, dim=1).indices.sort(dim=1).values
    return index, matrix.gather(1, index)


@dataclass(frozen=True)
class ResizedMap:
    """N x H x W bilinear resize of a map held at a smaller size (h x w x N, names last), with CosineMap's
    interface. Each output value is a 2 x 2 weighted sum, computed per band as two passes of two gathered
    taps: about 4 multiply-adds a value, where CosineMap's dense factors would cost h + w (a 448 x 597 map to
    480 x 640 at 150 names: 2.4 s of matrix products). Rows are independent, so any band equals the same rows
    of the whole map bit for bit."""

    values: torch.Tensor  # h x w x N
    row_taps: tuple[torch.Tensor, torch.Tensor]  # (H x 2 indices into h, H x 2 weights)
    col_taps: tuple[torch.Tensor, torch.Tensor]  # (W x 2 indices into w, W x 2 weights)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.values.shape[2], self.row_taps[0].shape[0], self.col_taps[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.values.device

    def scaled(self, factor: float) -> "ResizedMap":
        return dataclasses.replace(self, values=self.values * factor)

    def rows(self, y0: int, y1: int) -> torch.Tensor:
        """N x (y1 - y0) x W, a fresh tensor seen through a view of a (y1 - y0) x W x N tensor (as CosineMap.rows)."""
        (ri, rw), (ci, cw) = ((i.to(self.device), w.to(self.values)) for i, w in (self.row_taps, self.col_taps))
        ri, rw = ri[y0:y1], rw[y0:y1, :, None, None]
        band = (torch.index_select(self.values, 0, ri[:, 0]) * rw[:, 0]).addcmul_(torch.index_select(self.values, 0, ri[:, 1]), rw[:, 1])
        out = torch.index_select(band, 1, ci[:, 0]).mul_(cw[None, :, 0, None])  # band: (y1 - y0) x w x N
        return out.addcmul_(torch.index_select(band, 1, ci[:, 1]), cw[None, :, 1, None]).permute(2, 0, 1)

    def pieces(self, y0: int, y1: int) -> Iterator[tuple[int, torch.Tensor]]:
        """CosineMap.pieces' interface: the band itself, one piece (rows are independent)."""
        yield y0, self.rows(y0, y1)


def grid_cosine(feats: torch.Tensor, text: torch.Tensor, out_size: tuple[int, int], via: tuple[int, int] | None = None) -> CosineMap:
    """Cosine of one h x w x D feature grid covering the whole image with N_names x D text, resized
    bilinearly (align_corners False) to `out_size`, as a CosineMap (Trident's logits on the SAM grid).
    via: resized to this size first, then to `out_size` (OV-Stitcher: the network input's, then the original)."""
    h, w, _ = feats.shape
    grid = torch.einsum("hwd,nd->hwn", feats, text.to(feats.device))
    ly, lx = resize_matrix(h, out_size[0]), resize_matrix(w, out_size[1])
    if via is not None:
        ly = resize_matrix(via[0], out_size[0]) @ resize_matrix(h, via[0])
        lx = resize_matrix(via[1], out_size[1]) @ resize_matrix(w, via[1])
    return factored(grid, ly, lx)

