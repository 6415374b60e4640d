"""From an image to a label map: resize, sliding windows, text matching, background rule.

The steps and their defaults follow the published training-free code (SCLIP / mmseg): keep-ratio resize
so the short side is `resolution` (long side capped at 2048), 224 x 224 windows with stride 112 and the
last window shifted back inside the image, cosine maps upsampled bilinearly to each window and averaged
where windows overlap, then upsampled to the original size; probabilities are
softmax(logit_scale * cosine) over all names, then the max over each class's synonyms.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionSpec
from ..errors import UserValueError
from ..models.clip import DenseCLIP
from .images import load_image
from .labels import ClassMaps, SegmentationResult
from .maps import BAND_ELEMENTS, CosineMap, DenseMap, ResizedMap, resized_cosine
from .plan import ImageRun, Plan
from .resources import RegionSource, Resources
from .settings import InferenceSettings
from .vocabulary import Prompts, Vocabulary, embed_names, resolve_templates, templates_id


class Segmenter:
    """Open-vocabulary segmentation of single images with a fixed model, spec, vocabulary and settings.

        seg = Segmenter(load_clip("ViT-B-16"), "cat,dog,grass", spec="sclip")
        result = seg.predict("photo.jpg")        # result.labels, result.probs, result.class_names

    The vocabulary is embedded once (and cached on disk) when the segmenter is built; `progress` shows a
    progress bar on stderr while it is (or a note that the cache is reused). A run is its plan
    (`plan.Plan`: the spec's and the settings' stages, what they need, the forward) and, per image, the
    plan's forward followed by the fixed chain of stages: retrieval, input and post stages on the cosine, the
    background rules, refine and labels stages on the labels.
    resources: the run's inputs besides the model and the image (`resources.Resources`: region source, image
    bank, prompt file, external backbones' weights), checked against the plan, and what the run uses loaded,
    when the segmenter is built; inputs the plan does not read are ignored (not recorded). In place of it, the
    keywords regions, prompts, bank and bank_clips give the same fields (`Resources`' docstring): a region
    source is required when the spec or a stage reads regions, a bank by retrieval stages (CorrCLIPv2's).
    """

    def __init__(
        self,
        clip: DenseCLIP,
        vocabulary: Vocabulary | str | Sequence[str],
        spec: AttentionSpec | str | None = "sclip",
        settings: InferenceSettings | None = None,
        templates: str | Sequence[str] = "openai",
        cache_dir: str | Path | None = None,
        progress: bool = False,
        regions: RegionSource | None = None,
        prompts: Prompts | str | Path | None = None,
        bank=None,
        bank_clips: Sequence[DenseCLIP] = (),
        *,
        resources: Resources | None = None,
    ) -> None:
        if isinstance(vocabulary, str):
            vocabulary = Vocabulary.parse(vocabulary)
        elif not isinstance(vocabulary, Vocabulary):
            vocabulary = Vocabulary.from_names([[n] for n in vocabulary])
        if resources is not None and (regions is not None or prompts is not None or bank is not None or bank_clips):
            raise UserValueError("give regions, prompts and bank either as keywords or in resources=, not both")
        self.clip = clip
        self.vocabulary = vocabulary
        self.plan = Plan.of(spec, settings)  # checked against the model when the resources are bound
        self.templates = resolve_templates(templates)
        resources = resources or Resources.open(self.plan, regions=regions, bank=bank, prompts=prompts)
        resources = dataclasses.replace(resources, bank_clips=tuple(bank_clips)) if bank_clips else resources
        self.resources = resources.bind(self.plan, clip, vocabulary.flat_names)
        self.text = embed_names(clip, vocabulary.flat_names, self.templates, cache_dir=cache_dir, progress=progress, prompts=self.prompts)
        for stage in self.plan.of_kind("text"):
            self.text = stage(self.text)
        self.store_texts = self._store_texts(cache_dir, progress) if self.resources.bank is not None else {}
        self.band_elements = BAND_ELEMENTS  # per band of the final resize; lower it to save memory

    def _store_texts(self, cache_dir, progress: bool) -> dict[str, torch.Tensor]:
        """Bank store -> the text embeddings its logits use: this CLIP's for its own store, each other store's
        CLIP's (`Resources.bank_clips`) for the others."""
        from .bank import clip_id

        clips = {clip_id(c): c for c in self.resources.bank_clips}
        texts = {}
        for store in self.resources.bank.manifest["values"]:
            if store["clip"] == clip_id(self.clip):
                texts[store["clip"]] = self.text
            else:
                texts[store["clip"]] = embed_names(
                    clips[store["clip"]], self.vocabulary.flat_names, self.templates, cache_dir=cache_dir, progress=progress, prompts=self.prompts
                )
        return texts

    @property
    def spec(self) -> AttentionSpec:
        return self.plan.spec

    @property
    def settings(self) -> InferenceSettings:
        return self.plan.settings

    @property
    def prompts(self) -> Prompts | None:
        return self.resources.prompts

    @property
    def regions(self) -> RegionSource | None:
        return self.resources.regions

    @property
    def bank(self):
        return self.resources.bank

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.vocabulary.labels

    def config(self) -> dict:
        """Everything that changes a prediction, for result files."""
        return {
            **self.clip.config(),
            "attention": str(self.spec),
            "templates": templates_id(self.templates),
            **({"prompts": self.prompts.id()} if self.prompts is not None else {}),  # absent: templates only
            "classes": [list(syn) for syn in self.vocabulary.names],
            **dataclasses.asdict(self.settings),
            "stages": [s.name for s in self.plan.given],  # canonical names, PAMR included when on
            **self.resources.record(self.plan),  # backbones and their weights, region source, bank
        }

    def region_map(self, image: np.ndarray, name: str | None) -> np.ndarray | None:
        """The image's H x W region ids from the region source (None without one)."""
        if self.regions is None:
            return None
        return self.regions(image, name if name is not None else "image")

    def pixels(self, image: np.ndarray) -> torch.Tensor:
        """The 1 x 3 x H x W network input of an RGB uint8 image (the forward's, `Forward.pixels`)."""
        return self.plan.forward.pixels(image, self.clip, self.settings)

    def image_run(self, image: np.ndarray, regions: np.ndarray | None = None) -> ImageRun:
        """One RGB uint8 image through this segmenter's plan (`plan.ImageRun`); regions: its H x W region ids."""
        return ImageRun.of(self.plan, self.clip, self.text, image, regions, self.resources, self.store_texts, self.vocabulary, self.templates)

    def cosine(self, image: np.ndarray, regions: np.ndarray | None = None) -> CosineMap | ResizedMap | DenseMap:
        """N_names x H x W cosine at the original image size, for an RGB uint8 image: factored (see
        CosineMap), or whole after the post stages (PAMR), which run on the whole full-size map (their
        memory then grows with names x pixels). regions: the image's H x W region ids (CorrCLIP), for specs
        that read them."""
        return self._cosine(self.image_run(image, regions))

    def _cosine(self, run: ImageRun) -> CosineMap | ResizedMap | DenseMap:
        """The forward, then the fixed chain: retrieval and input stages at the network input's size (the
        map resized bilinearly to the original size after them), post stages at the original size."""
        height, width = run.image.shape[:2]
        factored = self.plan.forward.cosine(run)
        retrieval, at_input, post = (self.plan.of_kind(k) for k in ("retrieval", "input", "post"))
        if retrieval:  # the image bank's support logits, fused at the network input's size
            cos = factored.rows(0, run.size[0])
            for stage in retrieval:
                cos = stage(cos, run)
            factored = DenseMap(cos) if at_input else resized_cosine(cos, (height, width))
        if at_input:
            cos = factored.values if isinstance(factored, DenseMap) else factored.rows(0, run.size[0])
            mean, std = (torch.tensor(v, device=cos.device).view(3, 1, 1) for v in (self.clip.mean, self.clip.std))
            rgb = run.pixels[0].to(cos.device) * std + mean  # the network input in [0, 1]
            for stage in at_input:
                cos = stage(cos, rgb, run)
            factored = resized_cosine(cos, (height, width))  # bilinear to the original size
        if not post:
            return factored
        cos = factored.rows(0, height)
        # the guide of published PAMR: the network input brought back to the original size
        guide = F.interpolate(run.pixels, size=(height, width), mode="bilinear", align_corners=False)[0].to(cos.device)
        for stage in post:
            cos = stage(cos, guide, run)
        return DenseMap(cos)

    @torch.inference_mode()
    def class_maps(self, rgb: np.ndarray, regions: np.ndarray | None = None) -> ClassMaps:
        """The C x H x W class probabilities at the original size, computed band by band on demand."""
        return self._class_maps(self.image_run(rgb, regions))

    @torch.inference_mode()
    def _class_maps(self, run: ImageRun) -> ClassMaps:
        s = self.settings
        return ClassMaps(
            self._cosine(run), self.vocabulary.name_to_class, len(self.vocabulary), s.logit_scale, self.band_elements,
            s.area_threshold, s.renormalize,
        )  # fmt: skip

    def _labels(self, image, name: str | None) -> tuple[ClassMaps, np.ndarray]:
        rgb = load_image(image)
        if name is None and isinstance(image, (str, Path)):
            name = Path(image).name
        regions = self.region_map(rgb, name)
        run = self.image_run(rgb, regions)
        maps = self._class_maps(run)
        labels = maps.labels(self.settings.bg_threshold, self.settings.area_threshold)
        for stage in self.plan.of_kind("refine"):  # e.g. Trident's SAM prompt refinement, on the probabilities
            labels = stage(torch.from_numpy(labels), maps, run).numpy()
        for stage in self.plan.of_kind("labels"):  # e.g. CorrCLIP's map correction, on the original regions
            labels = stage(torch.from_numpy(labels), torch.from_numpy(np.asarray(regions, dtype=np.int64))).numpy()
        return maps, labels

    def predict(self, image, name: str | None = None) -> SegmentationResult:
        """Segment one image (a path, a PIL image or an H x W x 3 array). Memory stays bounded at any
        image size: labels are computed a band of rows at a time, and `result.probs` only when used.
        name: the image's name for the region source (default: a path's file name)."""
        maps, labels = self._labels(image, name)
        return SegmentationResult(labels, maps, self.class_names, self.config())

    def predict_labels(self, image, name: str | None = None) -> np.ndarray:
        """H x W int64 labels only (what `eval` scores), computed a band of rows at a time."""
        return self._labels(image, name)[1]
