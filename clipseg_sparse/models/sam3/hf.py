"""SAM 3 through transformers (5.x: `Sam3Model`, `Sam3Processor`): the default backend of every SAM 3
pipeline (`--preset sam3`, `--regions sam3`), on any device (CPU, CUDA, MPS), fp32 or bf16.

`TransformersPrompter` answers what the sam3 package's processor answers with SegEarth-OV3's patch
(`package.py`: presence, object scores, instance and semantic masks per text prompt), with
`Sam3Model.forward` run in its stages so that one image encoding serves every prompt and the prompts go
through the detector `bucket` at a time (the answer of a prompt does not depend on its bucket).

Two facts that make it equal to the sam3 package (measured on one random configuration whose weights were
copied into both: presence 6e-8, object scores 1.2e-7, instance masks 1.1e-6, semantic map 4.5e-7):
- the package's prompt is the text tokens plus the geometry encoder's CLS token (its empty box prompt runs
  `SequenceGeometryEncoder(add_cls=True)`); `Sam3Model` called with text only skips the geometry encoder.
  `prompt_features` passes one padded box (label -10, masked out), on which transformers appends the same
  token; without it the mask logits differ by ~0.3 on a random model.
- the package resizes the mask and semantic LOGITS to the image, then takes the sigmoid; transformers'
  `post_process_*` take the sigmoid first. `answers` follows the package.
Under CPU autocast torchvision's `roi_align` (the geometry encoder's box pooling) refuses bf16, so that
small encoder runs in fp32 outside autocast (its only box is masked).
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import os
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...runtime.weights import WeightsUnavailableError, require_extra
from .common import SAM3_HUB_ID, SAM3_RESOLUTION, Sam3Prompt, clip_bpe_path
from .attention import DEFAULT_SITES, record_attention, set_normalizer

BUCKET = 16  # prompts per detector pass on one image encoding


class TransformersPrompter:
    """A `Sam3Model` and its `Sam3Processor`: `state = set_image(rgb)` once per image, then
    `prompts(state, names, confidence)` (or `prompt` for one name). `normalized(normalizer)` puts a
    normalizer into the detector's attention for the calls inside it (`attention.py`)."""

    backend = "transformers"

    def __init__(self, model: torch.nn.Module, processor, weights: str = "none", device: str | torch.device = "cpu", precision: str = "fp32", bucket: int = BUCKET) -> None:
        self.model = model.eval()
        self.processor = processor
        self.weights = weights
        self.device = torch.device(device)
        self.precision = precision
        self.bucket = bucket
        self.context_length = int(model.config.text_config.max_position_embeddings)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16 autocast on CUDA (SegEarth-OV3 runs the whole view so) and wherever --precision bf16 asks for it."""
        return torch.bfloat16 if self.precision == "bf16" or self.device.type == "cuda" else None

    def config(self) -> dict:
        """What identifies the model in a result file."""
        dtype = self.autocast_dtype
        return {"model": "sam3", "pretrained": self.weights, "device": str(self.device), "backend": self.backend,
                "precision": "bf16-autocast" if dtype is not None else "fp32"}  # fmt: skip

    def _autocast(self):
        dtype = self.autocast_dtype
        return torch.autocast(device_type=self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    @torch.inference_mode()
    def set_image(self, rgb: np.ndarray, size: int | None = None) -> dict:
        """The image's encoding (the vision encoder's features, reused by every prompt) and its size. `size`:
        encode the image squashed to size x size px instead of the processor's own (ActiveSAM's 672-px
        presence preview); the ViT's global layers then get RoPE positions for that grid (`vit_grid`)."""
        rgb = np.ascontiguousarray(rgb)
        resize = {} if size is None else {"size": {"height": size, "width": size}}
        pixels = self.processor(images=rgb, return_tensors="pt", **resize).pixel_values.to(self.device)
        with self._autocast(), vit_grid(self.model, pixels.shape[-1]):
            vision = self.model.get_vision_features(pixel_values=pixels.to(next(self.model.parameters()).dtype))
        return {"vision": vision, "size": tuple(rgb.shape[:2])}

    def tokens(self, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask of `names`, padded to SAM 3's text context."""
        tok = self.processor.tokenizer(list(names), padding="max_length", max_length=self.context_length, truncation=True, return_tensors="pt")
        return tok.input_ids.to(self.device), tok.attention_mask.to(self.device)

    @torch.inference_mode()
    def run(self, state: dict, names: Sequence[str], with_masks: bool = True, extra=None) -> dict:
        """The raw outputs of one bucket of prompts on the image of `state` (`run_prompts`; `extra`: context
        tokens appended to each prompt's text, see `prompt_features`)."""
        ids, mask = self.tokens(names)
        with self._autocast():
            return run_prompts(self.model, state["vision"], ids, mask, with_masks=with_masks, extra=extra)

    def prompts(self, state: dict, names: Sequence[str], confidence: float) -> list[Sam3Prompt]:
        """Each name's answer (`models.sam3.Sam3Prompt`, at the image's size), `bucket` names per pass."""
        got: list[Sam3Prompt] = []
        for start in range(0, len(names), self.bucket):
            got += answers(self.run(state, names[start : start + self.bucket]), state["size"], confidence)
        return got

    def prompt(self, state: dict, name: str, confidence: float) -> Sam3Prompt:
        """One text prompt's answer."""
        return self.prompts(state, [name], confidence)[0]

    @contextlib.contextmanager
    def normalized(self, normalizer: str | None, sites: Sequence[str] = DEFAULT_SITES) -> Iterator[None]:
        """The detector's attention at `sites` normalised by `normalizer` inside the block (None: SDPA)."""
        if normalizer is None:
            yield
            return
        set_normalizer(self.model, normalizer, sites)
        try:
            yield
        finally:
            set_normalizer(self.model, None, sites)

    def attention(self, sites: Sequence[str] = ("decoder-image",)):
        """`record_attention` on this model (inside `normalized`)."""
        return record_attention(self.model, sites)


# -- Sam3Model.forward in stages ---------------------------------------------------------------------------------
def _expand(t: torch.Tensor, k: int) -> torch.Tensor:
    return t if t.shape[0] == k else t.expand(k, *t.shape[1:])


@contextlib.contextmanager
def _fp32(module: torch.nn.Module) -> Iterator[None]:
    """Run `module` with fp32 parameters (a no-op when they are)."""
    dtype = next(module.parameters()).dtype
    if dtype == torch.float32:
        yield
        return
    module.float()
    try:
        yield
    finally:
        module.to(dtype)


@contextlib.contextmanager
def vit_grid(model, pixels: int) -> Iterator[None]:
    """The ViT's global-attention layers with RoPE positions for a `pixels`-px square input (a no-op at the
    configured size). transformers precomputes them for config.image_size only (another grid fails on a shape
    mismatch); `Sam3ViTLayer.precompute_positions` for the new grid scales them by window / side, which is
    ActiveSAM's `rope_patch` (sam3's `compute_axial_cis` with scale_pos = rope_pt_size / side, rope_pt_size
    being the window): the same rotation angles."""
    config = model.vision_encoder.backbone.config
    if pixels == config.image_size:
        yield
        return
    grid = copy.copy(config)
    grid.image_size = pixels
    layers = [layer for layer in model.vision_encoder.backbone.layers if layer.window_size == 0]
    saved = [layer.position_ids for layer in layers]
    for layer in layers:
        layer.position_ids = layer.precompute_positions(grid, 0).to(layer.position_ids.device)
    try:
        yield
    finally:
        for layer, ids in zip(layers, saved):
            layer.position_ids = ids


@contextlib.contextmanager
def shortened_decoder(model, layers: int, queries: int | None = None) -> Iterator[None]:
    """The DETR decoder with its first `layers` layers and (queries) its first `queries` object queries and
    reference boxes, restored after (ActiveSAM's cheap presence preview; the presence token is kept)."""
    decoder = model.detr_decoder
    saved = decoder.layers, decoder.query_embed, decoder.reference_points
    decoder.layers = decoder.layers[:layers]
    if queries is not None:
        decoder.query_embed = torch.nn.Embedding.from_pretrained(decoder.query_embed.weight[:queries].detach())
        decoder.reference_points = torch.nn.Embedding.from_pretrained(decoder.reference_points.weight[:queries].detach())
    try:
        yield
    finally:
        decoder.layers, decoder.query_embed, decoder.reference_points = saved


def prompt_features(model, vision, input_ids: torch.Tensor, attention_mask: torch.Tensor, extra=None):
    """Prompt tokens [K, L, D] and their valid mask (True = valid) for K text prompts on one image, as the sam3
    package builds them: text tokens, then `extra` (tokens [K, M, D], valid [K, M]; context tokens a method
    adds), then the geometry encoder's CLS token on one padded box (see the module doc).
    Returns (prompt, mask, fpn, fpn_pos)."""
    k = input_ids.shape[0]
    fpn = [_expand(t, k) for t in vision.fpn_hidden_states[:-1]]
    fpn_pos = [_expand(t, k) for t in vision.fpn_position_encoding[:-1]]
    text = model.get_text_features(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).pooler_output
    mask = attention_mask.bool()
    if extra is not None:
        text, mask = torch.cat([text, extra[0].to(text.dtype)], 1), torch.cat([mask, extra[1].bool()], 1)
    device, geometry = text.device, model.geometry_encoder
    with torch.autocast(device_type=device.type, enabled=False), _fp32(geometry):
        geo = geometry(box_embeddings=torch.zeros(k, 1, 4, device=device), box_mask=torch.zeros(k, 1, dtype=torch.bool, device=device),
                       box_labels=torch.zeros(k, 1, dtype=torch.long, device=device),
                       img_feats=[t.float() for t in fpn], img_pos_embeds=[t.float() for t in fpn_pos])  # fmt: skip
    cls = geo.last_hidden_state.to(text.dtype)
    return torch.cat([text, cls], 1), torch.cat([mask, geo.attention_mask.bool()], 1), fpn, fpn_pos


def run_prompts(model, vision, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_masks: bool = True, extra=None) -> dict:
    """One bucket of K prompts on one encoded image: the fusion encoder, the DETR decoder with its box head and
    dot-product scoring, and (with_masks) the segmentation head. dict(hs [K, Q, D], logits [K, Q],
    presence_logits [K], presence_layers [L, K] (every decoder layer's; the last is presence_logits), boxes
    [K, Q, 4] xyxy in [0, 1], masks [K, Q, h, w], semantic [K, 1, h, w])."""
    from transformers.models.sam3.modeling_sam3 import box_cxcywh_to_xyxy, inverse_sigmoid

    prompt, mask, fpn, fpn_pos = prompt_features(model, vision, input_ids, attention_mask, extra)
    enc = model.detr_encoder(vision_features=[fpn[-1]], text_features=prompt, vision_pos_embeds=[fpn_pos[-1]], text_mask=mask)
    dec = model.detr_decoder(vision_features=enc.last_hidden_state, text_features=enc.text_features, vision_pos_encoding=enc.pos_embeds_flattened,
                             text_mask=mask, spatial_shapes=enc.spatial_shapes)  # fmt: skip
    hidden = dec.intermediate_hidden_states
    boxes = box_cxcywh_to_xyxy((inverse_sigmoid(dec.reference_boxes) + model.detr_decoder.box_head(hidden)).sigmoid())
    logits = model.dot_product_scoring(decoder_hidden_states=hidden, text_features=enc.text_features, text_mask=mask).squeeze(-1)
    presence = dec.presence_logits.squeeze(-1)
    out = dict(hs=hidden[-1], logits=logits[-1], presence_logits=presence[-1], presence_layers=presence, boxes=boxes[-1])
    if with_masks:
        seg = model.mask_decoder(decoder_queries=out["hs"], backbone_features=list(fpn), encoder_hidden_states=enc.last_hidden_state,
                                 prompt_features=prompt, prompt_mask=mask)  # fmt: skip
        out["masks"], out["semantic"] = seg.pred_masks, seg.semantic_seg
    return out


def answers(out: dict, size: tuple[int, int], confidence: float) -> list[Sam3Prompt]:
    """The package processor's arithmetic per prompt, with SegEarth-OV3's additions: presence = sigmoid(presence
    logit); object scores = sigmoid(logit) x presence, instances kept where > confidence; masks and semantic map:
    the logits resized bilinearly to `size`, then sigmoid."""
    presence = out["presence_logits"].float().sigmoid()
    scores = out["logits"].float().sigmoid() * presence[:, None]
    semantic = F.interpolate(out["semantic"].float(), size=size, mode="bilinear", align_corners=False).sigmoid()
    got = []
    for k in range(scores.shape[0]):
        keep = scores[k] > confidence
        masks = out["masks"][k][keep].float()
        masks = F.interpolate(masks[:, None], size=size, mode="bilinear", align_corners=False)[:, 0].sigmoid() if len(masks) else masks.new_zeros(0, *size)
        got.append(Sam3Prompt(masks, scores[k][keep], semantic[k, 0], float(presence[k])))
    return got


# -- weights -----------------------------------------------------------------------------------------------------
def offline_tokenizer(max_length: int = 32):
    """transformers' CLIPTokenizer built from CLIP's BPE merges (open_clip's copy), with no download: the
    tokenizer of random-weight models; its ids equal the sam3 package's on the valid positions."""
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    merges = gzip.open(clip_bpe_path()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    base = list(bytes_to_unicode().values())
    vocab = base + [v + "</w>" for v in base] + ["".join(m.split()) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in merges], model_max_length=max_length)


def offline_processor(image_size: int = SAM3_RESOLUTION, max_length: int = 32):
    """A Sam3Processor at `image_size` px with the offline tokenizer (real weights bring their own)."""
    from transformers import Sam3ImageProcessor, Sam3Processor

    return Sam3Processor(image_processor=Sam3ImageProcessor(size={"height": image_size, "width": image_size}), tokenizer=offline_tokenizer(max_length))


def _is_folder(source: str) -> bool:
    """A Hub id is owner/name; an absolute or relative path (./ ../ ~), or a deeper one, is a folder."""
    return os.path.isabs(source) or source.startswith((".", "~")) or source.count("/") > 1 or os.path.isdir(source)


def load_sam3_transformers(weights: str | None = "hub", device: str | torch.device = "cpu", precision: str = "fp32") -> TransformersPrompter:
    """SAM 3 through transformers. weights: "hub" (facebook/sam3, from the Hugging Face cache or downloaded),
    another Hub id, a folder with a saved Sam3Model and Sam3Processor, or "none" (random weights of the
    released configuration, for testing). WeightsUnavailableError (one line) when they cannot be had."""
    require_extra("transformers", "SAM 3 (preset sam3, --regions sam3)", extra="sam3")
    from transformers import Sam3Config, Sam3Model, Sam3Processor

    device = torch.device(device)
    if weights in (None, "", "none"):
        model = Sam3Model(Sam3Config())
        return TransformersPrompter(model.to(device), offline_processor(), "none", device, precision)
    source = SAM3_HUB_ID if weights == "hub" else os.path.expanduser(str(weights))
    if _is_folder(source) and not os.path.isdir(source):
        raise WeightsUnavailableError(f"{weights}: no such folder (give a folder with a saved Sam3Model and Sam3Processor, a Hub id, 'hub' or 'none')")
    try:
        model = Sam3Model.from_pretrained(source)
        processor = Sam3Processor.from_pretrained(source)
    except OSError as e:  # offline and not cached, gated without a login, a folder without the files
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise WeightsUnavailableError(
            f"could not obtain SAM 3 weights {source!r} ({first}). {SAM3_HUB_ID} is gated: accept its licence on the Hub, "
            f"`hf auth login` and download once; offline, copy the Hugging Face cache ($HF_HOME) or give a folder "
            f"(--proxy-weights sam3=FOLDER); sam3=none runs random weights (testing only)"
        ) from e
    return TransformersPrompter(model.to(device), processor, SAM3_HUB_ID if weights == "hub" else str(weights), device, precision)
