"""Cosine maps -> class probabilities -> labels, a band of rows at a time, with SCLIP's background rules.

Probabilities are softmax(logit_scale x cosine) over all names, then the max over each class's synonyms;
class 0 is the background class of the `bg_threshold` and `area_threshold` rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import UserValueError
from .maps import BAND_ELEMENTS, CosineMap, DenseMap, row_bands


class NonFiniteScores(UserValueError):
    """An image whose class scores became NaN or infinite (a spec value or threshold that leaves no finite
    attention score): the image fails, and no label or probability of it is recorded."""


def _check_finite(values: torch.Tensor) -> None:
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteScores("its class scores are not finite (NaN or inf): the spec leaves no finite score "
                              "(a threshold that masks every score, or a value out of range); nothing was recorded")


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
            best = logits.argmax(0)  # a NaN wins the argmax, so a non-finite column shows in its top value
            _check_finite(logits.gather(0, best[None]))
            return names[best]
        top_all = logits.amax(0)
        _check_finite(top_all)  # amax propagates NaN
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
            _check_finite(probs)
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
