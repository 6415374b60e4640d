"""FLOSS (Benigmim et al., ICCV 2025): per-class expert templates ranked by entropy on unlabeled images, fused at
every pixel; a plug-in on any preset.

Read from yasserben/FLOSS@ccf1d49 (`mmseg/models/segmentors/naclip/naclip.py`: `_load_template_rankings`,
`expert_fusion`, `encode_text_features`, `forward_feature`, `forward_slide`, `predict`, `postprocess_result`;
`mmseg/evaluation/metrics/entropy_metric.py`: `EntropyMetric.process`, `compute_metrics`; `tools/eval_naclip.py`;
`configs/naclip/*.py`; `configs/_base_/models/maskclip.py`, `configs/_base_/datasets/*.py`). Two steps:

- offline, `rank_templates` (the command `clipseg-sparse floss rank`): on unlabeled images, for each of the 80
  ImageNet templates t a single-template classifier; per pixel p = softmax(logit_scale x cosine) over names at the
  original size, the max over each class's names, the predicted class argmax p and the entropy -sum p log(p +
  1e-10); per class, the mean entropy over the pixels t predicts as it and their share of all pixels; templates
  ranked by ascending entropy. The file is FLOSS's JSON (`classes.NAME.entropy_ranking`: template_id, entropy,
  pixel_percentage, rank), so its published rankings read as they are;
- online, the spec option `floss:PATH` (its forward `floss`): C + 1 classifiers, expert e (one per name) every
  name embedded with the top 4 templates (pixel share > 0) of name e's class, plus the run's own text; per
  window, each classifier's softmax(logit_scale x cosine) over names upsampled bilinearly to the window; at each
  pixel the experts that claim it (expert e's argmax is e): exactly one -> its probabilities, none -> the
  default's, several -> the claimant whose own-name probability is highest (the first on ties); the windows'
  fused probabilities averaged and resized as every forward does; the labels then take softmax(logit_scale x
  fused) (FLOSS's `postprocess_result`, monotone: the argmax of the fused probabilities).

`floss:auto` (the presets' `naclip+floss`, `maskclip+floss`) reads the file `floss rank` writes by default for
the model, its weights, the base spec and the names (`rank_file`); `floss:PATH` any file. The spec's normalizer
slots are the base preset's (`naclip+floss-entmax`). Quirks copied, fixed and not copied: `FLOSS_NOTES`
(datasets.md, Presets). Grid: `sweeps/grids/floss.toml`. FLOSS's repository has no licence: its rankings are not
shipped (download them from it, or rank your own images).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import AttentionSpec, resolve_spec
from ..attention.presets import PRESETS, register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..errors import UserError, UserValueError
from ..evaluation.protocols import MMSEG_CODE, PROTOCOLS, SCLIP_LINE, Protocol
from ..evaluation.published import register_published
from ..segment.maps import CosineMap
from ..segment.plan import FORWARDS, ImageRun, Plan
from ..segment.preprocess import window_geometry
from ..segment.vocabulary import default_cache_dir, openai_imagenet_templates
from ..segment.windows import WindowsForward, iter_window_features, window_cosine_map
from ..stages import Needs
from . import baselines, naclip  # noqa: F401  (their presets first)

FORWARD = "floss"
TOP = 4  # naclip.py: top_n=4
AUTO = "auto"
EPSILON = 1e-10  # entropy_metric.py: log(p + 1e-10)
# naclip.py `_apply_quick_and_dirty_fix`: VOC20's names in SCLIP's class file -> the dataset's class names its
# rankings are keyed by (the person and monitor synonyms reach theirs through their class's other names)
VOC20_KEYS = {"ship": "boat", "table": "diningtable", "television monitor": "tvmonitor"}


# -- the rank file ----------------------------------------------------------------------------------------------------
def base_spec(spec: AttentionSpec | str) -> AttentionSpec:
    """The spec without its `floss` option: what the rankings are computed with."""
    spec = resolve_spec(spec)
    return dataclasses.replace(spec, extras=tuple(e for e in spec.extras if e[0] != "floss"))


def rank_file(clip, spec: AttentionSpec | str, names: Sequence[str]) -> Path:
    """Where `floss rank` writes by default and `floss:auto` reads: the cache folder's `floss/`, one file per model,
    weights, base spec and names."""
    key = json.dumps([clip.model_name, clip.pretrained, str(base_spec(spec)), list(names)])
    return default_cache_dir() / "floss" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def read_rankings(path: Path) -> dict[str, list[dict]]:
    """class name -> its entropy ranking (FLOSS's JSON); UserValueError naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        classes = data["classes"]
        out = {name: list(entry["entropy_ranking"]) for name, entry in classes.items()}
        for ranking in out.values():
            for row in ranking:
                int(row["template_id"]), float(row["pixel_percentage"])
    except FileNotFoundError:
        raise UserValueError(f"{path}: no FLOSS rank file there; make one with `clipseg-sparse floss rank IMAGES ... --out {path}`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserValueError(f"{path}: not a FLOSS rank file ({type(e).__name__}: {e}); expected {{\"classes\": {{NAME: {{\"entropy_ranking\": [...]}}}}}}") from None
    return out


def top_templates(rankings: Mapping[str, list[dict]], vocabulary, top: int = TOP) -> list[list[int]]:
    """Each name's expert templates: the first `top` of its class's ranking with a pixel share above 0
    (`_load_template_rankings`). A class is looked up by the name, then its class's label and other names, each
    then compared without spaces, underscores and case (FLOSS's NACLIP rankings key `pottedplant`, its MaskCLIP ones
    `potted plant`; its VOC20 fix maps synonyms to their class), and
    VOC20's `ship`, `table`, `television monitor` as `boat`, `diningtable`, `tvmonitor` (`VOC20_KEYS`)."""
    out, missing = [], []
    squeezed = {_squeeze(k): v for k, v in rankings.items()}
    for name, cls in zip(vocabulary.flat_names, vocabulary.name_to_class):
        keys = [name, vocabulary.labels[cls], *vocabulary.names[cls]]
        keys += [VOC20_KEYS[k] for k in keys if k in VOC20_KEYS]
        found = next((rankings[k] for k in keys if k in rankings), None) or next((squeezed[_squeeze(k)] for k in keys if _squeeze(k) in squeezed), None)
        if found is None:
            missing.append(name)
            continue
        ids = [int(row["template_id"]) for row in found if float(row["pixel_percentage"]) > 0][:top]
        if not ids:
            raise UserValueError(f"FLOSS rankings: class of {name!r} was never predicted by any template on the ranked images (no template with a pixel share above 0); rank more images")
        out.append(ids)
    if missing:
        raise UserValueError(f"FLOSS rankings: no ranking for {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''} (ranked: {', '.join(list(rankings)[:5])} ...)")
    return out


def _squeeze(key: str) -> str:
    return "".join(key.replace("_", " ").split()).lower()


def expert_texts(clip, names: Sequence[str], experts: Sequence[Sequence[int]]) -> torch.Tensor:
    """E x N x D: expert e's embedding of every name with e's templates (each prompt L2-normalised, averaged,
    renormalised: `encode_text_features`, mode fusion), from one pass over the templates any expert uses."""
    templates = openai_imagenet_templates()
    used = sorted({t for ids in experts for t in ids})
    single = clip.encode_text([templates[t].format(n) for t in used for n in names]).view(len(used), len(names), -1)
    where = {t: i for i, t in enumerate(used)}
    return torch.stack([F.normalize(single[[where[t] for t in ids]].mean(0), dim=-1) for ids in experts])


# -- the online fusion ------------------------------------------------------------------------------------------------
def fuse(probs: Iterable[torch.Tensor | None], default: torch.Tensor) -> torch.Tensor:
    """FLOSS's `expert_fusion` over N x H x W probabilities: expert e (the e-th of `probs`, one per name; None: one
    that claims no pixel) claims the pixels where its argmax is e; exactly one claimant -> its probabilities, none
    -> `default`'s, several -> the claimant with the highest own-name probability (the first on ties)."""
    best = torch.full(default.shape[1:], -1.0, device=default.device, dtype=default.dtype)
    out = default.clone()
    for e, p in enumerate(probs):
        if p is None:
            continue
        take = (p.argmax(0) == e) & (p[e] > best)
        best = torch.where(take, p[e], best)
        out = torch.where(take[None], p, out)
    return out


def _upsampled(cos: torch.Tensor, scale: float, size: tuple[int, int], expert: int | None = None) -> torch.Tensor | None:
    """h x w x N cosine -> N x H x W softmax(scale x cosine) over names, bilinear to `size` (align_corners False).
    With `expert` e: None where no pixel can have e as its argmax. Bilinear values are convex combinations of
    patches, so a pixel's p_e is at most the window's largest patch p_e, and its top value at least 1 / N: below
    1 / N at every patch, e claims nothing (exact; it skips most experts of most windows)."""
    probs = torch.softmax(scale * cos.float(), dim=-1)
    if expert is not None and float(probs[..., expert].max()) < 1 / probs.shape[-1]:
        return None
    return F.interpolate(probs.permute(2, 0, 1)[None], size=size, mode="bilinear", align_corners=False)[0]


class FlossForward(WindowsForward):
    """The windows forward with FLOSS's C + 1 classifiers fused per window at the window's pixels (`fuse`); windows
    stages then see the fused probabilities of every window. Its attention (analyze, explain) is the base spec's."""

    name = FORWARD
    kinds = frozenset({"token", "windows", "retrieval"})

    def __init__(self) -> None:
        self._texts: dict[tuple, torch.Tensor] = {}

    def experts(self, run: ImageRun) -> torch.Tensor:
        """E x N x D expert texts of the run's rank file (read and embedded once per model, file and names)."""
        arg = run.spec.extra("floss")
        if run.vocabulary is None:
            raise UserValueError("floss reads per-class rankings: run it through a Segmenter (or give ImageRun its vocabulary)")
        names = run.vocabulary.flat_names
        path = rank_file(run.clip, run.spec, names) if arg == AUTO else Path(arg)
        if arg == AUTO and not path.is_file():
            raise UserValueError(
                f"floss:auto: no rank file for this model, weights, spec and names yet ({path}); make it with "
                f"`clipseg-sparse floss rank IMAGES --classes ... --preset {base_spec(run.spec)}` (same --model, --pretrained), or give floss:PATH"
            )
        key = (id(run.clip), str(path.resolve()), path.stat().st_mtime_ns if path.is_file() else 0, names)
        if key not in self._texts:
            self._texts = {key: expert_texts(run.clip, names, top_templates(read_rankings(path), run.vocabulary))}
        return self._texts[key]

    def cosine(self, run: ImageRun) -> CosineMap:
        clip, s = run.clip, run.settings
        experts = self.experts(run).to(clip.device)
        texts = torch.cat([experts, run.text.to(clip.device)[None]]).flatten(0, 1)  # (E + 1) N x D, the default last
        n = run.text.shape[0]
        boxes, fused = [], []
        for chunk, feats in iter_window_features(run):
            boxes += chunk
            y1, y2, x1, x2 = chunk[0]
            size = (window_geometry(y2 - y1, clip.patch_size, s.remainder, not s.window)[3],
                    window_geometry(x2 - x1, clip.patch_size, s.remainder, not s.window)[3])  # fmt: skip
            cos = torch.einsum("bhwd,nd->bhwn", feats, texts)
            for window in cos:
                per = window.unflatten(-1, (-1, n))  # h x w x (E + 1) x N
                probs = (_upsampled(per[..., e, :], s.logit_scale, size, e) for e in range(per.shape[2] - 1))
                fused.append(fuse(probs, _upsampled(per[..., -1, :], s.logit_scale, size)).permute(1, 2, 0))
        return window_cosine_map(run, boxes, torch.stack(fused), run.out_size)


FORWARDS.register(FORWARD, FlossForward(), help="FLOSS: the windows with C + 1 classifiers (per-class expert templates) fused at each window's pixels")


def _floss_arg(arg: str) -> str:
    """auto, a file that exists, or a `.json` path (a rank file still to be written): a typo such as `floss:atuo`
    is refused when the spec is read, not after the model has loaded."""
    if arg != AUTO and not (arg.endswith(".json") or Path(arg).is_file()):
        raise UserValueError(
            f"bad option floss:{arg}: write floss:auto (the rank file `floss rank` writes by default) or floss:PATH (a FLOSS rank file, .json)"
        )
    return arg


register_option(
    "floss",
    _floss_arg,
    help="floss:auto|PATH (FLOSS: per-class expert templates from a rank file, `clipseg-sparse floss rank`; the floss forward)",
    rest_of_spec=True,
    needs=lambda arg: Needs(forward=((FORWARD, f"floss:{arg}"),)),
)


# -- the offline ranking ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
    """Per template and class: the sum of the entropies of the pixels it predicts as that class (float64) and their
    count; the pixels of every image seen; the images done."""

    sums: np.ndarray  # T x C
    counts: np.ndarray  # T x C
    pixels: float = 0.0
    done: list[str] = dataclasses.field(default_factory=list)

    def add(self, probs: torch.Tensor, t: int) -> None:
        """C x h x W class probabilities of template t (a band of rows)."""
        labels = probs.argmax(0).flatten()
        entropy = -(probs * torch.log(probs + EPSILON)).sum(0).flatten().double()
        C = probs.shape[0]
        self.sums[t] += torch.zeros(C, dtype=torch.float64, device=probs.device).index_add_(0, labels, entropy).cpu().numpy()
        self.counts[t] += torch.bincount(labels, minlength=C).cpu().numpy()


def rankings_json(tally: Tally, labels: Sequence[str], meta: Mapping) -> dict:
    """FLOSS's rank file (`compute_metrics`): per class every template's mean entropy and pixel share (0 and 0 for a
    class it never predicts), sorted by entropy (stable), ranked from 1."""
    classes = {}
    for c, label in enumerate(labels):
        rows = []
        for t in range(tally.sums.shape[0]):
            count = tally.counts[t, c]
            rows.append({
                "template_id": t,
                "entropy": float(tally.sums[t, c] / count) if count > 0 else 0.0,
                "pixel_percentage": float(count / tally.pixels * 100) if count > 0 else 0.0,
            })  # fmt: skip
        rows.sort(key=lambda r: r["entropy"])
        classes[label] = {"entropy_ranking": [{**r, "rank": i + 1} for i, r in enumerate(rows)]}
    return {"model": meta["model"], "dataset": meta.get("dataset", ""), "split": "unlabeled", "clipseg_sparse": dict(meta), "classes": classes}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(path)


def rank_templates(
    segmenter, images: Sequence[tuple[Path, str]], out: Path, note: Callable[[str], None] = lambda s: None,
    progress: bool = False, band: int = 20_000_000,
) -> dict:
    """FLOSS's offline step: rank the 80 templates per class on `images` ((path, name) pairs) with `segmenter`'s
    model, base spec (its `floss` option dropped), settings and vocabulary; write FLOSS's rank file to `out`.

    Resumable: the tally is saved next to `out` (`OUT.partial.json`) after every image, and a re-run with the same
    model, spec, settings and names goes on from it (another configuration: a one-line error). An image that cannot
    be read is skipped with a note. band: elements of cosine per band of rows (80 x names x rows x width)."""
    from ..runtime.progress import inner_progress
    from ..segment.images import load_image

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clip, vocabulary = segmenter.clip, segmenter.vocabulary
    spec = base_spec(segmenter.spec)
    if spec != segmenter.spec or segmenter.plan.forward_name == FORWARD:
        segmenter = type(segmenter)(clip, vocabulary, spec, segmenter.settings, segmenter.templates, resources=segmenter.resources)
    meta = json.loads(json.dumps({"model": clip.model_name, "weights": clip.pretrained, "spec": str(spec), "names": list(vocabulary.flat_names),
                                  "classes": list(vocabulary.labels), "settings": dataclasses.asdict(segmenter.settings)}))  # as the files hold it
    partial = out.with_name(out.name + ".partial.json")
    templates = openai_imagenet_templates()
    T, C = len(templates), len(vocabulary)
    tally = Tally(np.zeros((T, C)), np.zeros((T, C)))
    if partial.is_file():
        saved = json.loads(partial.read_text(encoding="utf-8"))
        if saved["meta"] != meta:
            raise UserValueError(f"{partial}: an unfinished ranking of another model, spec, settings or names; remove it or rank with those (its spec {saved['meta']['spec']})")
        tally = Tally(np.array(saved["sums"]), np.array(saved["counts"]), saved["pixels"], saved["done"])
        note(f"resuming the ranking in {partial}: {len(tally.done)} of {len(images)} images done")
    names = vocabulary.flat_names
    text = clip.encode_text([t.format(n) for t in templates for n in names])  # T N x D, single templates
    index = torch.as_tensor(vocabulary.name_to_class, device=clip.device)
    done = set(tally.done)
    todo = [(p, n) for p, n in images if n not in done]
    with inner_progress("images", "floss rank", show=progress) as tell:
        tell(len(images) - len(todo), len(images))
        for i, (path, name) in enumerate(todo, len(images) - len(todo) + 1):
            try:
                rgb = load_image(path)
            except UserError as e:  # an unreadable image: skipped, said
                note(f"skipped {name}: {e}")
                tell(i, len(images))
                continue
            run = dataclasses.replace(segmenter.image_run(rgb), text=text)
            with torch.inference_mode():
                cosine = segmenter.plan.forward.cosine(run)
                height, width = rgb.shape[:2]
                rows = max(1, band // (len(text) * width))
                for y0 in range(0, height, rows):
                    logits = cosine.rows(y0, min(height, y0 + rows)).float().unflatten(0, (T, len(names)))
                    for t in range(T):
                        probs = torch.softmax(segmenter.settings.logit_scale * logits[t], dim=0)
                        if len(names) != C:  # the max over each class's names
                            spread = index.view(-1, 1, 1).expand_as(probs)
                            probs = torch.zeros(C, *probs.shape[1:], device=probs.device).scatter_reduce_(0, spread, probs, "amax", include_self=False)
                        tally.add(probs, t)
            tally.pixels += height * width
            tally.done.append(name)
            _write_json(partial, {"meta": meta, "sums": tally.sums.tolist(), "counts": tally.counts.tolist(), "pixels": tally.pixels, "done": tally.done})
            tell(i, len(images))
    if not tally.done:
        raise UserValueError("floss rank: no image could be read; nothing was ranked")
    result = rankings_json(tally, vocabulary.labels, {**meta, "images": len(tally.done)})
    _write_json(out, result)
    partial.unlink(missing_ok=True)
    return result


# -- presets, protocols, published numbers ----------------------------------------------------------------------------
FLOSS_NOTES = (
    "copied: experts per name (synonyms included), each with the top 4 templates of its class whose pixel share is "
    "above 0; every classifier's softmax at the logit scale (100, NACLIP's default in FLOSS) upsampled to the window "
    "before the fusion; the fused probabilities averaged over windows and resized; then softmax(100 x fused) and the "
    "max over synonyms; PAMR off (`tools/eval_naclip.py` sets pamr_steps 0); the ranking's entropy over the classes "
    "after the max over synonyms, log(p + 1e-10), classes never predicted ranked with entropy 0 and share 0; "
    "fixed: the ranking needs no labels and no train split (any unlabeled images; FLOSS reads the train split and "
    "also scores it against the ground truth); "
    "not copied: fp16 tallies on ADE20K and COCO-Stuff; its rankings (no licence): rank your images or download them"
)
NACLIP_FLOSS = f"{PRESETS.get('naclip').spec}/floss:{AUTO}"
register_preset("naclip+floss", NACLIP_FLOSS, "FLOSS (ICCV 2025) on NACLIP: per-class expert templates (floss:auto: the rank file of `floss rank`)", FLOSS_NOTES)
register_entmax_variant("naclip+floss")
register_preset("maskclip+floss", f"{PRESETS.get('maskclip').spec}/floss:{AUTO}", "FLOSS (ICCV 2025) on MaskCLIP (floss:auto)", FLOSS_NOTES)

# configs/naclip/*.py: Resize (2048, 336) keep_ratio (Cityscapes 560), slide 224 / 112 (VOC20 slide_crop=0), logit
# scale 100 (the class default), PAMR off, SCLIP's class files; five benchmarks without background.
PROTOCOL = PROTOCOLS.register(
    "floss",
    Protocol(
        name="floss",
        attention="naclip+floss",
        class_names="sclip",
        source="yasserben/FLOSS@ccf1d49 configs/naclip/*.py, tools/eval_naclip.py, naclip.py",
        defaults={**SCLIP_LINE, "logit_scale": 100.0},
        per_dataset={"voc20": dict(window=0), "cityscapes": dict(resolution=560)},
    ),
    help="FLOSS (ICCV 2025) on NACLIP: short side 336 (Cityscapes 560), 224 windows at stride 112 (VOC20 whole image), "
    "logit scale 100, PAMR off; needs a rank file (floss:auto or floss:PATH)",
)
# configs/_base_/models/maskclip.py, configs/_base_/datasets/*.py: OpenCLIP LAION-2B B/16, test_scale (2048, 448)
# (Cityscapes (896, 448)), slide 448 / 224, tau 0.01.
PROTOCOL_MASKCLIP = PROTOCOLS.register(
    "floss-maskclip",
    Protocol(
        name="floss-maskclip",
        attention="maskclip+floss",
        class_names="plain",
        source="yasserben/FLOSS@ccf1d49 configs/_base_/models/maskclip.py, configs/_base_/datasets/*.py",
        defaults={**MMSEG_CODE, **dict(resolution=448, window=448, stride=224, logit_scale=100.0)},
        per_dataset={"cityscapes": dict(max_long_side=896)},
        model="ViT-B-16",
        pretrained="laion2b_s34b_b88k",
    ),
    help="FLOSS (ICCV 2025) on MaskCLIP (CLIP-DINOiser's, OpenCLIP LAION-2B): short side 448, 448 windows at stride 224",
)

# README.md Results: the five benchmarks without background (OpenAI B/16 for NACLIP; MaskCLIP as configured above).
README = ("cityscapes", "voc20", "context59", "ade20k", "coco-stuff")
register_published(PROTOCOL, dict(zip(README, (37.0, 80.2, 35.9, 18.4, 23.6))), "yasserben/FLOSS@ccf1d49 README.md (Results, NACLIP + FLOSS)",
                   note="five sets, printed average 39.0; NACLIP alone in the same table: 35.5 / 79.7 / 35.2 / 17.4 / 23.3, 38.2")  # fmt: skip
register_published(PROTOCOL_MASKCLIP, dict(zip(README, (25.8, 61.8, 26.2, 14.9, 17.8))), "yasserben/FLOSS@ccf1d49 README.md (Results, MaskCLIP + FLOSS)",
                   note="five sets, printed average 29.3; MaskCLIP alone: 25.0 / 61.8 / 25.5 / 14.2 / 17.5, 28.7")  # fmt: skip

