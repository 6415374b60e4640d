"""The sam3 package's backend (PyPI `sam3` 0.1.4, extra `.[sam3-package]`; CUDA only): the model Meta
released the code with, kept beside the transformers backend (`hf.py`) to show the two agree.

`PackagePrompter.prompt(state, name, confidence)` computes what SegEarth-OV3's patched processor returns
(earth-insights/SegEarth-OV-3@87e5cc1: `sam3/model/sam3_image_processor.py::_forward_grounding`, which adds
`semantic_mask_logits`, `presence_score` and `object_score` to the package's), from the unpatched
package's `Sam3Image.forward_grounding` outputs:
- presence = sigmoid(presence_logit_dec), one scalar per prompt;
- object scores = sigmoid(pred_logits) x presence; instances kept where the score > confidence;
- instance masks = sigmoid(pred_masks resized bilinearly to the image's size);
- semantic map = sigmoid(semantic_seg resized bilinearly to the image's size).
The image goes in at its original size; the package's `Sam3Processor.set_image` resizes it to 1008 x 1008
(torchvision's antialiased resize of the uint8 image) and normalises with mean = std = 0.5.

Facts of sam3 0.1.4 (read from its wheel): the wheel lacks the BPE vocabulary its builder points to
(`assets/bpe_simple_vocab_16e6.txt.gz`); CLIP's file is that vocabulary (open_clip's copy is byte-identical
to the one SegEarth-OV3 ships) and is used here. Its model constructors allocate on CUDA (the 1008-px
position-encoding cache, the decoder's coordinate cache) and its geometry encoder calls `pin_memory()`,
so the released model is built and run on a CUDA device only. It pins huggingface-hub < 2 and numpy < 2.4.
Weights: a local `sam3.pt`, or `facebook/sam3` on the Hugging Face Hub (gated).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import UserValueError
from ...runtime.weights import WeightsUnavailableError, _weights_help, require_extra
from .common import SAM3_HUB_ID, SAM3_RESOLUTION, Sam3Prompt, clip_bpe_path


class PackagePrompter:
    """A SAM 3 image model behind the package's processor: `state = set_image(rgb)` once per image, then
    `prompt(state, name, confidence)` once per name (one text-conditioned decoder pass each)."""

    backend = "package"

    def __init__(self, model: torch.nn.Module, weights: str = "none", device: str | torch.device = "cpu", resolution: int = SAM3_RESOLUTION) -> None:
        from sam3.model.sam3_image_processor import Sam3Processor

        self.model = model.eval()
        self.weights = weights
        self.device = torch.device(device)
        self.processor = Sam3Processor(self.model, resolution=resolution, device=str(self.device))

    def config(self) -> dict:
        """What identifies the model in a result file."""
        return {"model": "sam3", "pretrained": self.weights, "device": str(self.device)}

    @torch.inference_mode()
    def set_image(self, rgb: np.ndarray) -> dict:
        """The processor's state for an H x W x 3 uint8 RGB image (its backbone features)."""
        from PIL import Image

        with self._autocast():
            return self.processor.set_image(Image.fromarray(np.ascontiguousarray(rgb)))

    def _autocast(self):
        """bf16 autocast on CUDA, as SegEarth-OV3 runs the whole view (a no-op elsewhere)."""
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    @torch.inference_mode()
    def prompt(self, state: dict, name: str, confidence: float) -> Sam3Prompt:
        """One text prompt on the image of `state` (SegEarth-OV3's `_forward_grounding`, see the module doc)."""
        model, processor = self.model, self.processor
        processor.reset_all_prompts(state)
        size = (state["original_height"], state["original_width"])
        with self._autocast():
            state["backbone_out"].update(model.backbone.forward_text([name], device=str(self.device)))
            out = model.forward_grounding(
                backbone_out=state["backbone_out"], find_input=processor.find_stage, geometric_prompt=model._get_dummy_prompt(), find_target=None
            )
            presence = out["presence_logit_dec"].sigmoid().unsqueeze(1)  # 1 x 1 x 1
            scores = (out["pred_logits"].sigmoid() * presence).squeeze(-1)  # 1 x Q
            keep = scores > confidence
            masks = F.interpolate(out["pred_masks"][keep].unsqueeze(1), size=size, mode="bilinear", align_corners=False).sigmoid()
            semantic = F.interpolate(out["semantic_seg"], size=size, mode="bilinear", align_corners=False).sigmoid()
        return Sam3Prompt(masks[:, 0].float(), scores[keep].float(), semantic[0, 0].float(), float(presence.squeeze()))


    def prompts(self, state: dict, names, confidence: float) -> list[Sam3Prompt]:
        """Each name's answer, one decoder pass per name (the package takes one text prompt at a time)."""
        return [self.prompt(state, name, confidence) for name in names]

    def normalized(self, normalizer: str | None):
        """Only SDPA's softmax here: a normalizer inside the detector needs the transformers backend."""
        if normalizer is not None:
            raise UserValueError(f"normalizer {normalizer} inside SAM 3 runs on the transformers backend only (the default); the package backend has none")
        return contextlib.nullcontext()


def init_unloaded(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give random values to the parameters sam3 0.1.4 leaves uninitialised (`torch.empty`) until a
    checkpoint fills them: the text encoder's positional embedding and projection (normal, std 0.02,
    seeded); for random-weight models only."""
    encoder = model.backbone.language_backbone.encoder
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (encoder.positional_embedding, encoder.text_projection):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def check_device(device: str | torch.device) -> None:
    """WeightsUnavailableError (one line) unless `device` is a CUDA device (see the module doc)."""
    if torch.device(device).type != "cuda":
        raise WeightsUnavailableError(f"SAM 3 runs on CUDA only (sam3 0.1.4 builds its model with CUDA calls); got device {device}: use --device cuda")


def load_sam3_package(weights: str | None = "hub", device: str | torch.device = "cuda") -> PackagePrompter:
    """SAM 3's image model: weights "hub" (`facebook/sam3`, then the Hub cache), a local checkpoint file, or
    None / "none" (random weights). MissingExtraError without the package; WeightsUnavailableError (one
    line) when the weights cannot be had or the model cannot be built on `device` (CUDA only, see above)."""
    require_extra("sam3", "SAM 3's package backend", extra="sam3-package")
    from sam3.model_builder import build_sam3_image_model, download_ckpt_from_hf

    device = torch.device(device)
    weights = None if weights in (None, "", "none") else weights
    if weights is not None and weights != "hub" and not os.path.isfile(weights):
        raise WeightsUnavailableError(f"{weights}: SAM 3 checkpoint file not found (give sam3.pt, 'hub' or 'none')")
    check_device(device)
    path = None
    if weights == "hub":
        try:
            path = download_ckpt_from_hf()
        except Exception as e:  # offline, gated and not logged in, not cached
            raise WeightsUnavailableError(_weights_help(f"SAM 3 ({SAM3_HUB_ID}, gated)", "hub", "--proxy-weights sam3=")) from e
    elif weights is not None:
        path = weights
    model = build_sam3_image_model(bpe_path=clip_bpe_path(), device=device.type, checkpoint_path=path, load_from_HF=False)
    if path is None:
        init_unloaded(model)
    return PackagePrompter(model, SAM3_HUB_ID if weights == "hub" else weights or "none", device)
