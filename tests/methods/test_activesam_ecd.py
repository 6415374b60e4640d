"""ActiveSAM@f662551 (`methods/activesam_ecd.py`: EPG grounding, Exclusive Concept Decoding, signatures and their
calibration) against a plain transcription of VILA-Lab/ActiveSAM@f662551 (`activesam/ecd.py`, `signatures.py`,
`segmentor.py`, `prompts.py`, `sam3_utils.py`, `calibrate.py`), the SAM 3 passes written against `run_prompts` on a
small random `Sam3Model` with 3 decoder layers; the `calibrate` command end to end on generated images; the file
round trip; bad input."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.methods import activesam, activesam_ecd
from clipseg_sparse.methods.activesam import hypernym_table
from clipseg_sparse.methods.activesam_ecd import Decoder, EcdSegmenter, SignatureEstimator, Signatures, background_label, calibrate, nearest_signature
from clipseg_sparse.models.sam3.hf import run_prompts
from clipseg_sparse.segment.pipelines import find_pipeline
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.vocabulary import Vocabulary
from fake_benchmarks import make_benchmark
from test_activesam import package_ids, published_canonicalize, published_pooled

ROOT = Path(__file__).resolve().parents[2]
VOCAB = "background,cat,dog|boat,sky,road,tank,person,pottedplant"
SMALL = dict(preview=84, preview_layers=2, preview_queries=5)  # the tiny model: 112 px, 10 queries, 3 decoder layers


# -- the published code, transcribed -----------------------------------------------------------------------------
def pub_nearest_signature(scores, log_prior, signatures, sigma):
    """ecd.py nearest_signature."""
    scores = scores.clamp(0, 1)
    scored = scores > 0
    fit = (signatures @ scores - 0.5 * (signatures * signatures).sum(1, keepdim=True)) / sigma**2
    logits = (log_prior[:, None] + fit).masked_fill(~scored, torch.finfo(fit.dtype).min)
    return torch.where(scored.any(0), logits.argmax(0), scores.argmax(0))


class PubECD:
    """ecd.py ExclusiveConceptDecoder."""

    def __init__(self, signatures, sigma, background_label=None, background_offset=1.0, device="cpu"):
        def tensor(x):
            return torch.as_tensor(x, dtype=torch.float32, device=device)

        self.R_a, self.R_e, self.log_mass = tensor(signatures.R_a), tensor(signatures.R_e), tensor(signatures.log_mass)
        self.uncalibrated = torch.as_tensor(signatures.uncalibrated, device=device)
        self.sigma = sigma
        self.background_label = background_label
        if background_label is not None:
            self.log_prior_background = float(np.log(max(signatures.m_bg, 1e-6)) + background_offset)

    def __call__(self, class_maps, presence, active):
        height, width = class_maps.shape[-2:]
        scores = class_maps[active].flatten(1)
        mass = self.log_mass[active].exp()
        R_a = self.R_a[active][:, active]
        R_e = self.R_e[active][:, active]
        argmax = scores.argmax(0)
        log_prior = torch.log(presence[active] * mass + 1e-3)
        decoded_a = pub_nearest_signature(scores, log_prior, R_a, self.sigma)
        decoded_e = pub_nearest_signature(scores, log_prior, R_e, self.sigma)
        label = torch.where(decoded_a == decoded_e, decoded_a, argmax)
        uncalibrated = self.uncalibrated[active]
        keep_argmax = uncalibrated[argmax] | uncalibrated[label]
        label = torch.where(keep_argmax, argmax, label)
        labels = active[label]
        if self.background_label is not None:
            log_prior = torch.log(presence[active].clamp_min(1e-3) * mass)
            residual = scores - R_a[label].T
            label_fit = log_prior[label] - (residual * residual).sum(0) / (2 * self.sigma**2)
            null_fit = self.log_prior_background - (scores * scores).sum(0) / (2 * self.sigma**2)
            labels = torch.where((null_fit > label_fit) & ~keep_argmax, self.background_label, labels)
        return labels.reshape(height, width)


@dataclass
class PubSignatures:
    """signatures.py Signatures."""

    R_a: np.ndarray
    R_e: np.ndarray
    log_mass: np.ndarray
    mass_argmax: np.ndarray
    mass_excl: np.ndarray
    m_bg: float
    meta: dict

    @property
    def uncalibrated(self):
        return self.mass_argmax < self.meta["constants"]["CORE_MIN_PX"]

    def save(self, path):
        np.savez(path, R_a=self.R_a, R_e=self.R_e, log_mass=self.log_mass, mass_argmax=self.mass_argmax,
                 mass_excl=self.mass_excl, m_bg=np.array(self.m_bg, dtype=np.float64), meta=json.dumps(self.meta))  # fmt: skip

    @classmethod
    def load(cls, path):
        f = np.load(path)
        return cls(f["R_a"], f["R_e"], f["log_mass"], f["mass_argmax"], f["mass_excl"], float(f["m_bg"]), json.loads(str(f["meta"])))


class PubEstimator:
    """signatures.py SignatureEstimator."""

    GROUPS = ("argmax", "exclusive", "confident")

    def __init__(self, num_classes, core_high=0.5, core_low=0.3, min_pixels=2000, device="cpu"):
        self.num_classes = num_classes
        self.core_high, self.core_low, self.min_pixels = core_high, core_low, min_pixels
        self.sums = {g: torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device) for g in self.GROUPS}
        self.sizes = {g: torch.zeros(num_classes, dtype=torch.float64, device=device) for g in self.GROUPS}
        self.num_images = 0

    def add(self, class_maps, active):
        height, width = class_maps.shape[-2:]
        pooled = F.adaptive_avg_pool2d(class_maps[None], (height // 4, width // 4))[0][active]
        scores = (pooled.clamp(0, 1) * 255).round().to(torch.uint8).flatten(1).float() / 255.0
        pixels = torch.arange(scores.shape[1], device=scores.device)
        winner = torch.zeros_like(scores, dtype=torch.bool)
        winner[scores.argmax(0), pixels] = True
        competitor = scores.masked_fill(winner, 0).amax(0)
        confident = scores > self.core_high
        groups = {"argmax": winner, "exclusive": winner & confident & (competitor < self.core_low), "confident": confident}
        for name, members in groups.items():
            members = members.float()
            self.sums[name][active[:, None], active[None, :]] += (members @ scores.T).double()
            self.sizes[name][active] += members.sum(1).double()
        self.num_images += 1

    def signatures(self, background_label=None, meta=None):
        mean = {g: self._mean(g) for g in self.GROUPS}
        sizes = self.sizes
        R_e = torch.where((sizes["exclusive"] >= self.min_pixels)[:, None], mean["exclusive"],
                          torch.where((sizes["confident"] >= self.min_pixels)[:, None], mean["confident"], mean["argmax"]))  # fmt: skip
        share = sizes["argmax"] / sizes["argmax"].sum()
        m_bg = float("nan") if background_label is None else float(share[background_label])
        constants = dict(CORE_HI=self.core_high, CORE_LO=self.core_low, CORE_MIN_PX=self.min_pixels)
        meta = dict(meta or {}, n_images=self.num_images, C=self.num_classes, background_label=background_label, constants=constants)
        return PubSignatures(mean["argmax"].cpu().numpy(), R_e.cpu().numpy(), torch.log(share.float().clamp_min(1e-6)).cpu().numpy(),
                             sizes["argmax"].cpu().numpy(), sizes["exclusive"].cpu().numpy(), m_bg, meta)  # fmt: skip

    def _mean(self, group):
        size = self.sizes[group][:, None]
        mean = torch.where(size > 0, self.sums[group] / size.clamp_min(1e-9), 0.5)
        return mean.float().clamp(1e-6, 1 - 1e-6)


@contextmanager
def pub_shortened_decoder(decoder, num_layers, num_queries=None):
    """sam3_utils.py shortened_decoder, on transformers' decoder (its `num_layers` is len(layers))."""
    full = decoder.layers, decoder.query_embed, decoder.reference_points
    decoder.layers = decoder.layers[:num_layers]
    if num_queries is not None:
        decoder.query_embed = torch.nn.Embedding.from_pretrained(decoder.query_embed.weight[:num_queries].detach())
        decoder.reference_points = torch.nn.Embedding.from_pretrained(decoder.reference_points.weight[:num_queries].detach())
    try:
        yield
    finally:
        decoder.layers, decoder.query_embed, decoder.reference_points = full


