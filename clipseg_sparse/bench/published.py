"""Side-by-side with the published way of running the same model: the sliding-window loop (bf16 against
fp32 is in precision.py).

published  mmseg's `slide_inference` as the training-free repositories (SCLIP, ClearCLIP, NACLIP) run it:
           one window per forward, each window's logits upsampled bilinearly to the window and added
           into a classes x H x W buffer with a count map, divided, resized to the image, softmax,
           max over synonyms, argmax. Ours: batched windows and one separable product (dense_cosine).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .timing import BenchRow, best_ms
from ..segment.labels import class_probabilities, probabilities_to_labels
from ..segment.preprocess import prepare, window_boxes
from ..segment.segmenter import Segmenter


@torch.inference_mode()
def published_slide_labels(seg: Segmenter, rgb: np.ndarray) -> np.ndarray:
    """H x W labels computed the published way (see the module doc) with `seg`'s model, text and settings."""
    clip, s = seg.clip, seg.settings
    height, width = rgb.shape[:2]
    pixels = prepare(rgb, clip, s, resize="torch", multiple=0)  # the loop as it was always timed: float resize, unrounded
    size = tuple(pixels.shape[-2:])
    text = seg.text.to(clip.device, clip.dtype)
    ps = clip.patch_size
    preds = torch.zeros(1, text.shape[0], *size, device=clip.device)
    count = torch.zeros(1, 1, *size, device=clip.device)
    for y1, y2, x1, x2 in window_boxes(*size, s.window, s.stride):
        crop = pixels[..., y1:y2, x1:x2]
        pad_h, pad_w = -crop.shape[-2] % ps, -crop.shape[-1] % ps
        feats = clip.encode_dense(F.pad(crop, (0, pad_w, 0, pad_h)), seg.spec)  # 1 x h x w x D
        logits = (feats @ text.T).permute(0, 3, 1, 2).float()  # 1 x N x h x w
        logits = F.interpolate(logits, size=(feats.shape[1] * ps, feats.shape[2] * ps), mode="bilinear", align_corners=False)
        preds[..., y1:y2, x1:x2] += logits[..., : y2 - y1, : x2 - x1]
        count[..., y1:y2, x1:x2] += 1
    cosine = F.interpolate(preds / count, size=(height, width), mode="bilinear", align_corners=False)[0]
    probs = class_probabilities(cosine * s.logit_scale, seg.vocabulary.name_to_class, len(seg.vocabulary))
    return probabilities_to_labels(probs, s.bg_threshold, s.area_threshold).cpu().numpy()


def bench_published_windows(seg: Segmenter, images: Sequence[np.ndarray], repeat: int = 2) -> tuple[list[BenchRow], float]:
    """Ours (Segmenter.predict_labels, reference) vs the published loop on the same images; returns the
    rows (ratio > 1: the published loop is slower) and the fraction of pixels whose labels agree."""
    runs = {
        "ours (batched windows, separable resize)": lambda: [seg.predict_labels(im) for im in images],
        "published (one window per forward, mmseg slide_inference)": lambda: [published_slide_labels(seg, im) for im in images],
    }
    times = best_ms(runs, repeat, seg.clip.device)
    agree = np.mean([np.mean(seg.predict_labels(im) == published_slide_labels(seg, im)) for im in images])
    ref = next(iter(runs))
    n = len(images)
    case = (
        f"{seg.clip.model_name} {n} images {images[0].shape[0]}x{images[0].shape[1]}, {len(seg.vocabulary)} classes, "
        f"{seg.settings.resolution}px, {seg.spec} ({n / times[ref] * 1e3:.2f} img/s; labels agree {100 * agree:.3f}%)"
    )
    return [BenchRow("windows", case, name, ms, ms / times[ref], ref) for name, ms in times.items()], float(agree)

