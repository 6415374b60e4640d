"""ActiveSAM (arXiv 2606.16996): SAM 3 as SegEarth-OV3 runs it (`sam3.py`), with context tokens in each prompt,
a presence preview that prunes large vocabularies, and a margin rule for the background. The `activesam`
pipeline (`--preset activesam[/NORMALIZER]`, `activesam-entmax`) and protocol `activesam`.

Read from VILA-Lab/ActiveSAM@41cad43 (the initial release, MABC background): `activesam/model/segmentor.py`
(`ActiveSAM`: `_inference_single_view`, `_fuse_instance_and_semantic`), `model/base.py` (`predict`: max over a
class's names, argmax, background), `model/processor.py` (`BucketPromptProcessor.set_text_prompts_batch`),
`pruning/pruner.py`, `background/mabc.py`, `prompt_expansion/{lexical,memory_bank,neighbor_tokens,
hypernym_tokens}.py`, `model/rope_patch.py`, `configs/base_config.py`, `configs/cfg_*.py`, `configs/cls_*.txt`
(byte-identical to this project's `segearth` name set and the SCLIP files it falls back to). Per image:

1. names: every name (a class's synonyms included) canonicalised (`canonical`: compound splits such as
   `pottedplant` -> `potted plant`, word-order repairs, homonyms such as `mouse` -> `computer mouse`);
2. preview, only when the vocabulary has more than 40 names: the image squashed to 672 x 672 px, one
   presence-only pass per name (no mask heads, no context tokens); keep the names whose presence is at least
   the 0.8 quantile of the image's presences, at most 40 by presence, the argmax if none (`decide`);
3. the kept names through the detector 32 at a time on one 1008-px image encoding, each prompt's text tokens
   followed by 4 context tokens (`context_tokens`): 2 semantic neighbours (the other names nearest by cosine
   of their mean token embeddings, weighted by a softmax of the cosines, through SAM 3's 1024 -> 256 text
   projection) and 2 WordNet hypernyms of the name (the first noun synset's first two hypernyms' first lemmas,
   encoded the same way; a missing one is masked);
4. each kept name's map as SegEarth-OV3's (`sam3.fuse_prompt`, confidence 0.3); a name not kept scores 0;
5. per class the max over its names, the argmax, then MABC (`mabc`): with s1, s2 the two top class scores,
   a pixel whose s1 * sqrt(max(s1 - s2, 0)) is below prob_thd ** 1.25 gets class 0 (no-op when prob_thd is 0).

Constants (configs): confidence 0.3 on every dataset; prob_thd 0.4 (VOC21, COCO-Object), 0.1 (Context60), else
0; the image at its own size (no resize, no slide). Quirks copied: the neighbour tokens are over names, not
classes (a class's synonyms are each other's neighbours; `background` gets neighbours and hypernyms), the softmax
weights scale the embeddings before the projection, so its bias is not weighted; with two names the second
neighbour is the name itself with weight 0 (the projection's bias); hypernym lemmas are canonicalised before
they are encoded (`tv monitor` -> `monitor` -> `computer monitor`), and equal first lemmas count once; when no
name has a hypernym only the 2 neighbour tokens are appended; presence counts twice in the instance terms
(SegEarth-OV3's fusion); the preview keeps names, not classes. Fixed: without nltk's WordNet corpus the
published lookup silently returns no hypernyms; here the hypernyms of every name of the shipped class files
come from a table (`data/wordnet_hypernyms.json`, WordNet 3.0, `benchmarks/activesam_hypernyms.py` rebuilds
and checks it), other names from nltk's corpus when installed, else one line and exit 2 before the model
loads. Not copied: the text-embedding cache and the preview's mask-head skip (cost only: here the preview's
passes stop before the mask decoder), the mmseg / PIL image loading (the pixels `eval` loaded), the RoPE patch
(transformers' `Sam3ViTLayer.precompute_positions` for the preview's grid gives the same angles:
`models/sam3/hf.py::vit_grid`), bf16 presences on CUDA (here sigmoid of the logits in fp32, as the `sam3`
pipeline). ActiveSAM edits no attention normalizer: `activesam/NORMALIZER` and `activesam-entmax` are this
project's, the `sam3` pipeline's slot (the detector's image and the fusion encoder's prompt cross-attention,
`models/sam3/attention.py`) in every pass, the preview's included; `analyze` and `explain` read its detector
as the `sam3` pipeline's (`query_attention`, with the context tokens). Runs on the transformers backend only
(the context tokens enter `run_prompts` as `extra`). The later release (`@f662551`: Exclusive Concept Decoding,
class signatures from unlabeled images, a `calibrate` step) is `activesam_ecd.py`. No accuracy has been
measured here (no weights).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..attention.normalizers import Normalizer
from ..attention.presets import ENTMAX_ALPHA
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..models.sam3 import backend_of, load_sam3
from ..models.sam3.hf import answers
from ..segment.images import load_image
from ..segment.pipelines import PIPELINES, Pipeline, QueryAttention
from ..segment.settings import InferenceSettings
from ..segment.vocabulary import Vocabulary
from . import sam3
from .sam3 import fuse_prompt

SOURCE = "VILA-Lab/ActiveSAM@41cad43 activesam/model/segmentor.py, pruning/pruner.py, background/mabc.py, prompt_expansion/, configs/"
CONFIDENCE = 0.3  # configs/base_config.py confidence_threshold, every dataset
BUCKET = 32  # prompts per detector pass (a prompt's answer does not depend on its bucket)
PREVIEW = 672  # px, the presence preview's square input
QUANTILE_ALPHA = 0.20  # the preview keeps presences >= the (1 - alpha) quantile
MAX_ACTIVE = 40  # the preview runs only above this many names, and keeps at most this many
NEIGHBOURS = 2
HYPERNYMS = 2
MABC_EXPONENT = 1.25
HYPERNYM_TABLE = Path(__file__).resolve().parent.parent / "data" / "wordnet_hypernyms.json"
NLTK_HINT = "pip install nltk, then python -m nltk.downloader wordnet"

# prompt_expansion/lexical.py, copied
COMPOUND_SPLIT_MAP = {
    "trafficlight": "traffic light", "trafficsign": "traffic sign", "pottedplant": "potted plant", "tvmonitor": "tv monitor",
    "windowpane": "window pane", "coffeetable": "coffee table", "streetlight": "street light", "signboard": "sign board",
    "arcademachine": "arcade machine", "kitchenisland": "kitchen island", "dirttrack": "dirt track", "chestofdrawers": "chest of drawers",
    "televisionreceiver": "television receiver", "conveyerbelt": "conveyor belt", "bedclothes": "bed clothes", "sportsball": "sports ball",
    "baseballbat": "baseball bat", "baseballglove": "baseball glove", "tennisracket": "tennis racket", "wineglass": "wine glass",
    "cellphone": "cell phone", "hairdrier": "hair drier", "firehydrant": "fire hydrant", "stopsign": "stop sign",
    "parkingmeter": "parking meter", "aeroplane": "airplane", "diningtable": "dining table", "motorbike": "motorcycle",
}  # fmt: skip
WORDORDER_REPAIR_MAP = {
    "wallbrick": "brick wall", "wallconcrete": "concrete wall", "wallstone": "stone wall", "walltile": "tile wall",
    "wallwood": "wooden wall", "wallpanel": "wall panel", "floormarble": "marble floor", "floorstone": "stone floor",
    "floortile": "tile floor", "floorwood": "wooden floor", "ceilingtile": "tile ceiling", "windowblind": "window blind",
}  # fmt: skip
AMBIGUOUS_LABEL_MAP = {
    "tie": "necktie", "remote": "remote control", "mouse": "computer mouse", "monitor": "computer monitor", "ashcan": "trash can",
    "plaything": "toy", "buffet": "sideboard",
}  # fmt: skip


def canonical(name: str) -> str:
    """The name the text encoder sees (`_canonicalize(name, universal=True)`): looked up lowercased with
    everything but letters and digits dropped, so `Traffic-Light` and `trafficlight` both become `traffic light`."""
    key = re.sub(r"[^a-z0-9]+", "", name.lower())
    for table in (COMPOUND_SPLIT_MAP, WORDORDER_REPAIR_MAP, AMBIGUOUS_LABEL_MAP):
        if key in table:
            return table[key]
    return name


# -- WordNet hypernyms ------------------------------------------------------------------------------------------
def noun_hypernyms(wordnet, synset) -> list:
    """A noun synset's hypernyms in the order of its line in WordNet's data.noun. nltk (3.9.4, ActiveSAM's pin,
    and later) keeps a synset's pointers in a set, so `Synset.hypernyms()` lists them in an order that changes
    with Python's hash seed: of `tank`'s three hypernyms, the published lookup takes two that vary by run."""
    with wordnet.open("data.noun") as data:
        data.seek(synset.offset())
        fields = data.readline().split()
    words = int(fields[3], 16)
    start = 5 + 2 * words  # after offset, lex file, type, word count, the words with their lex ids, pointer count
    pointers = [fields[start + 4 * i : start + 4 * i + 3] for i in range(int(fields[4 + 2 * words]))]
    return [wordnet.synset_from_pos_and_offset(pos, int(offset)) for symbol, offset, pos in pointers if symbol == "@"]


def wordnet_hypernyms(name: str, wordnet, count: int = HYPERNYMS) -> list[str]:
    """Up to `count` hypernym lemmas of `name` on an nltk WordNet reader: its first noun synset's first
    `count` hypernyms (WordNet's order, `noun_hypernyms`), each one's first lemma (`_` -> space), a lemma met
    twice kept once."""
    synsets = wordnet.synsets(name.strip().lower().replace(" ", "_").replace("-", "_"), pos=wordnet.NOUN)
    out: list[str] = []
    for hypernym in noun_hypernyms(wordnet, synsets[0])[:count] if synsets else []:
        lemma = hypernym.lemmas()[0].name().replace("_", " ")
        if lemma and lemma not in out:
            out.append(lemma)
    return out


@lru_cache(maxsize=1)
def hypernym_table() -> dict[str, list[str]]:
    """The shipped lookups: canonical name -> its hypernym lemmas (WordNet 3.0)."""
    return json.loads(HYPERNYM_TABLE.read_text(encoding="utf-8"))


def nltk_wordnet(name: str):
    """nltk's WordNet corpus reader, or a one-line error naming `name` (the first name the table lacks)."""
    try:
        from nltk.corpus import wordnet

        wordnet.get_version()  # loads the corpus: LookupError when it is not installed
    except (ImportError, LookupError):
        raise UserValueError(f"activesam: no WordNet hypernyms shipped for {name!r} and nltk's WordNet corpus is not installed ({NLTK_HINT})") from None
    return wordnet


def hypernyms(names: Sequence[str]) -> list[list[str]]:
    """Each canonical name's hypernym lemmas: from the shipped table, else from nltk's WordNet corpus."""
    table = hypernym_table()
    missing = [name for name in dict.fromkeys(names) if name not in table]
    if missing:
        wordnet = nltk_wordnet(missing[0])
        table = {**table, **{name: wordnet_hypernyms(name, wordnet) for name in missing}}
    return [table[name] for name in names]


def check_vocabulary(vocabulary: Vocabulary) -> list[list[str]]:
    """The vocabulary's hypernyms, or a one-line error (a single name; a name WordNet cannot be asked for)."""
    if len(vocabulary.flat_names) < 2:
        raise UserValueError(f"activesam needs at least 2 names (each name's context tokens are its nearest other names); got {list(vocabulary.flat_names)}")
    return hypernyms([canonical(n) for n in vocabulary.flat_names])


# -- context tokens ---------------------------------------------------------------------------------------------
def pooled_embeddings(prompter, texts: Sequence[str]) -> torch.Tensor:
    """[N, D_text] each text's token embeddings (no position embedding) averaged over its valid tokens (start,
    words, end): the sam3 package's `language_embeds` pooled as `memory_bank.pooled_text_embeddings` does."""
    ids, mask = prompter.tokens(texts)
    embeds = prompter.model.text_encoder.text_model.embeddings.token_embedding(ids).float()
    valid = mask[..., None].float()
    return (embeds * valid).sum(1) / valid.sum(1).clamp_min(1.0)


def neighbour_tokens(pooled: torch.Tensor, projection: torch.nn.Module, count: int = NEIGHBOURS) -> torch.Tensor:
    """[N, count, D] each name's `count` nearest other names (cosine of the pooled embeddings), their
    embeddings weighted by a softmax over those cosines, projected (`SemanticNeighborBank`)."""
    unit = pooled / pooled.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(-math.inf)
    values, index = similarity.topk(count, dim=1)
    return projection(pooled[index] * values.softmax(1)[..., None])


def hypernym_tokens(per_name: Sequence[Sequence[str]], encode: Callable[[list[str]], torch.Tensor], projection: torch.nn.Module,
                    count: int = HYPERNYMS) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """([N, count, D] tokens, [N, count] valid) of each name's hypernyms, each distinct lemma encoded once
    (`encode`: texts -> pooled embeddings), projected; None when no name has one (`WordNetHypernymBank`)."""
    unique = list(dict.fromkeys(h for hs in per_name for h in hs))
    if not unique:
        return None
    pooled = encode(unique)
    tokens = pooled.new_zeros(len(per_name), count, pooled.shape[-1])
    valid = torch.zeros(len(per_name), count, dtype=torch.bool, device=pooled.device)
    for n, hs in enumerate(per_name):
        for m, h in enumerate(hs[:count]):
            tokens[n, m], valid[n, m] = pooled[unique.index(h)], True
    return projection(tokens), valid


@torch.inference_mode()
def context_tokens(prompter, names: Sequence[str], per_name: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, M, D] tokens, [N, M] valid) appended to each (canonical) name's text: its neighbours, then its
    hypernyms (canonicalised, then encoded); fp32, outside autocast, as published."""
    projection = prompter.model.text_projection
    pooled = pooled_embeddings(prompter, names)
    tokens, valid = [neighbour_tokens(pooled, projection)], [torch.ones(len(names), NEIGHBOURS, dtype=torch.bool, device=pooled.device)]
    found = hypernym_tokens(per_name, lambda texts: pooled_embeddings(prompter, [canonical(t) for t in texts]), projection)
    if found is not None:
        tokens.append(found[0])
        valid.append(found[1])
    return torch.cat(tokens, 1), torch.cat(valid, 1)


# -- preview, background ----------------------------------------------------------------------------------------
def decide(presence: torch.Tensor, alpha: float = QUANTILE_ALPHA, cap: int = MAX_ACTIVE) -> list[int]:
    """The names the preview keeps (sorted): presence >= its (1 - alpha) quantile, the top `cap` of them by
    presence, the argmax if none (`ActiveClassPruner._decide_active`)."""
    tau = float(presence.float().quantile(1.0 - alpha))
    index = torch.where(presence >= tau)[0]
    if index.numel() == 0:
        return [int(presence.argmax())]
    if index.numel() > cap:
        index = index[torch.topk(presence[index], k=cap).indices]
    return sorted(int(i) for i in index)


def mabc(scores: torch.Tensor, labels: torch.Tensor, prob_thd: float, exponent: float = MABC_EXPONENT, background: int = 0) -> torch.Tensor:
    """Margin-aware background calibration: class `background` where s1 * sqrt(max(s1 - s2, 0)) < prob_thd **
    exponent (s1, s2: the two top scores of C x H x W `scores`); `labels` unchanged when prob_thd <= 0."""
    if prob_thd <= 0 or scores.shape[0] < 2:
        return labels
    top = scores.topk(2, dim=0).values
    energy = top[0] * (top[0] - top[1]).clamp_min(0).sqrt()
    return torch.where(energy < float(prob_thd) ** float(exponent), torch.full_like(labels, background), labels)


# -- the segmenter ----------------------------------------------------------------------------------------------
class ActiveSamSegmenter:
    """ActiveSAM on a loaded transformers SAM 3 prompter (`models.sam3.TransformersPrompter`): `scores(rgb)`
    (C x H x W), `predict_labels(image)` (what eval scores). normalizer: in the detector's attention (None: SAM
    3's softmax); preview: the preview's square input in px (672; smaller for small test models)."""

    def __init__(self, prompter, vocabulary: Vocabulary, settings: InferenceSettings | None = None, normalizer: str | None = None,
                 preview: int = PREVIEW) -> None:  # fmt: skip
        settings = settings or InferenceSettings()
        if settings.stage_texts() or settings.area_threshold:
            raise UserValueError(f"activesam runs no stages and no area threshold (got stages {list(settings.stage_texts())}, area_threshold {settings.area_threshold})")
        if getattr(prompter, "backend", None) != "transformers":
            raise UserValueError("activesam runs on SAM 3's transformers backend only (its context tokens enter the prompt there)")
        self.prompter = prompter
        self.vocabulary = vocabulary
        self.settings = settings
        self.normalizer = normalizer
        self.preview = preview
        self.names = [canonical(n) for n in vocabulary.flat_names]
        self.context = context_tokens(prompter, self.names, check_vocabulary(vocabulary))

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.vocabulary.labels

    def config(self) -> dict:
        """Everything that changes a prediction, for result files."""
        return {
            **self.prompter.config(),
            "attention": pipeline_name(self.normalizer),
            "classes": [list(syn) for syn in self.vocabulary.names],
            "confidence": CONFIDENCE,
            "preview": self.preview,
            "bg_threshold": self.settings.bg_threshold,
        }

    def active(self, rgb: np.ndarray) -> list[int]:
        """The names decoded on this image: all up to 40, else those the presence preview keeps (`decide`)."""
        if len(self.names) <= MAX_ACTIVE:
            return list(range(len(self.names)))
        state = self.prompter.set_image(rgb, size=self.preview)
        runs = [self.prompter.run(state, self.names[s : s + BUCKET], with_masks=False) for s in range(0, len(self.names), BUCKET)]
        return decide(torch.cat([out["presence_logits"].float().sigmoid() for out in runs]))

    def query_attention(self, rgb: np.ndarray) -> QueryAttention:
        """The detector's rows per name as `Sam3Segmenter.query_attention` gives them (what `analyze` and `explain`
        read), each prompt with its context tokens; a name the preview drops keeps no instance."""
        tokens, valid = self.context
        starts = range(0, len(self.names), BUCKET)
        buckets = [(self.names[s : s + BUCKET], (tokens[s : s + BUCKET], valid[s : s + BUCKET])) for s in starts]
        with self.prompter.normalized(self.normalizer):
            active = self.active(rgb)
        got = sam3.query_attention(self.prompter, self.prompter.set_image(rgb), buckets, self.normalizer, CONFIDENCE, self.vocabulary.name_to_class)
        decoded = torch.zeros(len(self.names), 1, dtype=torch.bool, device=got.kept.device)
        decoded[active] = True
        return dataclasses.replace(got, kept=got.kept & decoded)

    @torch.inference_mode()
    def scores(self, rgb: np.ndarray) -> torch.Tensor:
        """C x H x W class scores of an H x W x 3 uint8 RGB image: each kept name's fused map (`sam3.fuse_prompt`),
        0 for the others, then the max over each class's names."""
        tokens, valid = self.context
        index = self.vocabulary.name_to_class
        with self.prompter.normalized(self.normalizer):
            active = self.active(rgb)
            state = self.prompter.set_image(rgb)
            scores = torch.zeros(len(self.vocabulary), *state["size"], device=self.prompter.device)
            for start in range(0, len(active), BUCKET):
                bucket = active[start : start + BUCKET]
                out = self.prompter.run(state, [self.names[i] for i in bucket], extra=(tokens[bucket], valid[bucket]))
                for i, a in zip(bucket, answers(out, state["size"], CONFIDENCE)):
                    scores[index[i]] = torch.maximum(scores[index[i]], fuse_prompt(a.masks, a.scores, a.semantic, a.presence))
        return scores

    def predict_labels(self, image, name: str | None = None) -> np.ndarray:
        """H x W int64 labels: argmax of `scores`, then MABC with prob_thd = bg_threshold."""
        scores = self.scores(load_image(image) if isinstance(image, (str, Path)) else np.asarray(image))
        labels = mabc(scores, scores.argmax(0), self.settings.bg_threshold)
        return labels.cpu().numpy().astype(np.int64)


