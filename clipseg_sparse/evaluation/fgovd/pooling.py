"""Region embeddings for FG-OVD: pooled dense features inside a box or mask, or a whole-crop encoding.

`pool` and `mask` describe a region by a coverage map at the resized image size (1 inside, 0 outside,
fractional at the edges); the map is summed over each window's patch cells, so every patch of every
sliding window gets the share of the region it covers. Where windows overlap, a pixel's share is split
evenly between them (the average `dense_cosine` takes). The region embedding is the weighted mean of
the L2-normalised patch features, re-normalised. With one window and a box that covers exactly one
patch cell this is that patch's feature.

`crop` follows the benchmark authors' CLIP study (FG-CLIP `extraction.py`): the box, enlarged about its
centre by a scale factor and clipped to the image, is cut out with integer bounds (floor of the
top-left, ceil of the bottom-right), then goes through the model's own preprocessing (resize of the
short side, centre crop, normalisation). Unmodified CLIP encodes it whole (`encode_image`, the CLS
embedding); an edited spec has no meaningful CLS token (ClearCLIP and NACLIP drop the residual that
carries it), so the crop is encoded densely with the spec and its patch features are averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import UserValueError
from ...attention import AttentionSpec
from ...segment.plan import ImageRun, Plan
from ...segment.settings import InferenceSettings
from ...segment.windows import iter_window_features
from ...models.clip import DenseCLIP
from .data import RegionAnnotation


def box_map(box: Sequence[float], scale: tuple[float, float], size: tuple[int, int]) -> torch.Tensor:
    """H x W coverage of a box (x, y, w, h in original pixels) drawn at `size` = (H, W).

    scale = (sy, sx) maps original pixels to resized ones. Pixel (i, j) gets the fraction of its unit
    square [i, i+1) x [j, j+1) inside the scaled box.
    """
    x, y, w, h = box
    sy, sx = scale

    def cover(lo: float, hi: float, n: int) -> torch.Tensor:
        edges = torch.arange(n, dtype=torch.float64)
        return (torch.minimum(edges + 1, torch.tensor(hi)) - torch.maximum(edges, torch.tensor(lo))).clamp(0, 1)

    return (cover(y * sy, (y + h) * sy, size[0])[:, None] * cover(x * sx, (x + w) * sx, size[1])[None]).float()


def mask_map(ann: RegionAnnotation, size: tuple[int, int]) -> torch.Tensor:
    """H x W coverage of the annotation's segmentation (polygons or RLE) at `size` = (H, W).

    pycocotools rasterises it at the declared image size; area averaging then gives each resized pixel
    the fraction of it that the mask covers.
    """
    from pycocotools import mask as mask_utils

    seg, h, w = ann.segmentation, ann.height, ann.width
    if seg is None:
        raise UserValueError(f"{ann.split} annotation id {ann.id} has no segmentation")
    if isinstance(seg, list):  # polygons
        rle = mask_utils.merge(mask_utils.frPyObjects(seg, h, w))
    elif isinstance(seg.get("counts"), list):  # uncompressed RLE
        rle = mask_utils.frPyObjects(seg, h, w)
    else:
        rle = seg
    mask = torch.from_numpy(mask_utils.decode(rle).astype(np.float32))
    if tuple(mask.shape) != tuple(size):
        mask = F.interpolate(mask[None, None], size=size, mode="area")[0, 0]
    return mask


@dataclass
class WindowFeatures:
    """The dense features of one (resized) image as its sliding windows saw them.

    boxes: (y1, y2, x1, x2) of each window in resized pixels; feats: n_windows x h x w x D, L2-normalised
    (windows zero-padded to whole patches, see `iter_window_features`); size: (H, W) of the resized image.
    """

    boxes: list[tuple[int, int, int, int]]
    feats: torch.Tensor
    size: tuple[int, int]
    patch_size: int

    @classmethod
    def compute(cls, clip: DenseCLIP, pixels: torch.Tensor, spec: AttentionSpec, settings: InferenceSettings) -> "WindowFeatures":
        # the windows at the exact positional-embedding grid and zero-padded remainders, whatever the settings say
        plan = Plan.of(spec, settings.replace(pos_interp="size", remainder="pad"))
        run = ImageRun(plan, clip, None, None, pixels, None, clip.proxies)
        boxes, feats = [], []
        for chunk, f in iter_window_features(run):
            boxes += chunk
            feats.append(f)
        return cls(boxes, torch.cat(feats), tuple(pixels.shape[-2:]), clip.patch_size)

    def patch_weights(self, maps: torch.Tensor) -> torch.Tensor:
        """Per-window patch weights n_windows x A x h x w of A regions; each region's weights sum to 1.

        maps: A x H x W region coverage at the resized size (see `box_map`, `mask_map`).
        """
        H, W = self.size
        ps = self.patch_size
        n, h, w, _ = self.feats.shape
        maps = maps.to(self.feats.device, torch.float32)
        count = torch.zeros(H, W, device=maps.device)
        for y1, y2, x1, x2 in self.boxes:
            count[y1:y2, x1:x2] += 1
        share = maps / count
        cells = torch.stack([F.pad(share[:, y1:y2, x1:x2], (0, w * ps - (x2 - x1), 0, h * ps - (y2 - y1))) for y1, y2, x1, x2 in self.boxes])
        weights = cells.view(n, -1, h, ps, w, ps).sum((3, 5))
        total = weights.sum((0, 2, 3))
        if (total <= 0).any():
            raise ValueError(f"region {int((total <= 0).nonzero()[0])} covers no pixel of the resized image")
        return weights / total.view(1, -1, 1, 1)

    def pool(self, maps: torch.Tensor) -> torch.Tensor:
        """A x D region embeddings: coverage-weighted mean of the patch features, L2-normalised."""
        return F.normalize(torch.einsum("nahw,nhwd->ad", self.patch_weights(maps), self.feats), dim=-1)


def crop_box(box: Sequence[float], scale_factor: float, width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) integer crop of an x, y, w, h box enlarged by scale_factor about its centre.

    The FG-CLIP rule: shift the corner by floor((new - old) / 2), clip to the image, floor the top-left
    and ceil the bottom-right.
    """
    x, y, w, h = box
    new_w, new_h = w * scale_factor, h * scale_factor
    left, top = x - (new_w - w) // 2, y - (new_h - h) // 2
    right, bottom = left + new_w, top + new_h
    return (
        math.floor(max(left, 0)),
        math.floor(max(top, 0)),
        math.ceil(min(right, width)),
        math.ceil(min(bottom, height)),
    )


