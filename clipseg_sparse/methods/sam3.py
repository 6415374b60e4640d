"""SAM 3 used zero-shot as a semantic segmenter, as SegEarth-OV3 runs it (arXiv 2512.08730): the `sam3`
pipeline (`--preset sam3[:CONFIDENCE]`, `segment/pipelines.py`) and protocol `sam3`, so `eval` puts the
baseline users compare against beside the CLIP presets. Not a CLIP method: no attention spec, no stages.

Read from earth-insights/SegEarth-OV-3@87e5cc1: `segearthov3_segmentor.py` (`_inference_single_view`,
`predict`), its patched `sam3/model/sam3_image_processor.py` (models/sam3.py), `configs/cfg_*.py` and
`configs/cls_*.txt` (the `segearth` name set). Per image, one pass of SAM 3's image encoder on the
original image; per prompt name (synonyms included) one text-prompted pass, whose score map is

    s = max(0, max_i m_i o_i)   over the instances with o_i > confidence (m_i: mask probability,
                                o_i = sigmoid(logit_i) x presence, the package's object score)
    s = max(s, semantic)        the semantic head's probability
    s = s x presence            the prompt's presence probability

then per class the max over its names, the argmax over classes, and pixels whose top score is below
prob_thd (`bg_threshold`) get class 0 (`bg_idx` 0).

Quirks copied: presence multiplies the instance terms twice (o_i already holds it) and the semantic term
once; the background of VOC21 / COCO-Object is a literal `background` prompt (their class files) plus
prob_thd 0.4; the image enters at its own size (the configs load it without a resize, `slide_crop` is 0
in all eight) and SAM 3's processor squashes it to 1008 x 1008; bf16 autocast on CUDA. Per dataset
(`configs/cfg_*.py`): confidence 0.5 (VOC21, COCO-Object; the default), 0.3 (Context60/59, Cityscapes,
ADE20K), 0.2 (VOC20, COCO-Stuff); prob_thd 0.4 (VOC21, COCO-Object), 0.1 (Context60), else 0.
Not copied: the segmentor re-reads the image file with PIL; here the pixels `eval` loaded (the same RGB
values, EXIF rotation applied); the names go through the detector 16 at a time on one image encoding (the
published loop runs one name per pass; a name's answer does not depend on its bucket). No accuracy has been
measured here (no weights).

SAM 3 runs through transformers by default, on any device (`models/sam3/`); `--precision bf16` runs it under
bf16 autocast on a CPU as on CUDA. Ours: `sam3/NORMALIZER` (`sam3-entmax` = `sam3/entmax:1.5`) puts the
normalizer into the detector's cross-attention to the image and the fusion encoder's cross-attention to the
prompt (`models/sam3/attention.py`), the two places where SAM 3 spreads a softmax row over the image or text.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from ..attention.normalizers import Normalizer
from ..attention.presets import ENTMAX_ALPHA
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..models.sam3 import load_sam3
from ..models.sam3.attention import DEFAULT_SITES
from ..segment.images import load_image
from ..segment.pipelines import PIPELINES, Pipeline, QueryAttention
from ..segment.settings import InferenceSettings
from ..segment.vocabulary import Vocabulary

CONFIDENCE = 0.5  # SegEarthOV3Segmentation's default confidence_threshold
SOURCE = "earth-insights/SegEarth-OV-3@87e5cc1 segearthov3_segmentor.py, configs/cfg_*.py, configs/cls_*.txt"


def fuse_prompt(masks: torch.Tensor, scores: torch.Tensor, semantic: torch.Tensor, presence: float) -> torch.Tensor:
    """One name's H x W score map from its kept instances (n x H x W mask probabilities, n object
    scores), the semantic map (H x W) and the presence probability (see the module doc)."""
    fused = torch.zeros_like(semantic)
    for mask, score in zip(masks, scores):
        fused = torch.maximum(fused, mask * score)
    return torch.maximum(fused, semantic) * presence


def query_attention(prompter, state: dict, buckets, normalizer: str | None, confidence: float, name_class) -> QueryAttention:
    """The detector's rows on the image of `state` for prompts given as (names, extra context tokens or None)
    buckets, recorded under `normalizer` (None: the exact softmax in the decoder's image attention only), with
    the queries' object scores and those above `confidence` (see `Sam3Segmenter.query_attention`)."""
    sites = ("decoder-image",) if normalizer is None else DEFAULT_SITES
    outputs = []
    with prompter.normalized(normalizer or "softmax", sites), prompter.attention(("decoder-image",)) as recorded:
        for names, extra in buckets:
            outputs.append(prompter.run(state, names, with_masks=False, extra=extra))
    last = list(recorded)[-1]  # the layers in order: the last decoder layer's image cross-attention
    rows = torch.cat(recorded[last], 0)[:, :, 1:].float()  # names x heads x Q x (h * w); row 0 is the presence token's
    presence = torch.cat([o["presence_logits"] for o in outputs]).float().sigmoid()
    scores = torch.cat([o["logits"] for o in outputs]).float().sigmoid() * presence[:, None]
    grid = tuple(state["vision"].fpn_hidden_states[-2].shape[-2:])  # the level the detector attends to
    return QueryAttention(rows, scores, scores > confidence, grid, tuple(name_class))


class Sam3Segmenter:
    """SegEarth-OV3's segmenter on a loaded SAM 3 prompter (`models.sam3`: `set_image`, `prompts`, `normalized`,
    `config`): `scores(rgb)` (C x H x W), `predict_labels(image)` (what eval scores). normalizer: in the
    detector's attention (None: SAM 3's own softmax)."""

    def __init__(self, prompter, vocabulary: Vocabulary, settings: InferenceSettings | None = None, confidence: float = CONFIDENCE,
                 normalizer: str | None = None) -> None:  # fmt: skip
        settings = settings or InferenceSettings()
        if settings.stage_texts() or settings.area_threshold:
            raise UserValueError(f"sam3 runs no stages and no area threshold (got stages {list(settings.stage_texts())}, area_threshold {settings.area_threshold})")
        self.prompter = prompter
        self.vocabulary = vocabulary
        self.settings = settings
        self.confidence = confidence
        self.normalizer = normalizer

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.vocabulary.labels

    def config(self) -> dict:
        """Everything that changes a prediction, for result files."""
        return {
            **self.prompter.config(),
            "attention": pipeline_name(self.confidence, self.normalizer),
            "classes": [list(syn) for syn in self.vocabulary.names],
            "confidence": self.confidence,
            "bg_threshold": self.settings.bg_threshold,
        }

    @torch.inference_mode()
    def scores(self, rgb: np.ndarray) -> torch.Tensor:
        """C x H x W class scores of an H x W x 3 uint8 RGB image: each name's fused map (`fuse_prompt`),
        then the max over each class's names."""
        state = self.prompter.set_image(rgb)
        with self.prompter.normalized(self.normalizer):
            answers = self.prompter.prompts(state, self.vocabulary.flat_names, self.confidence)
        per_name = [fuse_prompt(a.masks, a.scores, a.semantic, a.presence) for a in answers]
        index = torch.tensor(self.vocabulary.name_to_class)
        names = torch.stack(per_name)
        return torch.stack([names[index == c].amax(0) for c in range(len(self.vocabulary))])

    @torch.inference_mode()
    def query_attention(self, rgb: np.ndarray) -> QueryAttention:
        """The last decoder layer's cross-attention of every object query to the image tokens, per name (the
        presence token's row dropped), with the queries' object scores and the instances `scores` keeps: what
        `analyze` and `explain` read (`segment.pipelines.QueryAttention`). Recorded under this segmenter's
        normalizer; a softmax run records through the exact softmax in the decoder's image attention only (SDPA
        returns no weights), so its answers equal SDPA's to float rounding."""
        names, bucket = self.vocabulary.flat_names, self.prompter.bucket
        buckets = [(names[start : start + bucket], None) for start in range(0, len(names), bucket)]
        return query_attention(self.prompter, self.prompter.set_image(rgb), buckets, self.normalizer, self.confidence, self.vocabulary.name_to_class)

    def predict_labels(self, image, name: str | None = None) -> np.ndarray:
        """H x W int64 labels: argmax of `scores`, class 0 where the top score is below bg_threshold."""
        scores = self.scores(load_image(image) if isinstance(image, (str, Path)) else np.asarray(image))
        top, labels = scores.max(0)
        labels[top < self.settings.bg_threshold] = 0
        return labels.cpu().numpy().astype(np.int64)


def pipeline_name(confidence: float, normalizer: str | None) -> str:
    """The canonical `sam3:CONFIDENCE[/NORMALIZER]` (softmax runs as SAM 3 does and is written without one)."""
    return f"sam3:{confidence:g}" + (f"/{normalizer}" if normalizer else "")


def parse(args: str, normalizer: str | None = None) -> tuple[float, str | None]:
    """(confidence, normalizer) of `sam3[:CONFIDENCE][/NORMALIZER]`'s text after the name."""
    text, slash, given = args.partition("/")
    try:
        confidence = float(text) if text else CONFIDENCE
    except ValueError:
        confidence = -1.0
    if not 0.0 <= confidence < 1.0:
        raise UserValueError(f"bad pipeline 'sam3:{args}': expected sam3[:CONFIDENCE][/NORMALIZER] with 0 <= CONFIDENCE < 1, e.g. sam3:0.5")
    if slash:
        try:
            normalizer = str(Normalizer.parse(given))
        except ValueError as e:
            raise UserValueError(f"bad pipeline 'sam3:{args}': {e}") from None
    return confidence, None if normalizer == "softmax" else normalizer


def _pipeline(args: str, normalizer: str | None = None) -> Pipeline:
    confidence, normalizer = parse(args, normalizer)
    return Pipeline(
        pipeline_name(confidence, normalizer), "sam3", load_sam3,
        lambda prompter, vocabulary, settings: Sam3Segmenter(prompter, vocabulary, settings, confidence, normalizer),
    )  # fmt: skip


PIPELINES.register("sam3", _pipeline, help="SAM 3 zero-shot, SegEarth-OV3's fusion: sam3[:CONFIDENCE][/NORMALIZER] (transformers, any device)")
PIPELINES.register("segearth-ov3", _pipeline, help="the sam3 pipeline under its published name (SegEarth-OV3 is what sam3 runs)")
PIPELINES.register(
    "sam3-entmax", lambda args: _pipeline(args, f"entmax:{ENTMAX_ALPHA:g}"),
    help=f"sam3 with entmax:{ENTMAX_ALPHA:g} in the detector's image and the fusion encoder's prompt cross-attention (this project)",
)  # fmt: skip

_CONFIDENCE = {"voc20": 0.2, "coco-stuff": 0.2, "context60": 0.3, "context59": 0.3, "cityscapes": 0.3, "ade20k": 0.3}
PROTOCOL = PROTOCOLS.register(
    "sam3",
    Protocol(
        name="sam3",
        attention="sam3",
        class_names="segearth",
        source=SOURCE,
        defaults=dict(resolution=0, window=0),  # the original image; SAM 3's processor resizes it to 1008 x 1008
        per_dataset={"voc21": dict(bg_threshold=0.4), "coco-object": dict(bg_threshold=0.4), "context60": dict(bg_threshold=0.1)},
        attention_per_dataset={ds: f"sam3:{c:g}" for ds, c in _CONFIDENCE.items()},
    ),
    help="SegEarth-OV3 (SAM 3 zero-shot): original image, its class files, prob_thd 0.4 / 0.1, confidence per dataset",
)
SEGEARTH_PROTOCOL = PROTOCOLS.register("segearth-ov3", dataclasses.replace(PROTOCOL, name="segearth-ov3"), help="the sam3 protocol under SegEarth-OV3's name")

# SegEarth-OV3's repository reports remote-sensing results only; its natural-image numbers as ActiveSAM's Table 1
# reprints them (ViT-H SAM 3 weights facebook/sam3), next to the "SAM 3" row, whose protocol no code read here gives.
SEGEARTH_OV3 = {"voc21": 79.8, "context60": 53.4, "coco-object": 72.0, "voc20": 96.8, "context59": 59.2, "coco-stuff": 42.8,
                "cityscapes": 69.7, "ade20k": 37.6}  # fmt: skip
register_published(SEGEARTH_PROTOCOL, SEGEARTH_OV3, "VILA-Lab/ActiveSAM@41cad43 results/table1.png (SegEarth-OV3 row)",
                   clip="sam3:facebook/sam3", printed_average=63.9)  # a run of the sam3 protocol (the same one) matches it too