def pipeline_name(normalizer: str | None) -> str:
    """The canonical `activesam[/NORMALIZER]` (softmax runs as SAM 3 does and is written without one)."""
    return "activesam" + (f"/{normalizer}" if normalizer else "")


def parse(args: str, normalizer: str | None = None) -> str | None:
    """The normalizer of `activesam[/NORMALIZER]`'s text after the name (None: softmax)."""
    text, slash, given = args.partition("/")
    if text:
        raise UserValueError(f"bad pipeline 'activesam:{args}': expected activesam[/NORMALIZER] (its constants are the published ones), e.g. activesam/entmax:1.5")
    if slash:
        try:
            normalizer = str(Normalizer.parse(given))
        except ValueError as e:
            raise UserValueError(f"bad pipeline 'activesam{args}': {e}") from None
    return None if normalizer == "softmax" else normalizer


def load(weights: str | None, device: str, precision: str):
    """SAM 3 through transformers; the package backend refused before it loads."""
    if backend_of(weights)[0] != "transformers":
        raise UserValueError(f"activesam runs on SAM 3's transformers backend only (got weights {weights!r}): give hub, a Hub id or a folder")
    return load_sam3(weights, device, precision)


def _pipeline(args: str, normalizer: str | None = None) -> Pipeline:
    normalizer = parse(args, normalizer)
    return Pipeline(
        pipeline_name(normalizer), "sam3", load,
        lambda prompter, vocabulary, settings: ActiveSamSegmenter(prompter, vocabulary, settings, normalizer), check=check_vocabulary,
    )  # fmt: skip


