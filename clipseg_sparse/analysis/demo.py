"""A local Gradio demo: upload an image, type classes, compare presets side by side, click for attention.

Needs the optional extra (`pip install -e ".[demo]"`). Runs on localhost only (no share link):

    demo = build_demo(load_clip("ViT-B-16", pretrained=None))     # random weights work, labelled so
    demo.launch(server_name="127.0.0.1", server_port=7860)

Two API endpoints (usable with `gradio_client`): `/predict` (image, classes, presets) -> one overlay
per preset, and `/attention` (image, classes, presets, x, y) -> one attention map per preset for the
patch under pixel (x, y). Clicking the input image fills x, y and calls `/attention`.
"""

from functools import lru_cache
from typing import Sequence

import numpy as np

from ..errors import UserError
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


class DemoError(UserError, ValueError):
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
    """The demo's computations, without Gradio: one model, segmenters cached per (classes, preset)."""

    def __init__(self, clip: DenseCLIP, settings: InferenceSettings | None = None, templates: str = "openai") -> None:
        self.clip = clip
        self.settings = settings or InferenceSettings()
        self.templates = templates
        self.segmenter = lru_cache(maxsize=16)(self._segmenter)

    def _segmenter(self, classes: str, preset: str) -> Segmenter:
        return Segmenter(self.clip, _vocabulary(classes), preset, self.settings, self.templates)

    def predict(self, image: np.ndarray, classes: str, presets: Sequence[str]) -> list[tuple[np.ndarray, str]]:
        """One (overlay with legend, caption) per preset."""
        from ..files.outputs import overlay_image

        rgb = _check(image, presets)
        out = []
        for preset in presets:
            result = self.segmenter(classes, preset).predict(rgb)
            overlay = overlay_image(rgb, result.labels, result.present(), result.class_names)
            out.append((np.asarray(overlay), f"{preset} ({result.settings['attention']})"))
        return out

    def attention(self, image: np.ndarray, classes: str, presets: Sequence[str], x: float, y: float) -> list[tuple[np.ndarray, str]]:
        """One (attention map of the patch under (x, y), title with entropy / support) per preset."""
        from .explain import attention_image, explain

        rgb = _check(image, presets)
        try:
            views = explain(self.clip, rgb, _vocabulary(classes), list(presets), (int(x), int(y)), self.settings, self.templates)
        except ValueError as e:  # a point outside the image
            raise DemoError(str(e)) from None
        return [(attention_image(v), f"{p}: {v.title.splitlines()[1]}") for p, v in zip(presets, views)]


def build_demo(clip: DenseCLIP, settings: InferenceSettings | None = None, templates: str = "openai", presets: Sequence[str] = DEFAULT_PRESETS):
    """The Gradio Blocks app (not launched)."""
    import gradio as gr

    from ..attention import list_presets

    model = DemoModel(clip, settings, templates)

    def guarded(fn):
        def call(*args):
            try:
                return fn(*args)
            except DemoError as e:
                raise gr.Error(str(e)) from None

        return call

    with gr.Blocks(title="clipseg-sparse demo", analytics_enabled=False) as demo:
        gr.Markdown(f"## clipseg-sparse: open-vocabulary segmentation with sparse attention\nModel **{clip.model_name}**, weights **{clip.pretrained}**.")
        if clip.pretrained == "none":
            gr.Markdown(RANDOM_WEIGHTS_NOTE, elem_id="random-weights")
        with gr.Row():
            with gr.Column():
                image = gr.Image(label="image (click a point to see its attention)", type="pil", elem_id="input-image")
                classes = gr.Textbox(label='classes ("," between classes, "|" between synonyms)', value="sky,tree,grass,building|house,road")
                chosen = gr.CheckboxGroup(list_presets(), value=list(presets), label="presets to compare")
                run = gr.Button("segment", variant="primary")
                with gr.Row():
                    x = gr.Number(label="x", value=0, precision=0)
                    y = gr.Number(label="y", value=0, precision=0)
                show = gr.Button("show attention at (x, y)")
            with gr.Column():
                masks = gr.Gallery(label="segmentation per preset", columns=2, height="auto")
                maps = gr.Gallery(label="attention of the clicked patch (grey: exactly zero)", columns=2, height="auto")
        run.click(guarded(model.predict), [image, classes, chosen], masks, api_name="predict")
        show.click(guarded(model.attention), [image, classes, chosen, x, y], maps, api_name="attention")

        def clicked(evt: gr.SelectData):  # a real annotation (no postponed ones in this module): Gradio reads it
            return evt.index[0], evt.index[1]

        image.select(clicked, None, [x, y], api_name=False).then(guarded(model.attention), [image, classes, chosen, x, y], maps, api_name=False)
    return demo


def launch(demo, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """Serve on localhost (never a public share link); returns what Blocks.launch returns."""
    return demo.launch(server_name=host, server_port=port, share=False, ssr_mode=False, prevent_thread_lock=not block, quiet=True)