class PubContext:
    """prompts.py ContextTokens (TextEncoder canonicalises every text; `wordnet_hypernyms` read from the shipped
    table, which holds the same lemmas): tokens [K, M, 256], mask [K, M] True = pad."""

    def __init__(self, prompter, names, num_neighbors=2, num_hypernyms=2):
        model, projection = prompter.model, prompter.model.text_projection

        def encode(texts):
            return published_pooled(model, package_ids(prompter, [published_canonicalize(t) for t in texts])).float()

        pooled = encode(names)
        unit = pooled / pooled.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        similarity = unit @ unit.T
        similarity.fill_diagonal_(-float("inf"))
        values, neighbors = similarity.topk(num_neighbors, dim=1)
        neighbor_tokens = projection(pooled[neighbors] * values.softmax(dim=1).unsqueeze(-1)).float()
        hypernyms = [hypernym_table()[published_canonicalize(n)][:num_hypernyms] for n in names]
        unique = list(dict.fromkeys(h for per_name in hypernyms for h in per_name))
        if unique:
            hpooled = encode(unique)
            table = hpooled.new_zeros(len(names), num_hypernyms, hpooled.shape[-1])
            found = torch.zeros(len(names), num_hypernyms, dtype=torch.bool)
            for i, per_name in enumerate(hypernyms):
                for slot, h in enumerate(per_name):
                    table[i, slot] = hpooled[unique.index(h)]
                    found[i, slot] = True
            hyp, missing = projection(table).float().masked_fill(~found[..., None], 0), ~found
        else:
            hyp = torch.zeros(len(names), 0, projection.out_features)
            missing = hyp[..., 0].bool()
        self.tokens = torch.cat([neighbor_tokens, hyp], dim=1)
        self.mask = torch.cat([torch.zeros_like(neighbor_tokens[..., 0], dtype=torch.bool), missing], dim=1)

    def __call__(self, prompt_ids):
        return self.tokens[prompt_ids].transpose(0, 1), self.mask[prompt_ids]


