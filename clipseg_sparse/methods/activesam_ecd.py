"""ActiveSAM's later release (VILA-Lab/ActiveSAM@f662551): Exclusive Concept Decoding (ECD), class signatures
estimated once per vocabulary from unlabeled images (`calibrate`, `clipseg-sparse calibrate`), on the release's
grounding (evidence-proportional grounding, EPG). The pipeline `activesam-ecd:FILE.npz[/NORMALIZER]`
(`activesam-ecd-entmax:FILE.npz`) and protocol `activesam-ecd`.

Read from `activesam/segmentor.py` (`ActiveSAM`: `ground`, `preview`, `admit`, `decode_prompts`, `fuse_heads`,
`class_maps`, `decode`), `activesam/ecd.py` (`nearest_signature`, `ExclusiveConceptDecoder`),
`activesam/signatures.py` (`Signatures`, `SignatureEstimator`), `calibrate.py`, `activesam/sam3_utils.py`
(`shortened_decoder`), `activesam/prompts.py` (the context tokens, as in `activesam.py`) and `configs/`. Per image:

1. names canonicalised, context tokens (2 neighbours, 2 WordNet hypernyms) as in the initial release
   (`activesam.context_tokens`);
2. preview: the image squashed to 336 x 336 px, every name through SAM 3's detector cut to its first 2 layers
   and first 50 object queries (`models.sam3.hf.shortened_decoder`), no context tokens, no mask heads; a name is
   admitted when its presence is >= tau = 0.1 (the best one when none is), a background class's names always;
3. the admitted names 32 at a time at full size with their context tokens; a name whose first decoder layer's
   presence is below tau is screened out (its map stays 0, its presence is that first-layer one), the others
   are fused as SegEarth-OV3 does (`sam3.fuse_prompt`, confidence 0.3);
4. per class the max over its names of the maps and of the presences; the active classes: those of the
   admitted names;
5. ECD (`Decoder`) over the active classes: with S(p) a pixel's active-class scores, R_k a class signature,
   m_k its mass and pi_k = presence_k m_k, each of two signature sets (R_a: the mean score vector of the pool's
   pixels class k wins; R_e: of its most exclusive pixels) labels p by argmax_k log(pi_k + 1e-3) -
   ||S(p) - R_k||^2 / (2 sigma^2) over the classes scoring > 0 (sigma 0.15); where the two disagree, or the
   argmax or the decoded class is uncalibrated (won fewer than 2000 pooled pixels), the argmax stays. With a
   background class: the null concept (signature 0, prior m_bg e) takes p where it fits better than the label
   under R_a (prior max(presence, 1e-3) m_k), except where the argmax stayed.

Calibration (`SignatureEstimator`, `calibrate`): each pool image's class maps average-pooled 4 x 4, the active
classes' scores quantised to 1/255; per class three pixel groups (the pixels it wins; those it wins with a score
> 0.5 while every other is < 0.3; those where it scores > 0.5) and their summed score vectors. R_a = the mean
over the first group, R_e = over the exclusive group, else the confident one, else R_a, whichever first has
2000 pixels; an empty group's mean is 0.5; means clipped to [1e-6, 1 - 1e-6]; mass = the class's share of all
won pixels (log, floored at 1e-6), m_bg the background class's share. The published pool: COCO-Stuff
train2017, every 12th image (`calibrate ... --every 12`); constants in `configs/base_config.py`, background
class 0 in `cfg_voc21.py`, `cfg_context60.py`, `cfg_coco_object.py` (here: the class named `background`).

Quirks copied: a screened-out name keeps its first-layer presence, which enters ECD's prior although its map is
0; the two priors differ (log(p m + 1e-3) in the decoding, log(max(p, 1e-3) m) against the null concept); the
null concept is tested against R_a even where R_a and R_e agreed; the 2000-pixel threshold counts pooled pixels
(16 image pixels each); the uncalibrated test reads the argmax group's size only; classes scoring 0 at a pixel
cannot win it, a pixel where none scores keeps the argmax (class order breaks ties); a background class's names
skip the preview, not the screen; the pool images are read in their stored orientation (calibrate.py's PIL
loading applies no EXIF rotation; `eval` applies it, as for every pipeline here). Fixed: np.savez silently
appends `.npz` to another name, so the file must be named `.npz`; calibrate.py overwrites its output and cannot resume (here: refused without --overwrite, and a
stopped run resumes from `FILE.partial.npz`); a file calibrated without a background class gives m_bg NaN,
which the published decoder turns into a null concept that never wins (here refused: its background class must
match the vocabulary's); an unreadable pool image stops calibrate.py (here skipped with a note, listed in the
file). Not copied: the screen's separate 1-layer decoder pass (here the full pass's first layer: the decoder's
layers run in order, so equal; masks of screened names are computed and dropped, cost only), the text cache,
the mmseg / PIL loading (the pixels `eval` loads). `tau`, `sigma` and the preview's size are `EcdSegmenter`
arguments (the published constructor's), fixed to the published values in the pipeline. `analyze` and `explain` read its detector as `activesam`'s
(`query_attention`), instances kept only for the names the preview admits and the screen keeps. The file format is the published one (`R_a`, `R_e`, `log_mass`,
`mass_argmax`, `mass_excl`, `m_bg`, `meta` as JSON), so the repository's `signatures/*.npz` load (checked
by class count and background class; ours also record the class names and are checked by them). No accuracy
has been measured here (no weights; the release's table is an image).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.normalizers import Normalizer
from ..attention.presets import ENTMAX_ALPHA
from ..errors import UserError, UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..models.sam3.hf import answers, shortened_decoder
from ..runtime.atomic import atomic_path
from ..runtime.progress import progress_bar
from ..segment.images import load_image
from ..segment.pipelines import PIPELINES, Pipeline, QueryAttention, split_pipeline
from ..segment.settings import InferenceSettings
from ..segment.vocabulary import Vocabulary
from . import activesam
from .activesam import BUCKET, CONFIDENCE, ActiveSamSegmenter, check_vocabulary
from .sam3 import fuse_prompt

SOURCE = "VILA-Lab/ActiveSAM@f662551 activesam/segmentor.py, ecd.py, signatures.py, calibrate.py, sam3_utils.py, configs/"
PREVIEW = 336  # px, preview_resolution
PREVIEW_LAYERS = 2
PREVIEW_QUERIES = 50
TAU = 0.1  # presence threshold of the preview and of the first-layer screen
SIGMA = 0.15  # ECD score noise
BACKGROUND_OFFSET = 1.0  # added to the null concept's log prior
PRIOR_EPS = 1e-3
SIGNATURE_EPS = 1e-6
CORE_HIGH, CORE_LOW, MIN_PIXELS = 0.5, 0.3, 2000  # calibration groups; classes below MIN_PIXELS are uncalibrated
POOL_EVERY = 12  # the published pool: COCO-Stuff train2017, every 12th image
KEYS = ("R_a", "R_e", "log_mass", "mass_argmax", "mass_excl", "m_bg", "meta")
GROUPS = ("argmax", "exclusive", "confident")
CHECKPOINT_EVERY = 25  # images between saves of a calibration in progress


def background_label(vocabulary: Vocabulary) -> int | None:
    """The background class, the one whose first name is `background` (class 0 of VOC21, Context60 and
    COCO-Object's class files: exactly the configs that set background_label), or None."""
    found = [c for c, names in enumerate(vocabulary.names) if names[0].strip().lower() == "background"]
    return found[0] if found else None


# -- signatures ------------------------------------------------------------------------------------------------
@dataclass
class Signatures:
    """One vocabulary's C class signatures (`signatures.py`): R_a, R_e [C, C] (row k: class k's mean score
    vector over the pixels it wins / its most exclusive ones), log_mass [C], the groups' pooled pixel counts
    mass_argmax, mass_excl [C], m_bg (the background class's share; NaN without one), meta (JSON)."""

    R_a: np.ndarray
    R_e: np.ndarray
    log_mass: np.ndarray
    mass_argmax: np.ndarray
    mass_excl: np.ndarray
    m_bg: float
    meta: dict = field(default_factory=dict)

    @property
    def uncalibrated(self) -> np.ndarray:
        """[C] bool: classes that won fewer than MIN_PIXELS pooled pixels; their pixels keep the argmax."""
        return self.mass_argmax < self.meta["constants"]["CORE_MIN_PX"]

    def save(self, path: str | Path) -> None:
        """The published .npz, written atomically (np.savez into an open file: no `.npz` appended)."""
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, R_a=self.R_a, R_e=self.R_e, log_mass=self.log_mass, mass_argmax=self.mass_argmax, mass_excl=self.mass_excl,
                     m_bg=np.array(self.m_bg, dtype=np.float64), meta=json.dumps(self.meta))  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> "Signatures":
        """A signature file, or a one-line UserValueError naming it."""
        path = Path(path)
        if not path.is_file():
            raise UserValueError(f"{path}: no such signature file (`clipseg-sparse calibrate` writes one)")
        try:
            f = np.load(path)
            if not isinstance(f, np.lib.npyio.NpzFile):
                raise UserValueError(f"{path}: not a signature file (one array, not an .npz archive)")
            with f:
                missing = [k for k in KEYS if k not in f.files]
                if missing:
                    raise UserValueError(f"{path}: not a signature file (no {', '.join(missing)})")
                got = cls(f["R_a"], f["R_e"], f["log_mass"], f["mass_argmax"], f["mass_excl"], float(f["m_bg"]), json.loads(str(f["meta"])))
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            if isinstance(e, UserError):
                raise
            raise UserValueError(f"{path}: not a signature file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if not isinstance(got.meta, dict):
            raise UserValueError(f"{path}: not a signature file (its meta is not a JSON object)")
        c = len(got.log_mass)
        shapes = [a.shape for a in (got.R_a, got.R_e)] + [a.shape for a in (got.mass_argmax, got.mass_excl)]
        if shapes != [(c, c), (c, c), (c,), (c,)] or "CORE_MIN_PX" not in got.meta.get("constants", {}):
            raise UserValueError(f"{path}: not a signature file (arrays of {c} classes do not fit together, or no constants in its meta)")
        return got

    def check(self, vocabulary: Vocabulary, path: str | Path) -> None:
        """One line when these signatures were not calibrated on `vocabulary`: its class names (files written
        here record them), else the class count, and its background class."""
        classes, given = self.meta.get("classes"), [list(n) for n in vocabulary.names]
        if classes is not None and classes != given:
            differ = next((i for i, (a, b) in enumerate(zip(classes, given)) if a != b), min(len(classes), len(given)))
            raise UserValueError(f"{path}: calibrated on another vocabulary ({len(classes)} classes, here {len(given)}; the first difference at class {differ}); calibrate this one")
        if len(self.log_mass) != len(vocabulary):
            raise UserValueError(f"{path}: signatures of {len(self.log_mass)} classes, the vocabulary has {len(vocabulary)}; calibrate this one")
        background = background_label(vocabulary)
        if self.meta.get("background_label") != background:
            raise UserValueError(f"{path}: calibrated with background class {self.meta.get('background_label')}, the vocabulary's is {background}")


class SignatureEstimator:
    """Sums three pixel groups per class over the pool (`SignatureEstimator`): a class's argmax pixels, its
    exclusive pixels (it wins with S_k > core_high, every other score < core_low) and its confident pixels
    (S_k > core_high); float64 sums on `device`."""

    def __init__(self, num_classes: int, core_high: float = CORE_HIGH, core_low: float = CORE_LOW, min_pixels: int = MIN_PIXELS,
                 device: str | torch.device = "cpu") -> None:  # fmt: skip
        self.num_classes = num_classes
        self.core_high, self.core_low, self.min_pixels = core_high, core_low, min_pixels
        self.sums = {g: torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device) for g in GROUPS}
        self.sizes = {g: torch.zeros(num_classes, dtype=torch.float64, device=device) for g in GROUPS}
        self.num_images = 0

    def add(self, class_maps: torch.Tensor, active: torch.Tensor) -> None:
        """One pool image: class_maps [C, H, W], active [n] the (distinct) classes admitted for it."""
        height, width = class_maps.shape[-2:]
        pooled = F.adaptive_avg_pool2d(class_maps[None].float(), (height // 4, width // 4))[0][active]
        scores = (pooled.clamp(0, 1) * 255).round().to(torch.uint8).flatten(1).float() / 255.0
        winner = torch.zeros_like(scores, dtype=torch.bool)
        winner[scores.argmax(0), torch.arange(scores.shape[1], device=scores.device)] = True
        competitor = scores.masked_fill(winner, 0).amax(0)
        confident = scores > self.core_high
        groups = {"argmax": winner, "exclusive": winner & confident & (competitor < self.core_low), "confident": confident}
        pairs = active.to(self.sizes["argmax"].device)
        for name, members in groups.items():
            self.sums[name][pairs[:, None], pairs[None, :]] += (members.float() @ scores.T).double().to(pairs.device)
            self.sizes[name][pairs] += members.sum(1).double().to(pairs.device)
        self.num_images += 1

    def signatures(self, background: int | None = None, meta: dict | None = None) -> Signatures:
        """The signatures of what was added (`SignatureEstimator.signatures`)."""
        mean = {g: self._mean(g) for g in GROUPS}
        sizes = self.sizes
        enough = lambda g: (sizes[g] >= self.min_pixels)[:, None]  # noqa: E731
        r_e = torch.where(enough("exclusive"), mean["exclusive"], torch.where(enough("confident"), mean["confident"], mean["argmax"]))
        share = sizes["argmax"] / sizes["argmax"].sum()
        m_bg = float("nan") if background is None else float(share[background])
        constants = dict(CORE_HI=self.core_high, CORE_LO=self.core_low, CORE_MIN_PX=self.min_pixels)
        meta = dict(meta or {}, n_images=self.num_images, C=self.num_classes, background_label=background, constants=constants)
        log_mass = torch.log(share.float().clamp_min(1e-6))
        return Signatures(mean["argmax"].cpu().numpy(), r_e.cpu().numpy(), log_mass.cpu().numpy(), sizes["argmax"].cpu().numpy(),
                          sizes["exclusive"].cpu().numpy(), m_bg, meta)  # fmt: skip

    def _mean(self, group: str) -> torch.Tensor:
        size = self.sizes[group][:, None]
        mean = torch.where(size > 0, self.sums[group] / size.clamp_min(1e-9), 0.5)
        return mean.float().clamp(SIGNATURE_EPS, 1 - SIGNATURE_EPS)

    def state(self) -> dict[str, np.ndarray]:
        """The sums so far, as arrays (a calibration in progress)."""
        return {**{f"sums_{g}": self.sums[g].cpu().numpy() for g in GROUPS}, **{f"sizes_{g}": self.sizes[g].cpu().numpy() for g in GROUPS},
                "num_images": np.array(self.num_images)}  # fmt: skip

    def restore(self, state) -> None:
        for g in GROUPS:
            self.sums[g].copy_(torch.from_numpy(state[f"sums_{g}"]))
            self.sizes[g].copy_(torch.from_numpy(state[f"sizes_{g}"]))
        self.num_images = int(state["num_images"])


# -- decoding --------------------------------------------------------------------------------------------------
def nearest_signature(scores: torch.Tensor, log_prior: torch.Tensor, signatures: torch.Tensor, sigma: float) -> torch.Tensor:
    """[P] row index of argmax_k log_prior_k - ||S(p) - R_k||^2 / (2 sigma^2) over the classes with S_k(p) > 0
    (scores [n, P] clipped to [0, 1], log_prior [n], signatures [n, n], row k = R_k); the plain argmax where
    no class scores. ||S||^2 is the same for every k, so the fit is R_k . S - ||R_k||^2 / 2."""
    scores = scores.clamp(0, 1)
    scored = scores > 0
    fit = (signatures @ scores - 0.5 * (signatures * signatures).sum(1, keepdim=True)) / sigma**2
    logits = (log_prior[:, None] + fit).masked_fill(~scored, torch.finfo(fit.dtype).min)
    return torch.where(scored.any(0), logits.argmax(0), scores.argmax(0))


class Decoder:
    """ECD over an image's active classes (`ExclusiveConceptDecoder`): `decoder(class_maps, presence, active)`
    -> [H, W] labels. background: the null concept's class (None: no null concept)."""

    def __init__(self, signatures: Signatures, sigma: float = SIGMA, background: int | None = None, offset: float = BACKGROUND_OFFSET,
                 device: str | torch.device = "cpu") -> None:  # fmt: skip
        tensor = lambda x: torch.as_tensor(x, dtype=torch.float32, device=device)  # noqa: E731
        self.r_a, self.r_e, self.log_mass = tensor(signatures.R_a), tensor(signatures.R_e), tensor(signatures.log_mass)
        self.uncalibrated = torch.as_tensor(signatures.uncalibrated, device=device)
        self.sigma, self.background = sigma, background
        self.log_prior_background = None if background is None else float(np.log(max(signatures.m_bg, 1e-6)) + offset)

    def __call__(self, class_maps: torch.Tensor, presence: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """class_maps [C, H, W], presence [C], active [n] class ids (sorted, distinct)."""
        height, width = class_maps.shape[-2:]
        scores = class_maps[active].flatten(1)
        mass = self.log_mass[active].exp()
        r_a, r_e = self.r_a[active][:, active], self.r_e[active][:, active]
        argmax = scores.argmax(0)
        log_prior = torch.log(presence[active] * mass + PRIOR_EPS)
        decoded = nearest_signature(scores, log_prior, r_a, self.sigma)
        label = torch.where(decoded == nearest_signature(scores, log_prior, r_e, self.sigma), decoded, argmax)
        uncalibrated = self.uncalibrated[active]
        keep_argmax = uncalibrated[argmax] | uncalibrated[label]
        label = torch.where(keep_argmax, argmax, label)
        labels = active[label]
        if self.background is not None:
            prior = torch.log(presence[active].clamp_min(PRIOR_EPS) * mass)
            residual = scores - r_a[label].T
            label_fit = prior[label] - (residual * residual).sum(0) / (2 * self.sigma**2)
            null_fit = self.log_prior_background - (scores * scores).sum(0) / (2 * self.sigma**2)
            labels = torch.where((null_fit > label_fit) & ~keep_argmax, self.background, labels)
        return labels.reshape(height, width)


def admit(presence: torch.Tensor, tau: float, always: torch.Tensor) -> list[int]:
    """The names decoded at full size (`ActiveSAM.admit`): presence >= tau (the best one when none is) and
    the `always` names (a background class's)."""
    admitted = presence >= tau
    if not admitted.any():
        admitted[presence.argmax()] = True
    return (admitted | always.to(admitted.device)).nonzero().flatten().tolist()


def screen(out: dict, tau: float) -> tuple[torch.Tensor, list[int]]:
    """A bucket's first-layer screen (`decode_prompts`): ([K] the first decoder layer's presences, the slots whose
    presence is >= tau, the best one when none is)."""
    screened = out["presence_layers"][0].float().sigmoid()
    return screened, (screened >= tau).nonzero().flatten().tolist() or [int(screened.argmax())]


# -- the segmenter ---------------------------------------------------------------------------------------------
class EcdSegmenter(ActiveSamSegmenter):
    """ActiveSAM@f662551 on a transformers SAM 3 prompter: `class_maps(rgb)` (what calibration reads),
    `predict_labels(image)` (ECD with `signatures`; without, the argmax with bg_threshold, as published).
    preview: the preview's square input in px; preview_layers / preview_queries: the decoder it runs; tau: the
    admission and screen threshold (0: every name, no screen)."""

    def __init__(self, prompter, vocabulary: Vocabulary, settings: InferenceSettings | None = None, normalizer: str | None = None,
                 signatures: Signatures | None = None, preview: int = PREVIEW, preview_layers: int = PREVIEW_LAYERS,
                 preview_queries: int = PREVIEW_QUERIES, tau: float = TAU, sigma: float = SIGMA, source: str | None = None) -> None:  # fmt: skip
        super().__init__(prompter, vocabulary, settings, normalizer, preview)
        if signatures is not None and self.settings.bg_threshold:
            raise UserValueError(f"activesam-ecd decodes the background as ECD's null concept: bg_threshold must be 0 (got {self.settings.bg_threshold})")
        self.preview_layers, self.preview_queries, self.tau, self.sigma = preview_layers, preview_queries, tau, sigma
        self.name_class = torch.tensor(vocabulary.name_to_class, device=prompter.device)
        self.background = background_label(vocabulary)
        self.always = self.name_class == (-1 if self.background is None else self.background)
        self.source = source
        self.decoder = None if signatures is None else Decoder(signatures, sigma, self.background, device=prompter.device)

    def config(self) -> dict:
        return {
            **super().config(),
            "attention": pipeline_name(self.source, self.normalizer),
            "preview": [self.preview, self.preview_layers, self.preview_queries],
            "tau": self.tau,
            "sigma": self.sigma,
            "signatures": None if self.source is None else {"file": str(self.source), "sha256": file_hash(self.source)},
        }

    def active(self, rgb: np.ndarray) -> list[int]:
        """The names decoded at full size (`ActiveSAM.preview` + `admit`)."""
        if self.tau <= 0:
            return list(range(len(self.names)))
        state = self.prompter.set_image(rgb, size=self.preview)
        with shortened_decoder(self.prompter.model, self.preview_layers, self.preview_queries):
            runs = [self.prompter.run(state, self.names[s : s + BUCKET], with_masks=False) for s in range(0, len(self.names), BUCKET)]
        return admit(torch.cat([out["presence_logits"].float().sigmoid() for out in runs]), self.tau, self.always)

    @torch.inference_mode()
    def class_maps(self, rgb: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([C, H, W] class scores, [C] class presences, [n] active classes) of an H x W x 3 uint8 RGB image
        (`ActiveSAM.class_maps`: `ground`, then the max over each class's names)."""
        tokens, valid = self.context
        with self.prompter.normalized(self.normalizer):
            admitted = self.active(rgb)
            state = self.prompter.set_image(rgb)
            maps = torch.zeros(len(self.names), *state["size"], device=self.prompter.device)
            presence = torch.zeros(len(self.names), device=self.prompter.device)
            for start in range(0, len(admitted), BUCKET):
                bucket = admitted[start : start + BUCKET]
                out = self.prompter.run(state, [self.names[i] for i in bucket], extra=(tokens[bucket], valid[bucket]))
                survivors = range(len(bucket))
                if self.tau > 0:
                    presence[bucket], survivors = screen(out, self.tau)
                got = answers(out, state["size"], CONFIDENCE)
                for slot in survivors:
                    a = got[slot]
                    maps[bucket[slot]], presence[bucket[slot]] = fuse_prompt(a.masks, a.scores, a.semantic, a.presence), a.presence
        index = self.name_class
        classes = len(self.vocabulary)
        class_maps = maps.new_zeros(classes, *maps.shape[1:]).scatter_reduce_(0, index[:, None, None].expand_as(maps), maps, "amax")
        class_presence = presence.new_zeros(classes).scatter_reduce_(0, index, presence, "amax")
        return class_maps, class_presence, index[admitted].unique()

    def scores(self, rgb: np.ndarray) -> torch.Tensor:
        return self.class_maps(rgb)[0]

    @torch.inference_mode()
    def query_attention(self, rgb: np.ndarray) -> QueryAttention:
        """The detector's rows as activesam's (`ActiveSamSegmenter.query_attention`: every name with its context
        tokens, instances kept for the admitted names only), a name the first-layer screen drops keeping none."""
        got = super().query_attention(rgb)
        if self.tau <= 0:
            return got
        tokens, valid = self.context
        with self.prompter.normalized(self.normalizer):
            admitted = self.active(rgb)
            state = self.prompter.set_image(rgb)
            dropped = []
            for start in range(0, len(admitted), BUCKET):
                bucket = admitted[start : start + BUCKET]
                out = self.prompter.run(state, [self.names[i] for i in bucket], with_masks=False, extra=(tokens[bucket], valid[bucket]))
                survivors = screen(out, self.tau)[1]
                dropped += [i for slot, i in enumerate(bucket) if slot not in survivors]
        kept = got.kept.clone()
        kept[dropped] = False
        return dataclasses.replace(got, kept=kept)

    def predict_labels(self, image, name: str | None = None) -> np.ndarray:
        """H x W int64 labels (`ActiveSAM.decode`)."""
        maps, presence, active = self.class_maps(load_image(image) if isinstance(image, (str, Path)) else np.asarray(image))
        if self.decoder is not None:
            labels = self.decoder(maps, presence, active)
        else:
            labels = maps.argmax(0)
            if self.background is not None:
                labels[maps.amax(0) < self.settings.bg_threshold] = self.background
        return labels.cpu().numpy().astype(np.int64)


def file_hash(path: str | Path) -> str:
    """The signature file's content hash, which result files record."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


# -- calibration -----------------------------------------------------------------------------------------------
def partial_path(out: Path) -> Path:
    """Where a calibration in progress keeps its sums: FILE.partial.npz beside FILE.npz."""
    return out.with_name(out.name.removesuffix(".npz") + ".partial.npz")


def signature_path(out: str | Path) -> Path:
    """`out` as a Path, or one line when it is not named .npz."""
    out = Path(out)
    if out.suffix != ".npz":
        raise UserValueError(f"{out}: a signature file is named .npz (numpy appends .npz to any other name)")
    return out


def calibration_config(segmenter: EcdSegmenter | str, vocabulary: Vocabulary, images: Sequence[Path], weights: str | None = None,
                       min_pixels: int = MIN_PIXELS) -> dict:  # fmt: skip
    """What a signature file depends on: the pipeline, the classes, the pool (its files, hashed, in order), the
    SAM 3 weights and the constants; a run in progress resumes only with the same."""
    name = segmenter if isinstance(segmenter, str) else segmenter.config()["attention"]
    pool = hashlib.sha256("\n".join(str(Path(p).resolve()) for p in images).encode()).hexdigest()[:16]
    return {"pipeline": name, "classes": [list(n) for n in vocabulary.names], "images": len(images), "pool": pool, "weights": weights,
            "constants": [CORE_HIGH, CORE_LOW, min_pixels]}  # fmt: skip


def open_calibration(out: str | Path, config: dict, overwrite: bool = False) -> dict | None:
    """The state of a calibration in progress to resume (None: start afresh). One line when `out` is finished
    (without overwrite) or its run in progress has another configuration (without overwrite: say so)."""
    out = signature_path(out)
    if out.exists() and not overwrite:
        raise UserValueError(f"{out}: exists; --overwrite recomputes it")
    partial = partial_path(out)
    if overwrite or not partial.exists():
        return None
    try:
        with np.load(partial) as f:
            state = {k: f[k] for k in f.files}
        saved = json.loads(str(state["config"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        raise UserValueError(f"{partial}: not a calibration in progress; remove it or give --overwrite") from None
    if saved != json.loads(json.dumps(config)):
        differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != json.loads(json.dumps(config)).get(k))
        raise UserValueError(f"{partial}: a calibration in progress with another {', '.join(differ)}; --overwrite starts afresh")
    return state


def calibrate(segmenter: EcdSegmenter, images: Sequence[str | Path], out: str | Path, *, weights: str | None = None, overwrite: bool = False,
              min_pixels: int = MIN_PIXELS, progress: bool = False, note: Callable[[str], None] = lambda message: None) -> Signatures:  # fmt: skip
    """Estimate `segmenter`'s vocabulary's signatures on the unlabeled `images` (in order; no label is read) and
    write them to `out` (.npz). Resumable: the sums are saved every 25 images to FILE.partial.npz, and the same
    call resumes there. An image that cannot be read is skipped with a `note` and listed in the file's meta."""
    out, images = signature_path(out), [Path(p) for p in images]
    vocabulary = segmenter.vocabulary
    config = calibration_config(segmenter, vocabulary, images, weights, min_pixels)
    state = open_calibration(out, config, overwrite)
    estimator = SignatureEstimator(len(vocabulary), min_pixels=min_pixels, device=segmenter.prompter.device)
    done, skipped = 0, []
    if state is not None:
        estimator.restore(state)
        done, skipped = int(state["done"]), json.loads(str(state["skipped"]))
        note(f"resuming {partial_path(out)}: {done} of {len(images)} images done")

    def save_state() -> None:
        with atomic_path(partial_path(out)) as tmp, open(tmp, "wb") as f:
            np.savez(f, **estimator.state(), done=np.array(done), skipped=json.dumps(skipped), config=json.dumps(config))

    with progress_bar("images") if progress else nullcontext() as bar:
        task = bar.add_task("calibrate", total=len(images), completed=done) if bar else None
        for path in images[done:]:
            try:
                rgb = load_image(path, exif_transpose=False)  # calibrate.py's PIL `convert("RGB")`: the stored orientation
            except (UserError, OSError) as e:
                note(f"{path}: skipped, cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
                skipped.append(str(path))
            else:
                maps, _, active = segmenter.class_maps(rgb)
                estimator.add(maps, active)
            done += 1
            if bar:
                bar.advance(task)
            if done % CHECKPOINT_EVERY == 0 and done < len(images):
                save_state()
    pool = f"{len(images)} images ({config['pool']})" + (f", {len(skipped)} unreadable skipped" if skipped else "")
    meta = dict(pool=pool, skipped=skipped, classes=config["classes"], pipeline=config["pipeline"], weights=weights, model=segmenter.prompter.config())
    signatures = estimator.signatures(background_label(vocabulary), meta)
    signatures.save(out)
    partial_path(out).unlink(missing_ok=True)
    return signatures


# -- the pipeline ----------------------------------------------------------------------------------------------
def pipeline_name(source: str | Path | None, normalizer: str | None) -> str:
    """The canonical `activesam-ecd[:FILE][/NORMALIZER]` (softmax written without one)."""
    return "activesam-ecd" + (f":{source}" if source is not None else "") + (f"/{normalizer}" if normalizer else "")


def parse(args: str, normalizer: str | None = None) -> tuple[str | None, str | None]:
    """(signature file or None, normalizer) of `activesam-ecd[:FILE.npz][/NORMALIZER]`'s text after the name:
    the file is everything up to its `.npz`, so a path may hold `/` and `:`."""
    match = re.fullmatch(r"(?P<file>.*\.npz)?(?:/(?P<normalizer>[^/]*))?", args)
    if match is None or (not match["file"] and args and not args.startswith("/")):
        raise UserValueError(f"bad pipeline 'activesam-ecd:{args}': expected activesam-ecd:FILE.npz[/NORMALIZER] (FILE from `clipseg-sparse calibrate`)")
    if match["normalizer"] is not None:
        try:
            normalizer = str(Normalizer.parse(match["normalizer"]))
        except ValueError as e:
            raise UserValueError(f"bad pipeline 'activesam-ecd:{args}': {e}") from None
    return match["file"], None if normalizer == "softmax" else normalizer


def open_signatures(source: str | None, vocabulary: Vocabulary) -> Signatures:
    """The pipeline's signature file, checked against `vocabulary`, or one line saying how to make one."""
    if source is None:
        raise UserValueError("activesam-ecd decodes with a signature file: --preset activesam-ecd:FILE.npz (`clipseg-sparse calibrate` writes it)")
    signatures = Signatures.load(source)
    signatures.check(vocabulary, source)
    return signatures


def _pipeline(args: str, normalizer: str | None = None) -> Pipeline:
    source, normalizer = parse(args, normalizer)

    def check(vocabulary: Vocabulary) -> None:
        check_vocabulary(vocabulary)
        open_signatures(source, vocabulary)

    def build(prompter, vocabulary: Vocabulary, settings: InferenceSettings) -> EcdSegmenter:
        return EcdSegmenter(prompter, vocabulary, settings, normalizer, open_signatures(source, vocabulary), source=source)

    return Pipeline(pipeline_name(source, normalizer), "sam3", activesam.load, build, check=check)


def measured(text: str) -> Pipeline:
    """The pipeline `calibrate` measures, `activesam-ecd[/NORMALIZER]` or `activesam-ecd-entmax`, built without
    signatures (its class maps only); one line for any other text."""
    name, args = split_pipeline(text)
    source, normalizer = parse(args, f"entmax:{ENTMAX_ALPHA:g}" if name == "activesam-ecd-entmax" else None) if name in PIPELINES.names() else (None, None)
    if name not in ("activesam-ecd", "activesam-ecd-entmax") or source is not None:
        raise UserValueError(f"{text}: calibrate measures activesam-ecd[/NORMALIZER] or activesam-ecd-entmax (no signature file)")
    build = lambda prompter, vocabulary, settings: EcdSegmenter(prompter, vocabulary, settings, normalizer)  # noqa: E731
    return Pipeline(pipeline_name(None, normalizer), "sam3", activesam.load, build, check=check_vocabulary)


PIPELINES.register("activesam-ecd", _pipeline, help="ActiveSAM@f662551 on SAM 3: EPG preview, context tokens, Exclusive Concept Decoding: activesam-ecd:FILE.npz[/NORMALIZER]")
PIPELINES.register(
    "activesam-ecd-entmax", lambda args: _pipeline(args, f"entmax:{ENTMAX_ALPHA:g}"),
    help=f"activesam-ecd with entmax:{ENTMAX_ALPHA:g} in the detector's image and the fusion encoder's prompt cross-attention (this project)",
)  # fmt: skip

PROTOCOL = PROTOCOLS.register(
    "activesam-ecd",
    Protocol(name="activesam-ecd", attention="activesam-ecd", class_names="segearth", source=SOURCE, defaults=dict(resolution=0, window=0)),
    help="ActiveSAM with ECD (SAM 3): original image, SegEarth-OV3's class files, a signature file per vocabulary (--preset activesam-ecd:FILE.npz)",
)