def crop_transform(clip: DenseCLIP):
    """The model's own evaluation preprocessing (PIL image -> 3 x S x S tensor)."""
    import open_clip

    cfg = clip.visual.preprocess_cfg
    return open_clip.image_transform(
        cfg["size"],
        is_train=False,
        mean=cfg["mean"],
        std=cfg["std"],
        resize_mode=cfg.get("resize_mode"),
        interpolation=cfg.get("interpolation"),
        fill_color=cfg.get("fill_color", 0),
    )


@torch.inference_mode()
def encode_crops(
    clip: DenseCLIP, image: np.ndarray, boxes: Sequence[Sequence[float]], spec: AttentionSpec, scale_factor: float = 1.0, batch_size: int = 16
) -> torch.Tensor:
    """A x D L2-normalised embeddings of box crops of an H x W x 3 uint8 image (see the module notes)."""
    from PIL import Image

    pil = Image.fromarray(image)
    transform = crop_transform(clip)
    height, width = image.shape[:2]
    crops = torch.stack([transform(pil.crop(crop_box(b, scale_factor, width, height))) for b in boxes])
    out = []
    for i in range(0, len(crops), batch_size):
        batch = crops[i : i + batch_size].to(clip.device, clip.dtype)
        if spec.is_identity:
            out.append(clip.model.encode_image(batch).float())
        else:
            out.append(clip.encode_dense(batch, spec).mean((1, 2)))
    return F.normalize(torch.cat(out), dim=-1)