def pub_fuse_heads(semantic_logits, mask_logits, scores, size, confidence_threshold=0.3):
    """segmentor.py ActiveSAM.fuse_heads."""
    score_map = F.interpolate(semantic_logits[None, None].float(), size=size, mode="bilinear", align_corners=False)[0, 0].sigmoid()
    confident = scores > confidence_threshold
    if confident.any():
        masks = F.interpolate(mask_logits[confident][:, None].float(), size=size, mode="bilinear", align_corners=False)[:, 0].sigmoid()
        score_map = torch.maximum(score_map, (masks * scores[confident][:, None, None]).amax(0))
    return score_map


def pub_class_maps(prompter, prompts, class_of_prompt, rgb, tau, preview, preview_layers, preview_queries, background_label, bucket_size=32):
    """segmentor.py ActiveSAM.class_maps (ground, preview, admit, decode_prompts, max_over_aliases); the SAM 3 passes
    through `run_prompts` (the fusion encoder is per prompt: `select_prompts` = a pass on the survivors only)."""
    model = prompter.model
    canon = [published_canonicalize(n) for n in prompts]
    cop = torch.tensor(class_of_prompt)
    num_classes = max(class_of_prompt) + 1
    always = cop == background_label if background_label is not None else torch.zeros_like(cop, dtype=torch.bool)
    height, width = rgb.shape[:2]
    with torch.inference_mode():
        context = PubContext(prompter, prompts)

        def run(state, ids, with_context, with_masks):
            extra = None
            if with_context:
                tokens, mask = context(ids)
                extra = (tokens.transpose(0, 1), ~mask)
            return run_prompts(model, state["vision"], *prompter.tokens([canon[i] for i in ids]), with_masks=with_masks, extra=extra)

        num_prompts = len(prompts)
        maps, presence = torch.zeros(num_prompts, height, width), torch.zeros(num_prompts)
        if tau > 0:
            state = prompter.set_image(rgb, size=preview)
            preview_presence = torch.zeros(num_prompts)
            with pub_shortened_decoder(model.detr_decoder, preview_layers, preview_queries):
                for ids in torch.arange(num_prompts).split(bucket_size):
                    preview_presence[ids] = run(state, ids.tolist(), False, False)["presence_logits"].sigmoid().flatten().float()
            admitted = preview_presence >= tau
            if not admitted.any():
                admitted[preview_presence.argmax()] = True
            admitted = (admitted | always).nonzero().flatten()
        else:
            admitted = torch.arange(num_prompts)
        state = prompter.set_image(rgb)
        screened_out = []
        for ids in admitted.split(bucket_size):
            survivors = ids
            if tau > 0:
                with pub_shortened_decoder(model.detr_decoder, 1):
                    screened = run(state, ids.tolist(), True, False)["presence_logits"].sigmoid().flatten().float()
                presence[ids] = screened
                keep = (screened >= tau).nonzero().flatten()
                if keep.numel() == 0:
                    keep = screened.argmax()[None]
                survivors = ids[keep]
                screened_out += sorted(set(ids.tolist()) - set(survivors.tolist()))
            out = run(state, survivors.tolist(), True, True)
            survivor_presence = out["presence_logits"].sigmoid().flatten().float()
            presence[survivors] = survivor_presence
            scores = out["logits"].sigmoid().float() * survivor_presence[:, None]
            for i, prompt_id in enumerate(survivors.tolist()):
                maps[prompt_id] = pub_fuse_heads(out["semantic"][i, 0], out["masks"][i], scores[i], (height, width))
        maps = maps * presence[:, None, None]

    def max_over_aliases(values):
        index = cop.view(-1, *[1] * (values.dim() - 1)).expand_as(values)
        return values.new_zeros(num_classes, *values.shape[1:]).scatter_reduce_(0, index, values, "amax")

    return max_over_aliases(maps), max_over_aliases(presence), cop[admitted].unique(), admitted.tolist(), screened_out


