"""A local Gradio demo: upload an image, type classes, compare presets side by side, click for attention.

Needs the optional extra (`pip install -e ".[demo]"`). Runs on localhost only (no share link):

    demo = build_demo(load_clip("ViT-B-16", pretrained=None))     # random weights work, labelled so
    demo.launch(server_name="127.0.0.1", server_port=7860)

The page offers the methods this model can run (a ViT-L preset on a ViT-B is left out, and so are presets
that read region maps unless the demo has a region source, `--regions sam2`, presets with a retrieval
stage, and presets whose backbone weights are not at hand offline; the left-out ones are listed with the
reason), each with its entmax twin behind one normalizer choice. Two API endpoints (usable with
`gradio_client`): `/predict` (image, classes, methods, normalizer) -> one overlay per preset, and
`/attention` (image, classes, methods, normalizer, x, y) -> one attention map per preset for the patch
under pixel (x, y). Clicking the input image fills x, y and calls `/attention`. Every error (a bad class
list, missing backbone weights) is shown in the page.
"""

from functools import lru_cache
from typing import Sequence

import numpy as np

from ..errors import UserError, UserValueError
from ..segment.images import load_image
from ..segment.segmenter import Segmenter
from ..segment.settings import InferenceSettings
from ..models.clip import DenseCLIP
from ..segment.vocabulary import Vocabulary

DEFAULT_PRESETS = ("sclip", "sclip-entmax")
RANDOM_WEIGHTS_NOTE = (
    "**Random weights** (`--pretrained none`): the masks and maps below are meaningless; they show what the "
    "tool computes, not what CLIP sees."
)


class DemoError(UserValueError):
    """Bad input in the demo form (shown to the user in the page)."""


def _vocabulary(classes: str) -> Vocabulary:
    """The typed classes; a repeated name is refused as `segment` refuses it (it could never win)."""
    try:
        vocabulary = Vocabulary.parse(classes or "")
        vocabulary.check_unique()
        return vocabulary
    except ValueError as e:
        raise DemoError(str(e)) from None


def _check(image, presets: Sequence[str]) -> np.ndarray:
    """The upload as H x W x 3 uint8 RGB (a PIL image from the page: palette GIFs, animated ones by their
    first frame, RGBA and grey images as the CLI reads them; or an array)."""
    if image is None:
        raise DemoError("upload an image first")
    if not presets:
        raise DemoError("pick at least one preset")
    try:
        return load_image(image)
    except ValueError as e:
        raise DemoError(str(e)) from None


class DemoModel:
    """The demo's computations, without Gradio: one model, segmenters cached per (classes, preset).
    regions: the region source of presets that read region maps (CorrCLIP: `--regions sam2`)."""

    def __init__(self, clip: DenseCLIP, settings: InferenceSettings | None = None, templates: str = "openai", regions=None) -> None:
        self.clip = clip
        self.settings = settings or InferenceSettings()
        self.templates = templates
        self.regions = regions
        self.segmenter = lru_cache(maxsize=16)(self._segmenter)

    def _segmenter(self, classes: str, preset: str) -> Segmenter:
        try:
            return Segmenter(self.clip, _vocabulary(classes), preset, self.settings, self.templates, regions=self.regions)
        except (UserError, ValueError) as e:  # a preset this model or this demo cannot run: said in the page
            raise DemoError(f"{preset}: {e}") from None

    def predict(self, image: np.ndarray, classes: str, presets: Sequence[str]) -> list[tuple[np.ndarray, str]]:
        """One (overlay with legend, caption) per preset."""
        from ..files.outputs import overlay_image

        rgb = _check(image, presets)
        out = []
        for preset in presets:
            try:
                result = self.segmenter(classes, preset).predict(rgb)
            except (UserError, ValueError) as e:  # missing backbone weights, a region source, ...
                raise DemoError(f"{preset}: {e}") from None
            overlay = overlay_image(rgb, result.labels, result.present(), result.class_names)
            out.append((np.asarray(overlay), f"{preset} ({result.settings['attention']})"))
        return out

    def attention(self, image: np.ndarray, classes: str, presets: Sequence[str], x: float, y: float) -> list[tuple[np.ndarray, str]]:
        """One (attention map of the patch under (x, y), title with entropy / support) per preset."""
        from .explain import attention_image, explain

        rgb = _check(image, presets)
        try:
            views = explain(self.clip, rgb, _vocabulary(classes), list(presets), (int(x), int(y)), self.settings, self.templates, regions=self.regions)
        except (UserError, ValueError) as e:  # a point outside the image, a preset that cannot run
            raise DemoError(str(e)) from None
        return [(attention_image(v), f"{p}: {v.title.splitlines()[1]}") for p, v in zip(presets, views)]


