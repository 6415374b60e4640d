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
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec, stitch_multiple
from ..models.clip import DenseCLIP
from ..models.proxies import PROXIES, image_backbones, proxy_config, spec_backbones
from ..stages import Stage, resolve_stages
from .images import load_image
from .bank import ImageBank, clip_id, retrieval_logits
from .labels import ClassMaps, SegmentationResult
from .preprocess import input_regions, prepare
from .regions import region_reader
from .settings import InferenceSettings
from .stitch import check_stitched, stitched_features
from .vocabulary import Prompts, Vocabulary, embed_names, resolve_prompts, resolve_templates, templates_id
from .windows import BAND_ELEMENTS, CosineMap, DenseMap, dense_cosine, grid_cosine, resized_cosine, spliced_tokens


def hook_stages(spec: AttentionSpec, stages: Sequence[Stage], kind: str) -> list[Stage]:
    """The windows or post stages to run, in order: the spec's (`hook:`), except those a stage of the same
    name (the text before the first ':') given in the settings replaces, then the settings'."""
    given = [s for s in stages if s.kind == kind]
    named = {s.name.partition(":")[0] for s in given}
    return [s for s in resolve_stages(spec.hooks) if s.kind == kind and s.name.partition(":")[0] not in named] + given


def global_stage(spec: AttentionSpec, stages: Sequence[Stage]) -> Stage | None:
    """The global stage to run (see stages.py): one given in the settings replaces the spec's of the same
    name (a protocol's per-dataset constants); ValueError if two different ones would run."""
    given = [s for s in stages if s.kind == "global"]
    named = {s.name.partition(":")[0] for s in given}
    found = given + [s for s in resolve_stages(spec.hooks) if s.kind == "global" and s.name.partition(":")[0] not in named]
    if len(found) > 1:
        raise ValueError(f"one global stage at a time (got {', '.join(s.name for s in found)})")
    match = [s.name for s in resolve_stages(spec.hooks) if s.kind == "match"]
    if found and match:
        raise ValueError(f"match stage {match[0]} works on each window's cosine map; it cannot run with the global stage {found[0].name}")
    return found[0] if found else None


def whole_image_features(image: np.ndarray, size: tuple[int, int], names: Sequence[str], device) -> dict[str, torch.Tensor]:
    """Backbone name -> 1 x C x h x w whole-image features of the original RGB image at the network
    input's `size` (`Backbone.image_features`: one run per image, CorrCLIPv2's `ext:NAME.image` taps);
    the analysis computes them here too, so its attention is the one the forward gets."""
    return {name: PROXIES.get(name, device).image_features(torch.from_numpy(np.array(image)), size) for name in names}