# -- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompter():
    from sam3_tiny import tiny_hf_prompter

    torch.set_num_threads(1)
    return tiny_hf_prompter(decoder_layers=3)


def image(seed, h=20, w=28):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def random_signatures(g, c, min_px=50, bg=0):
    sums = torch.rand(c, c, generator=g).clamp(1e-6, 1 - 1e-6)
    argmax = (torch.rand(c, generator=g) * 200).round()
    meta = {"constants": {"CORE_HI": 0.5, "CORE_LO": 0.3, "CORE_MIN_PX": min_px}, "background_label": bg}
    return PubSignatures(sums.numpy(), (sums ** 1.5).numpy(), torch.log(torch.rand(c, generator=g)).numpy(), argmax.numpy(),
                         (argmax / 2).numpy(), 0.3, meta)  # fmt: skip


# -- the parts ---------------------------------------------------------------------------------------------------
def test_nearest_signature_and_the_decoder_equal_the_published_ones():
    g = torch.Generator().manual_seed(0)
    for c, bg in ((6, 0), (6, None), (9, 2)):
        sig = random_signatures(g, c, bg=bg)
        maps = torch.rand(c, 15, 17, generator=g) ** 3
        maps[:, :2, :3] = 0  # no class scores: the argmax stays
        maps[1, 5:9] = 0  # a class that scores 0 cannot win
        presence = torch.rand(c, generator=g)
        for active in (torch.arange(c), torch.tensor([0, 1, 3, 4])):
            scores, prior = maps[active].flatten(1), torch.log(presence[active] + 1e-3)
            assert torch.equal(nearest_signature(scores, prior, torch.as_tensor(sig.R_a)[active][:, active], 0.15),
                               pub_nearest_signature(scores, prior, torch.as_tensor(sig.R_a)[active][:, active], 0.15))  # fmt: skip
            ours = Decoder(Signatures(**vars(sig)), 0.15, bg)(maps, presence, active)
            want = PubECD(sig, 0.15, bg)(maps, presence, active)
            assert torch.equal(ours, want), (c, bg, active)
            argmax = active[maps[active].argmax(0)]
            assert (ours != argmax).any()  # ECD changed some pixels
        if bg is not None:
            assert (want == bg).any() and (maps[bg] > 0).any()


def test_uncalibrated_classes_keep_the_argmax():
    g = torch.Generator().manual_seed(1)
    sig = random_signatures(g, 5, min_px=10**9)  # nothing calibrated: ECD is the argmax, no null concept
    maps, presence = torch.rand(5, 8, 9, generator=g), torch.rand(5, generator=g)
    active = torch.arange(5)
    assert torch.equal(Decoder(Signatures(**vars(sig)), 0.15, 0)(maps, presence, active), maps.argmax(0))