PIPELINES.register("activesam", _pipeline, help="ActiveSAM on SAM 3: context tokens, presence preview over 40 names, MABC background: activesam[/NORMALIZER]")
PIPELINES.register(
    "activesam-entmax", lambda args: _pipeline(args, f"entmax:{ENTMAX_ALPHA:g}"),
    help=f"activesam with entmax:{ENTMAX_ALPHA:g} in the detector's image and the fusion encoder's prompt cross-attention (this project)",
)  # fmt: skip

PROTOCOL = PROTOCOLS.register(
    "activesam",
    Protocol(
        name="activesam",
        attention="activesam",
        class_names="segearth",  # configs/cls_*.txt equal SegEarth-OV3's files byte for byte
        source=SOURCE,
        defaults=dict(resolution=0, window=0),  # the original image; SAM 3's processor squashes it to 1008 x 1008
        per_dataset={"voc21": dict(bg_threshold=0.4), "coco-object": dict(bg_threshold=0.4), "context60": dict(bg_threshold=0.1)},
    ),
    help="ActiveSAM (SAM 3): original image, SegEarth-OV3's class files, confidence 0.3, MABC prob_thd 0.4 / 0.1",
)

# results/table1.png, ActiveSAM row (SAM 3 PE-L+/14 weights, facebook/sam3)
ACTIVESAM = {"voc21": 83.8, "context60": 55.4, "coco-object": 72.0, "voc20": 97.0, "context59": 60.1, "coco-stuff": 44.4,
             "cityscapes": 69.7, "ade20k": 40.0}  # fmt: skip
register_published(PROTOCOL, ACTIVESAM, "VILA-Lab/ActiveSAM@41cad43 results/table1.png (ActiveSAM row)", clip="sam3:facebook/sam3", printed_average=65.3)