ENTMAX_SUFFIX = "-entmax"
NORMALIZERS = ("softmax", "entmax:1.5", "both")


def offered_presets(clip: DenseCLIP, regions=None) -> tuple[list[str], dict[str, str]]:
    """(presets this demo can run, {preset it cannot: why}), in `ls presets` order. Left out: a spec deeper
    than the model (a ViT-L preset on a ViT-B), one that reads region maps when the demo has no region
    source, one with a retrieval stage (the demo takes no image bank), and one whose external backbone's
    weights cannot be had now (`missing_weights`: looks at files, loads and downloads nothing)."""
    from ..attention import list_presets, resolve_spec
    from ..models.proxies import missing_weights

    why: dict[str, str | None] = {}
    backbones: dict[str, list[str]] = {}
    for name in list_presets():
        spec = resolve_spec(name)
        try:
            clip.check_spec(spec)
        except (UserError, ValueError):
            why[name] = f"needs more blocks than {clip.model_name} has ({clip.depth}), e.g. a ViT-L"
            continue
        if spec.needs.regions and regions is None:
            why[name] = "needs region masks: start the demo with --regions sam2"
        elif spec.needs.bank:
            why[name] = f"{spec.needs.bank} needs an image bank, which the demo does not take: run it with `clipseg-sparse segment --bank BANK`"
        else:
            why[name], backbones[name] = None, list(spec.needs.backbones)
    missing = missing_weights(list(dict.fromkeys(b for names in backbones.values() for b in names)), clip)
    for name, names in backbones.items():
        lacking = [b for b in names if b in missing]
        if lacking:
            files = ",".join(f"{b}=FILE" for b in lacking)
            why[name] = f"needs backbone weights: {'; '.join(missing[b] for b in lacking)}; run any command with this preset once online, or start the demo with --proxy-weights {files}"
    return [n for n, w in why.items() if w is None], {n: w for n, w in why.items() if w is not None}


def methods_of(presets: Sequence[str]) -> dict[str, dict[str, str]]:
    """Method -> {"softmax": preset, "entmax:1.5": its -entmax twin} over `presets` (a method without an
    entmax twin, e.g. clip or lposs, has only its published preset)."""
    methods: dict[str, dict[str, str]] = {}
    for name in presets:
        base = name[: -len(ENTMAX_SUFFIX)] if name.endswith(ENTMAX_SUFFIX) else name
        methods.setdefault(base, {})["entmax:1.5" if name.endswith(ENTMAX_SUFFIX) and base in presets else "softmax"] = name
    return {m: v for m, v in methods.items() if "softmax" in v}


def presets_for(methods: dict[str, dict[str, str]], chosen: Sequence[str], normalizer: str) -> list[str]:
    """The presets of the chosen methods with the chosen normalizer(s); a method without an entmax twin
    runs as published when entmax alone is asked for."""
    if normalizer not in NORMALIZERS:
        raise DemoError(f"normalizer must be one of {', '.join(NORMALIZERS)}")
    wanted = ("softmax", "entmax:1.5") if normalizer == "both" else (normalizer,)
    out = []
    for method in chosen:
        variants = methods.get(method)
        if variants is None:
            raise DemoError(f"{method}: not offered by this demo")
        picked = [variants[w] for w in wanted if w in variants] or [variants["softmax"]]
        out += [p for p in picked if p not in out]
    return out