def test_the_estimator_equals_the_published_one():
    g = torch.Generator().manual_seed(2)
    ours, want = SignatureEstimator(6, min_pixels=12), PubEstimator(6, min_pixels=12)
    for n in range(5):
        maps = torch.rand(6, 21 + n, 30, generator=g) ** 2
        maps[n % 6, : 10 + n] = 0.9  # some exclusive pixels
        active = torch.tensor(sorted(set(torch.randperm(6, generator=g)[:4].tolist()) | {0}))
        ours.add(maps, active)
        want.add(maps, active)
    for background in (0, None):
        a, b = ours.signatures(background, {"x": 1}), want.signatures(background, {"x": 1})
        for key in ("R_a", "R_e", "log_mass", "mass_argmax", "mass_excl"):
            np.testing.assert_allclose(getattr(a, key), getattr(b, key), atol=1e-6, rtol=0, err_msg=key)
        assert a.meta == b.meta and (a.m_bg == b.m_bg if background is not None else np.isnan(a.m_bg) and np.isnan(b.m_bg))
    assert a.mass_excl.sum() > 0 and (a.R_e != a.R_a).any() and 0 < (~a.uncalibrated).sum() < 6


def test_the_signature_file_round_trip(tmp_path):
    g = torch.Generator().manual_seed(3)
    sig = random_signatures(g, 4)
    sig.meta["background_label"] = 0
    sig.save(tmp_path / "published.npz")  # the published writer
    ours = Signatures.load(tmp_path / "published.npz")
    ours.save(tmp_path / "ours.npz")
    back = PubSignatures.load(tmp_path / "ours.npz")  # the published reader
    for key in ("R_a", "R_e", "log_mass", "mass_argmax", "mass_excl", "m_bg", "meta"):
        assert np.array_equal(getattr(back, key), getattr(sig, key)) if key != "meta" else back.meta == sig.meta, key
    ours.check(Vocabulary.parse("background,cat,dog,sky"), "f")  # a published file: 4 classes, background 0
    with pytest.raises(ValueError, match="signatures of 4 classes, the vocabulary has 3"):
        ours.check(Vocabulary.parse("background,cat,dog"), "f")
    with pytest.raises(ValueError, match="background class 0, the vocabulary's is None"):
        ours.check(Vocabulary.parse("cat,dog,sky,road"), "f")


def test_background_is_the_class_named_background_as_the_configs_set_it():
    """configs/cfg_*.py@f662551: background_label=0 in voc21, context60, coco_object; none in the other five."""
    from clipseg_sparse.datasets import class_vocabulary

    want = {"voc21": 0, "context60": 0, "coco-object": 0, "voc20": None, "context59": None, "coco-stuff": None, "cityscapes": None, "ade20k": None}
    assert {d: background_label(class_vocabulary(d, "segearth")[0]) for d in want} == want