class Segmenter:
    """Open-vocabulary segmentation of single images with a fixed model, spec, vocabulary and settings.

        seg = Segmenter(load_clip("ViT-B-16"), "cat,dog,grass", spec="sclip")
        result = seg.predict("photo.jpg")        # result.labels, result.probs, result.class_names

    The vocabulary is embedded once (and cached on disk) when the segmenter is built; `progress` shows a
    progress bar on stderr while it is (or a note that the cache is reused).
    regions: where region maps come from, for specs and stages that read them (CorrCLIP): a callable
    (rgb, name) -> H x W integer ids (-1 unsegmented) with a `source()` text for result files, e.g.
    `regions.RegionFolder` or `regions.Sam2Regions`; `predict(image, name)` passes the image's name. A
    source with `for_vocabulary(names)` (`regions.Sam3Regions`) is given this vocabulary's prompt names.
    A source is required when the spec or a stage reads regions, and ignored (not recorded) otherwise.
    prompts: a prompt file (`vocabulary.Prompts` or its path) whose sentences per class name join the
    templates' average (OV-Stitcher's description prompts); recorded in `config()`.
    bank: an opened image bank (`segment.bank.ImageBank`) for retrieval stages (CorrCLIPv2's `retrieve`);
    required by them, refused when built with another CLIP or key backbone, ignored (not recorded) otherwise.
    Its other CLIPs' stores (CorrCLIPv2's DFN) get their own text embeddings: from `bank_clips` when one of
    them is that CLIP, else loaded here by the manifest's model and weights names.
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
        regions: Callable[[np.ndarray, str], np.ndarray] | None = None,
        prompts: Prompts | str | Path | None = None,
        bank: ImageBank | None = None,
        bank_clips: Sequence[DenseCLIP] = (),
    ) -> None:
        if isinstance(vocabulary, str):
            vocabulary = Vocabulary.parse(vocabulary)
        elif not isinstance(vocabulary, Vocabulary):
            vocabulary = Vocabulary.from_names([[n] for n in vocabulary])
        self.clip = clip
        self.vocabulary = vocabulary
        self.spec = resolve_spec(spec)
        self.settings = settings or InferenceSettings()
        self.templates = resolve_templates(templates)
        self.prompts = resolve_prompts(prompts)
        self.stages = resolve_stages(self.settings.stage_texts())
        reader = region_reader(self.spec, self.settings.stage_texts())
        if reader and regions is None:
            raise ValueError(f"{reader} needs region masks for each image: give a region source (--regions FOLDER or --regions sam2)")
        clip.check_spec(self.spec)
        prompted = getattr(regions, "for_vocabulary", None)  # a text-prompted source (sam3) takes our names
        self.regions = (prompted(vocabulary.flat_names) if prompted else regions) if reader else None  # read (and recorded) only when used
        self.global_stage = global_stage(self.spec, self.stages)
        self.window_stages = hook_stages(self.spec, self.stages, "windows")
        self.post_stages = hook_stages(self.spec, self.stages, "post")
        self.retrieval_stages = hook_stages(self.spec, self.stages, "retrieval")
        if self.retrieval_stages and bank is None:
            raise ValueError(f"stage {self.retrieval_stages[0].name} needs an image bank: give --bank BANK (build one with `clipseg-sparse bank build`)")
        if self.retrieval_stages and self.global_stage:
            raise ValueError(f"stage {self.retrieval_stages[0].name} works on the windows' averaged map; it cannot run with the global stage {self.global_stage.name}")
        self.bank = bank if self.retrieval_stages else None
        if self.global_stage and self.window_stages:
            raise ValueError(
                f"stage {self.window_stages[0].name} works on each window's patch map; it cannot run with the global stage "
                f"{self.global_stage.name}, which splices the windows into one image-wide map before any map is made"
            )
        s, patch = self.settings, clip.patch_size
        self.stitched = stitch_multiple(self.spec) is not None
        if self.stitched:
            check_stitched(self.spec, clip.depth)
            other = [st.name for st in [self.global_stage, *self.window_stages, *self._stages("token")] if st]
            if not s.window:
                raise ValueError(f"spec {self.spec} stitches sliding windows: set a window size (not 0)")
            if other:
                raise ValueError(f"stage {other[0]} cannot run with spec {self.spec}, whose windows are stitched")
        if self.global_stage and s.window and (s.window % patch or s.stride % patch):
            raise ValueError(f"stage {self.global_stage.name} splices the windows: window and stride must be multiples of the patch size {patch} (got {s.window} / {s.stride})")
        if self.backbones():  # ext: terms see this CLIP's crops (its normalisation, precision)
            PROXIES.configure(clip)
        self.text = embed_names(clip, vocabulary.flat_names, self.templates, cache_dir=cache_dir, progress=progress, prompts=self.prompts)
        for stage in self._stages("text"):
            self.text = stage(self.text)
        self.store_texts = self._store_texts(bank_clips, cache_dir, progress) if self.bank is not None else {}
        self.band_elements = BAND_ELEMENTS  # per band of the final resize; lower it to save memory

    def _store_texts(self, given: Sequence[DenseCLIP], cache_dir, progress: bool) -> dict[str, torch.Tensor]:
        """Bank store -> the text embeddings its logits use: this CLIP's for its own store, each other
        store's CLIP (loaded for its text tower, then dropped) for the others. Checks the bank first."""
        from ..models.clip import load_clip

        self.bank.check(self.clip, PROXIES.config([self.bank.proxy])[self.bank.proxy])
        texts = {}
        for store in self.bank.manifest["values"]:
            if store["clip"] == clip_id(self.clip):
                texts[store["clip"]] = self.text
                continue
            other = next((c for c in given if clip_id(c) == store["clip"]), None)
            other = other or load_clip(store["model"], store["pretrained"], device=self.clip.device)
            texts[store["clip"]] = embed_names(other, self.vocabulary.flat_names, self.templates, cache_dir=cache_dir, progress=progress, prompts=self.prompts)
        return texts

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
            "stages": [s.name for s in self.stages],  # canonical names, PAMR included when on
            **proxy_config(self.backbones()),  # backbones of ext: terms and stages, their tags and weights
            **({"regions": self.regions.source()} if self.regions is not None else {}),
            **({"bank": self.bank.record()} if self.bank is not None else {}),
        }

    def backbones(self) -> list[str]:
        """External backbones this segmenter runs: the spec's (`spec_backbones`), its global stage's, then
        its other stages' (samrefine: SAM's weights)."""
        extra = [*(self.global_stage.backbones if self.global_stage else ()), *(b for s in self.stages for b in s.backbones)]
        extra += [b for s in self.window_stages + self.post_stages for b in s.backbones]
        extra += [self.bank.proxy] if getattr(self, "bank", None) is not None else []
        return list(dict.fromkeys(spec_backbones(self.spec) + extra))

    def _stages(self, kind: str) -> list[Stage]:
        return [s for s in self.stages if s.kind == kind]

    def region_map(self, image: np.ndarray, name: str | None) -> np.ndarray | None:
        """The image's H x W region ids from the region source (None without one)."""
        if self.regions is None:
            return None
        return self.regions(image, name if name is not None else "image")

    def pixels(self, image: np.ndarray) -> torch.Tensor:
        """The 1 x 3 x H' x W' network input of an RGB uint8 image, by `preprocess.prepare` (whole patches
        when the global stage splices the windows)."""
        return prepare(image, self.clip, self.settings, splices=self.global_stage is not None)

    def cosine(self, image: np.ndarray, regions: np.ndarray | None = None) -> CosineMap | DenseMap:
        """N_names x H x W cosine at the original image size, for an RGB uint8 image: factored (see
        CosineMap), or whole after the post stages (PAMR), which run on the whole full-size map (their
        memory then grows with names x pixels). regions: the image's H x W region ids, resized
        nearest with the image (CorrCLIP), for specs that read them."""
        s = self.settings
        height, width = image.shape[:2]
        pixels = self.pixels(image)
        scaled = input_regions(regions, tuple(pixels.shape[-2:]))
        at_input = [st for st in self.post_stages if st.at_input]  # run at the network input's size
        size = tuple(pixels.shape[-2:])
        out_size = size if at_input or self.retrieval_stages else (height, width)
        image_feats = self.image_features(image, size, list(dict.fromkeys(image_backbones(self.spec) + ([self.bank.proxy] if self.bank else []))))
        if self.stitched:  # the windows stitched, attention across them (OV-Stitcher): features on the proxy grid
            feats = stitched_features(self.clip, pixels, self.spec, scaled, s.window, s.stride, s.pos_interp, s.batch_size)
            factored = grid_cosine(feats, self.text, out_size, via=size)
        elif self.global_stage is not None:  # splice the windows, then one stage over the whole image
            tokens = spliced_tokens(self.clip, pixels, self.spec, s.window, s.stride, s.batch_size, self._stages("token"), s.pos_interp)
            tokens = self.global_stage(tokens, image, self.spec.normalizer)
            factored = grid_cosine(self.clip.project(tokens[0]), self.text, out_size)
        else:
            factored = dense_cosine(
                self.clip, pixels, self.text, self.spec, s.window, s.stride, s.batch_size, out_size,
                self._stages("token"), s.pos_interp, s.remainder, s.logit_scale, scaled, self.window_stages,
                {n: image_feats[n] for n in image_backbones(self.spec)},
            )  # fmt: skip
        if self.retrieval_stages:  # the image bank's support logits, fused at the network input's size
            cos = factored.rows(0, size[0])
            feats = image_feats[self.bank.proxy][0].to(cos.device)
            retrieve = lambda k: retrieval_logits(scaled, feats, self.bank, self.store_texts, k)  # noqa: E731
            for stage in self.retrieval_stages:
                cos = stage(cos, scaled, retrieve)
            if not at_input:
                factored = resized_cosine(cos, (height, width))
            else:
                factored = DenseMap(cos)
        if at_input:
            cos = factored.rows(0, out_size[0]) if isinstance(factored, CosineMap) else factored.values
            mean, std = (torch.tensor(v, device=cos.device).view(3, 1, 1) for v in (self.clip.mean, self.clip.std))
            rgb = pixels[0].to(cos.device) * std + mean  # the network input in [0, 1]
            for stage in at_input:
                cos = self._run_post(stage, cos, rgb)
            factored = resized_cosine(cos, (height, width))  # bilinear to the original size
        post = [st for st in self.post_stages if not st.at_input]
        if not post:
            return factored
        cos = factored.rows(0, height)
        # the guide of published PAMR: the network input brought back to the original size
        guide = F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False)[0].to(cos.device)
        for stage in post:
            cos = self._run_post(stage, cos, guide)
        return DenseMap(cos)

    def image_features(self, image: np.ndarray, size: tuple[int, int], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """`whole_image_features` on this segmenter's device."""
        return whole_image_features(image, size, names, self.clip.device)

    def _run_post(self, stage: Stage, cos: torch.Tensor, guide: torch.Tensor) -> torch.Tensor:
        """One post stage (stages.py), with the text embeddings when it reads them."""
        return stage(cos, guide, self.text.to(cos.device)) if stage.text else stage(cos, guide)

    @torch.inference_mode()
    def class_maps(self, rgb: np.ndarray, regions: np.ndarray | None = None) -> ClassMaps:
        """The C x H x W class probabilities at the original size, computed band by band on demand."""
        s = self.settings
        return ClassMaps(
            self.cosine(rgb, regions), self.vocabulary.name_to_class, len(self.vocabulary), s.logit_scale, self.band_elements,
            s.area_threshold, s.renormalize,
        )  # fmt: skip

    def _labels(self, image, name: str | None) -> tuple[ClassMaps, np.ndarray]:
        rgb = load_image(image)
        if name is None and isinstance(image, (str, Path)):
            name = Path(image).name
        regions = self.region_map(rgb, name)
        maps = self.class_maps(rgb, regions)
        labels = maps.labels(self.settings.bg_threshold, self.settings.area_threshold)
        for stage in self._stages("refine"):  # e.g. Trident's SAM prompt refinement, on the probabilities
            labels = stage(torch.from_numpy(labels), maps, rgb).numpy()
        for stage in self._stages("labels"):  # e.g. CorrCLIP's map correction, on the original regions
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