def build_demo(clip: DenseCLIP, settings: InferenceSettings | None = None, templates: str = "openai", presets: Sequence[str] = DEFAULT_PRESETS,
               regions=None):  # fmt: skip
    """The Gradio Blocks app (not launched): methods (each preset and its `-entmax` twin) it can run with
    this model and region source, a normalizer choice, errors shown in the page."""
    import gradio as gr

    model = DemoModel(clip, settings, templates, regions)
    offered, left_out = offered_presets(clip, regions)
    methods = methods_of(offered)
    chosen_methods = list(dict.fromkeys(m for m, v in methods.items() if set(v.values()) & set(presets))) or list(methods)[:1]

    def guarded(fn):
        def call(*args):
            try:
                return fn(*args)
            except (DemoError, UserError, ValueError) as e:  # shown in the page, never a spinner left turning
                raise gr.Error(str(e)) from None

        return call

    def predict(image, classes: str, chosen: Sequence[str], normalizer: str):
        return model.predict(image, classes, presets_for(methods, chosen, normalizer))

    def attention(image, classes: str, chosen: Sequence[str], normalizer: str, x: float, y: float):
        return model.attention(image, classes, presets_for(methods, chosen, normalizer), x, y)

    with gr.Blocks(title="clipseg-sparse demo", analytics_enabled=False) as demo:
        gr.Markdown(f"## clipseg-sparse: open-vocabulary segmentation with sparse attention\nModel **{clip.model_name}**, weights **{clip.pretrained}**.")
        if clip.pretrained == "none":
            gr.Markdown(RANDOM_WEIGHTS_NOTE, elem_id="random-weights")
        with gr.Row():
            with gr.Column():
                image = gr.Image(label="image (click a point to see its attention)", type="pil", elem_id="input-image")
                classes = gr.Textbox(label='classes ("," between classes, "|" between synonyms)', value="sky,tree,grass,building|house,road")
                chosen = gr.CheckboxGroup(list(methods), value=chosen_methods, label="methods to compare", elem_id="methods")
                normalizer = gr.Radio(list(NORMALIZERS), value="both", label="attention normalizer (softmax as published, entmax 1.5, or both side by side)",
                                      elem_id="normalizer")  # fmt: skip
                run = gr.Button("segment", variant="primary")
                with gr.Row():
                    x = gr.Number(label="x", value=0, precision=0)
                    y = gr.Number(label="y", value=0, precision=0)
                show = gr.Button("show attention at (x, y)")
                if left_out:
                    with gr.Accordion(f"{len(left_out)} presets not offered here", open=False):
                        gr.Markdown("\n".join(f"- `{name}`: {why}" for name, why in left_out.items()), elem_id="left-out")
            with gr.Column():
                masks = gr.Gallery(label="segmentation per preset", columns=2, height="auto")
                maps = gr.Gallery(label="attention of the clicked patch (grey: exactly zero)", columns=2, height="auto")
        run.click(guarded(predict), [image, classes, chosen, normalizer], masks, api_name="predict")
        show.click(guarded(attention), [image, classes, chosen, normalizer, x, y], maps, api_name="attention")

        def clicked(evt: gr.SelectData):  # a real annotation (no postponed ones in this module): Gradio reads it
            return evt.index[0], evt.index[1]

        image.select(clicked, None, [x, y], api_name=False).then(guarded(attention), [image, classes, chosen, normalizer, x, y], maps, api_name=False)
    return demo


def launch(demo, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """Serve on localhost (never a public share link); returns what Blocks.launch returns."""
    return demo.launch(server_name=host, server_port=port, share=False, ssr_mode=False, prevent_thread_lock=not block, quiet=True)