# -- the pipeline ------------------------------------------------------------------------------------------------
def test_class_maps_equal_the_published_grounding(prompter):
    vocab = Vocabulary.parse(VOCAB)
    rgb = image(5)
    taus = []
    for tau in (0.0, 0.12, 0.17):  # 0: every name, no screen; the others: the preview and the screen drop names
        seg = EcdSegmenter(prompter, vocab, tau=tau, **SMALL)
        maps, presence, active = seg.class_maps(rgb)
        want = pub_class_maps(prompter, vocab.flat_names, vocab.name_to_class, rgb, tau, 84, 2, 5, 0)
        torch.testing.assert_close(maps, want[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(presence, want[1], atol=1e-6, rtol=0)
        assert torch.equal(active, want[2]) and seg.active(rgb) == want[3]
        taus.append((len(want[3]), len(want[4])))
    assert taus[0] == (9, 0) and all(0 < a < 9 for a, _ in taus[1:]) and any(s > 0 for _, s in taus[1:]), taus  # dropped at both steps
    assert 0 in want[3]  # the background class skips the preview


def test_calibration_and_ecd_labels_equal_the_published_ones(prompter, tmp_path):
    vocab = Vocabulary.parse(VOCAB)
    seg = EcdSegmenter(prompter, vocab, tau=0.12, **SMALL)
    pool = []
    for i in range(4):
        Image.fromarray(image(10 + i, 40, 52)).save(path := tmp_path / f"{i}.png")
        pool.append(path)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display; calibrate.py reads the stored pixels
    Image.fromarray(image(14, 40, 52)).save(pool[3], format="PNG", exif=exif)
    ours = calibrate(seg, pool, tmp_path / "s.npz", min_pixels=20)
    est = PubEstimator(len(vocab), min_pixels=20)
    for path in pool:
        rgb = np.array(Image.open(path).convert("RGB"))  # ActiveSAM.load_image
        maps, _, active, *_ = pub_class_maps(prompter, vocab.flat_names, vocab.name_to_class, rgb, 0.12, 84, 2, 5, 0)
        est.add(maps, active)
    want = est.signatures(0)
    for key in ("R_a", "R_e", "log_mass", "mass_argmax", "mass_excl", "m_bg"):
        np.testing.assert_allclose(getattr(ours, key), getattr(want, key), atol=1e-4, rtol=0, err_msg=key)
    from clipseg_sparse.segment.images import load_image

    assert load_image(pool[3]).shape == (52, 40, 3)  # eval would rotate it
    assert ours.meta["classes"] == [list(n) for n in vocab.names] and ours.meta["n_images"] == 4 and 0 < (~ours.uncalibrated).sum()
    loaded = Signatures.load(tmp_path / "s.npz")
    rgb = image(20)
    decoding = EcdSegmenter(prompter, vocab, signatures=loaded, tau=0.12, **SMALL)
    maps, presence, active, *_ = pub_class_maps(prompter, vocab.flat_names, vocab.name_to_class, rgb, 0.12, 84, 2, 5, 0)
    labels = PubECD(want, 0.15, 0)(maps, presence, active)
    assert np.array_equal(decoding.predict_labels(rgb), labels.numpy())


def test_pipeline_texts_and_protocol(tmp_path):
    assert find_pipeline("activesam-ecd").name == "activesam-ecd" and find_pipeline("activesam-ecd-entmax").name == "activesam-ecd/entmax:1.5"
    assert find_pipeline("activesam-ecd:/a/b:c/s.npz/sparsemax").name == "activesam-ecd:/a/b:c/s.npz/sparsemax"
    assert find_pipeline("activesam-ecd-entmax:s.npz").name == "activesam-ecd:s.npz/entmax:1.5" and find_pipeline("activesam-ecd:s.npz/softmax").name == "activesam-ecd:s.npz"
    for bad in ("activesam-ecd:s.pt", "activesam-ecd:s.npz/nope", "activesam-ecd:0.3"):
        with pytest.raises(ValueError, match="bad pipeline"):
            find_pipeline(bad)
    p = PROTOCOLS.get("activesam-ecd")
    for dataset in ("voc21", "context60", "ade20k", "cityscapes"):
        s = p.settings(dataset)
        assert (s.resolution, s.window, s.bg_threshold) == (0, 0, 0), dataset  # background: ECD's null concept, not a threshold
    assert p.class_names == "segearth" and p.pipeline_text("voc21", "activesam-ecd:x.npz") == "activesam-ecd:x.npz"
    # configs/base_config.py@f662551
    published = dict(preview_resolution=336, preview_layers=2, preview_queries=50, tau=0.1, bucket_size=32, confidence_threshold=0.3,
                     sigma=0.15, background_offset=1.0, core_high=0.5, core_low=0.3, min_pixels=2000, stride=12)  # fmt: skip
    ours = dict(preview_resolution=activesam_ecd.PREVIEW, preview_layers=activesam_ecd.PREVIEW_LAYERS, preview_queries=activesam_ecd.PREVIEW_QUERIES,
                tau=activesam_ecd.TAU, bucket_size=activesam.BUCKET, confidence_threshold=activesam.CONFIDENCE, sigma=activesam_ecd.SIGMA,
                background_offset=activesam_ecd.BACKGROUND_OFFSET, core_high=activesam_ecd.CORE_HIGH, core_low=activesam_ecd.CORE_LOW,
                min_pixels=activesam_ecd.MIN_PIXELS, stride=activesam_ecd.POOL_EVERY)  # fmt: skip
    assert ours == published


def test_query_attention_keeps_no_instance_of_a_name_the_preview_or_the_screen_drops(prompter):
    """What `analyze` and `explain` read: every name's rows; instances only for the names decoded at full size."""
    vocab = Vocabulary.parse(VOCAB)
    rgb = image(13)
    att = EcdSegmenter(prompter, vocab, tau=0.15, **SMALL).query_attention(rgb)
    *_, admitted, screened_out = pub_class_maps(prompter, vocab.flat_names, vocab.name_to_class, rgb, 0.15, 84, 2, 5, 0)
    decoded = sorted(set(admitted) - set(screened_out))
    assert (admitted, screened_out) == ([0, 7, 8], [0, 7]) and att.rows.shape[0] == 9
    assert (att.scores[0] > 0.3).any() and not att.kept[0].any()  # background: admitted without the preview, screened out
    assert not att.kept[[i for i in range(9) if i not in decoded]].any()
    assert torch.equal(att.kept[decoded], att.scores[decoded] > 0.3)
    plain = EcdSegmenter(prompter, vocab, tau=0.0, **SMALL).query_attention(rgb)
    assert torch.equal(plain.kept, plain.scores > 0.3)  # without EPG (tau 0) every name keeps its instances


# -- the command line --------------------------------------------------------------------------------------------
def write_pool(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(image(30 + i, 24, 32)).save(folder / f"img{i:02d}.png")
    return folder


def invoke(*args):
    res = CliRunner().invoke(app, list(map(str, args)))
    return res.exit_code, res.stdout, res.stderr.strip().splitlines()


def test_calibrate_from_the_command_line_resumes_and_feeds_eval(prompter, tmp_path, monkeypatch):
    monkeypatch.setattr(activesam, "load", lambda weights, device, precision: prompter)
    pool = write_pool(tmp_path / "pool", 7)
    (pool / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "sig" / "voc.npz"
    args = ["calibrate", pool, "--dataset", "voc21", "--out", out, "--every", 2, "--device", "cpu"]
    calls = []
    real = EcdSegmenter.class_maps

    def stop_at_third(self, rgb):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, rgb)

    monkeypatch.setattr(activesam_ecd, "CHECKPOINT_EVERY", 1)
    monkeypatch.setattr(EcdSegmenter, "class_maps", stop_at_third)
    code, _, lines = invoke(*args)  # stopped at the 3rd image read (broken.png, sorted first, is skipped)
    assert code != 0 and not out.exists() and activesam_ecd.partial_path(out).exists()
    assert any("broken.png: skipped" in line for line in lines), lines
    monkeypatch.setattr(EcdSegmenter, "class_maps", real)
    code, _, lines = invoke(*args)
    assert code == 0, lines
    assert any("resuming" in line and "3 of 4 images done" in line for line in lines), lines
    assert not activesam_ecd.partial_path(out).exists()
    got = Signatures.load(out)
    from clipseg_sparse.datasets import class_vocabulary

    vocab = class_vocabulary("voc21", "segearth")[0]
    est = PubEstimator(len(vocab))
    for path in sorted(pool.glob("*.png"))[::2]:  # every 2nd of the sorted pool (broken.png first: skipped)
        if path.name != "broken.png":
            maps, _, active, *_ = pub_class_maps(prompter, vocab.flat_names, vocab.name_to_class, np.array(Image.open(path)), 0.1, 336, 2, 50, 0)
            est.add(maps, active)
    want = est.signatures(0)
    for key in ("R_a", "R_e", "log_mass", "mass_argmax"):
        np.testing.assert_allclose(getattr(got, key), getattr(want, key), atol=1e-4, rtol=0, err_msg=key)
    assert got.meta["n_images"] == 3 and got.meta["skipped"] == [str(pool / "broken.png")] and got.meta["background_label"] == 0
    code, _, lines = invoke(*args)  # finished: not overwritten
    assert code == 2 and len(lines) == 1 and "exists; --overwrite" in lines[0], lines
    make_benchmark("voc21", tmp_path / "d", n=1)
    result = tmp_path / "r.json"
    code, stdout, lines = invoke("eval", "--dataset", "voc21", "--root", tmp_path / "d", "--protocol", "activesam-ecd", "--preset", f"activesam-ecd:{out}",
                                 "--device", "cpu", "--out", result)  # fmt: skip
    assert code == 0, lines
    config = json.loads(result.read_text())["config"]
    assert config["attention"] == f"activesam-ecd:{out}" and config["signatures"]["sha256"] == activesam_ecd.file_hash(out) and config["tau"] == 0.1


# -- bad input ---------------------------------------------------------------------------------------------------
def test_bad_calibrate_input_is_one_line_before_the_model(tmp_path):
    pool = write_pool(tmp_path / "pool", 1)
    base = ["calibrate", pool, "--proxy-weights", f"sam3={tmp_path / 'none-here'}", "--device", "cpu"]
    cases = {
        "no such file or folder": ["calibrate", tmp_path / "missing", "--classes", "cat,dog", "--out", tmp_path / "s.npz"],
        "named .npz": [*base, "--classes", "cat,dog", "--out", tmp_path / "s.bin"],
        "exactly one of --dataset": [*base, "--out", tmp_path / "s.npz"],
        "calibrate measures activesam-ecd": [*base, "--classes", "cat,dog", "--out", tmp_path / "s.npz", "--preset", "sam3"],
        "at least 2 names": [*base, "--classes", "cat", "--out", tmp_path / "s.npz"],
        "no images found": ["calibrate", tmp_path, "--classes", "cat,dog", "--out", tmp_path / "s.npz"],
        "no such folder": [*base, "--classes", "cat,dog", "--out", tmp_path / "s.npz"],  # every check passed: the model load fails
    }
    (tmp_path / "notes.txt").write_text("x")
    cases["no images found"][1] = tmp_path / "notes.txt"
    for message, args in cases.items():
        code, _, lines = invoke(*args)
        assert code == 2 and len(lines) == 1 and message in lines[0], (message, lines)
    activesam_ecd.partial_path(tmp_path / "s.npz").write_bytes(b"junk")
    code, _, lines = invoke(*base, "--classes", "cat,dog", "--out", tmp_path / "s.npz")
    assert code == 2 and len(lines) == 1 and "not a calibration in progress" in lines[0], lines


def test_a_background_threshold_beside_the_null_concept_is_refused(prompter):
    sig = Signatures(**vars(random_signatures(torch.Generator().manual_seed(5), 3)))
    with pytest.raises(ValueError, match="bg_threshold must be 0"):
        EcdSegmenter(prompter, Vocabulary.parse("background,cat,sky"), InferenceSettings(bg_threshold=0.4), signatures=sig)


def test_bad_signature_files_are_one_line_before_the_model(tmp_path):
    make_benchmark("voc21", tmp_path / "d", n=1)

    def line(preset):
        res = CliRunner().invoke(app, ["eval", "--dataset", "voc21", "--root", str(tmp_path / "d"), "--protocol", "activesam-ecd", "--device", "cpu",
                                       "--proxy-weights", f"sam3={tmp_path / 'none-here'}", *(["--preset", preset] if preset else [])])  # fmt: skip
        return res.exit_code, res.stderr.strip().splitlines()

    (tmp_path / "junk.npz").write_bytes(b"junk")
    np.savez(tmp_path / "other.npz", x=np.zeros(2))
    with open(tmp_path / "one.npz", "wb") as f:
        np.save(f, np.zeros(2))  # an .npy under an .npz name
    g = torch.Generator().manual_seed(4)
    sig = Signatures(**vars(random_signatures(g, 21)))
    sig.meta["classes"] = [["background"], ["cat"]] + [[f"c{i}"] for i in range(19)]
    sig.save(tmp_path / "cats.npz")
    cases = {None: "decodes with a signature file", str(tmp_path / "gone.npz"): "no such signature file", str(tmp_path / "junk.npz"): "not a signature file",
             str(tmp_path / "other.npz"): "not a signature file (no R_a", str(tmp_path / "one.npz"): "not an .npz archive", str(tmp_path / "cats.npz"): "calibrated on another vocabulary"}  # fmt: skip
    for file, message in cases.items():
        code, lines = line(None if file is None else f"activesam-ecd:{file}")
        assert code == 2 and len(lines) == 1 and message in lines[0] and (file is None or file in lines[0]), (message, lines)
