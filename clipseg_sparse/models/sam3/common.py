"""What both SAM 3 backends share: the answer to one text prompt, the Hub id, the input size, CLIP's BPE."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SAM3_HUB_ID = "facebook/sam3"
SAM3_RESOLUTION = 1008  # the processor's square input


@dataclass
class Sam3Prompt:
    """One text prompt's answer on one image, at the image's size (H x W).

    masks: n x H x W instance mask probabilities of the kept instances; scores: their n object scores
    (sigmoid(logit) x presence); semantic: H x W semantic-head probabilities; presence: the prompt's
    presence probability."""

    masks: torch.Tensor
    scores: torch.Tensor
    semantic: torch.Tensor
    presence: float


def clip_bpe_path() -> str:
    """CLIP's BPE vocabulary (open_clip's copy), which SAM 3's text tokenizer reads in both backends."""
    import open_clip

    return os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
