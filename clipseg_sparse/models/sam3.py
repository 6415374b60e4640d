"""SAM 3 (Meta, 2025; PyPI package `sam3`, extra `.[sam3]`): text-prompted masks for the `sam3` baseline
(`methods/sam3.py`) and the `--regions sam3` source (`segment/regions.py`).

`Sam3Prompter.prompt(state, name, confidence)` computes what SegEarth-OV3's patched processor returns
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
so the released model is built and run on a CUDA device only. Weights: `facebook/sam3` on the Hugging
Face Hub (gated: accept its licence, then `hf auth login`), cached, or a local `sam3.pt`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime.weights import WeightsUnavailableError, _weights_help, require_extra

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


class Sam3Prompter:
    """A SAM 3 image model behind the package's processor: `state = set_image(rgb)` once per image, then
    `prompt(state, name, confidence)` once per name (one text-conditioned decoder pass each)."""

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


def clip_bpe_path() -> str:
    """CLIP's BPE vocabulary (open_clip's copy), which SAM 3's text tokenizer reads."""
    import open_clip

    return os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")


def check_device(device: str | torch.device) -> None:
    """WeightsUnavailableError (one line) unless `device` is a CUDA device (see the module doc)."""
    if torch.device(device).type != "cuda":
        raise WeightsUnavailableError(f"SAM 3 runs on CUDA only (sam3 0.1.4 builds its model with CUDA calls); got device {device}: use --device cuda")


def load_sam3(weights: str | None = "hub", device: str | torch.device = "cuda") -> Sam3Prompter:
    """SAM 3's image model: weights "hub" (`facebook/sam3`, then the Hub cache), a local checkpoint file, or
    None / "none" (random weights). MissingExtraError without the package; WeightsUnavailableError (one
    line) when the weights cannot be had or the model cannot be built on `device` (CUDA only, see above)."""
    require_extra("sam3", "SAM 3 (preset sam3, --regions sam3)", extra="sam3")
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
    return Sam3Prompter(model, SAM3_HUB_ID if weights == "hub" else weights or "none", device)
