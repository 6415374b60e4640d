"""Why a pixel got its label: the attention row of the patch under a point, next to the segmentation.

    views = explain(clip, "house.jpg", "sky,tree,house", ["sclip", "sclip-entmax"], point=(120, 80))
    figure = render_explain(views)            # one row per spec: attention map | overlay
    views[0].attention                         # h x w, the query patch's attention over the patches

The attention is that of the last edited block over the whole image (one forward, no windows), so the
map covers the image, on the grid the spec attends over (CLIP's patches, or an external backbone's:
CorrCLIP's DINO ViT-B/8 grid is twice as fine); presets that read region maps (CorrCLIP) take a region
source, and those with a retrieval stage (CorrCLIPv2) an image bank. Its input is what `eval` cuts its
windows from under the same settings (the protocol's resize, rounding, positional-embedding and remainder
rules, `segment.preprocess.prepare`).
Entries that entmax sets to exactly zero stay zero: they are drawn as the plain greyscale image,
everything else on a colour scale. The row's statistics are those of `analysis` (entropy in nats,
support = exp(entropy), exact non-zero count), averaged over heads unless one head is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from .statistics import check_tokens, normalize_rows, row_entropy
from ..attention import AttentionSpec
from ..errors import UserValueError
from ..segment.bank import ImageBank
from ..segment.images import load_image
from ..segment.resources import Resources
from ..segment.segmenter import Segmenter
from ..segment.settings import InferenceSettings
from ..models.clip import DenseCLIP
from ..files.outputs import overlay_image


@dataclass
class ExplainView:
    """One spec's view of one point.

    attention: h x w float64, the query patch's attention over the patch grid (CLS column, if any, dropped; the
    head mean unless `head` was given); exact zeros are entmax's. labels: H x W class indices at the
    original size. query: (row, col) of the query patch on the grid; scale: original pixels per grid
    cell (y, x). entropy / support / nonzero: statistics of the full row (CLS included), head-averaged.
    """

    spec: str
    attention: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    present: dict[str, float]
    query: tuple[int, int]
    scale: tuple[float, float]
    entropy: float
    support: float
    nonzero: float
    tokens: int
    heads: str
    rgb: np.ndarray
    point: tuple[int, int]

    @property
    def title(self) -> str:
        return (
            f"{self.spec}\nentropy {self.entropy:.2f} nats, support exp(H) {self.support:.1f}, "
            f"non-zero {self.nonzero:.1f}/{self.tokens} ({self.heads})"
        )


def query_patch(
    point: tuple[int, int],
    image_size: tuple[int, int],
    resized: tuple[int, int],
    patch: int | tuple[float, float],
    grid: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """(row, col) of the patch under pixel `point` = (x, y) of the original image (H, W). patch: resized
    pixels per grid cell (one side, or (y, x): an external backbone's grid need not be CLIP's). grid: the
    patches encoded per side; a pixel past the last one (remainder rule drop) gets the last."""
    x, y = point
    height, width = image_size
    if not (0 <= x < width and 0 <= y < height):
        raise UserValueError(f"point ({x}, {y}) is outside the {width} x {height} image")
    cell_y, cell_x = patch if isinstance(patch, tuple) else (patch, patch)
    row, col = int(y * resized[0] / height / cell_y), int(x * resized[1] / width / cell_x)
    return (row, col) if grid is None else (min(row, grid[0] - 1), min(col, grid[1] - 1))


def explain(
    clip: DenseCLIP,
    image,
    vocabulary,
    specs: Sequence[AttentionSpec | str],
    point: tuple[int, int],
    settings: InferenceSettings | None = None,
    templates: str | Sequence[str] = "openai",
    head: int | None = None,
    regions: Callable[[np.ndarray, str], np.ndarray] | None = None,
    name: str | None = None,
    bank: ImageBank | None = None,
    resources: Resources | None = None,
) -> list[ExplainView]:
    """One ExplainView per spec for the pixel `point` = (x, y) of `image` (a path, PIL image or array).

    The segmentation uses `settings` (windows included); the attention is the spec's forward's
    (`Forward.attention`) on one window holding the whole image cut from the pixels the windows are cut from
    (`Segmenter.pixels`), with the settings' `pos_interp` and `remainder`; a forward whose attention spans the
    image already (OV-Stitcher's stitched windows) keeps its windows.
    head: one attention head (0-based) instead of the mean over heads. The spec's windows, at-input and post
    stages act after the attention: the segmentation runs them (`Segmenter.predict`), the attention map is
    the same with or without them. regions: the region source of specs that read region maps (as
    `Segmenter`'s; required by them), whose map of the image scopes both the attention and the
    segmentation; name: the image's name for it (default: a path's file name). Whole-image features of an
    external backbone (CorrCLIPv2's `ext:NAME.image` taps) are computed as the Segmenter computes them and
    reach the attention forward too. bank: the image bank of specs with a retrieval stage (as `Segmenter`'s;
    required by them), which acts after the attention: it changes the segmentation, not the map.
    resources: the inputs of the specs (`segment.Resources`) in place of `regions` and `bank`.
    """

    rgb = load_image(image)
    if name is None and isinstance(image, (str, Path)):
        name = Path(image).name
    settings = settings or InferenceSettings()
    height, width = rgb.shape[:2]
    views = []
    for spec in specs:
        seg = Segmenter(clip, vocabulary, spec, settings, templates, regions=regions, bank=bank, resources=resources)
        spec, forward = seg.spec, seg.plan.forward
        run = seg.image_run(rgb, seg.region_map(rgb, name))
        size = run.size
        # one window over the whole image (the forward's own windows where its attention is image-wide already)
        window = next(forward.attention(run, whole_image=not forward.image_wide))
        att_grid, maps = window.grid, window.maps  # heads x N x N
        cell = (window.crop[0] / att_grid[0], window.crop[1] / att_grid[1])  # resized pixels per attention cell
        row, col = query_patch(point, (height, width), size, cell, att_grid)
        check_tokens(maps.shape[-1], att_grid[0] * att_grid[1], spec)
        cls = int(maps.shape[-1] == att_grid[0] * att_grid[1] + 1)  # CLS first, unless the spec drops it (cls:C)
        if head is not None and not 0 <= head < maps.shape[0]:
            raise UserValueError(f"head {head} does not exist: the model has {maps.shape[0]} heads (0..{maps.shape[0] - 1})")
        rows = normalize_rows(maps[:, cls + row * att_grid[1] + col])  # heads x N
        rows = rows[head : head + 1] if head is not None else rows
        entropy = row_entropy(rows)
        result = seg.predict(rgb, name)
        views.append(
            ExplainView(
                spec=str(spec),
                attention=rows.mean(0)[cls:].reshape(att_grid).cpu().numpy(),
                labels=result.labels,
                class_names=result.class_names,
                present=result.present(),
                query=(row, col),
                scale=(height / size[0] * cell[0], width / size[1] * cell[1]),
                entropy=float(entropy.mean()),
                support=float(entropy.exp().mean()),
                nonzero=float((rows > 0).sum(-1).double().mean()),
                tokens=int(rows.shape[-1]),
                heads=f"head {head}" if head is not None else f"mean of {maps.shape[0]} heads",
                rgb=rgb,
                point=tuple(point),
            )
        )
    return views


def explain_pipeline(segmenter, image, point: tuple[int, int], head: int | None = None, name: str | None = None) -> ExplainView:
    """The view of a pipeline whose decoder attends from object queries to the image (SAM 3: a segmenter with
    `query_attention`): the label at `point` = (x, y) is the argmax of the class scores there; the view shows
    the image attention (the last decoder layer's, head mean unless `head`) of the query behind it, the
    instance with the highest object score among the kept instances of that class's names (their best query
    when none is kept), on the detector's token grid over the image (which SAM 3 squashes to a square)."""
    if not hasattr(segmenter, "query_attention"):
        raise UserValueError(f"{segmenter.config()['attention']}: this pipeline shows no attention to explain")
    rgb = load_image(image)
    height, width = rgb.shape[:2]
    x, y = point
    if not (0 <= x < width and 0 <= y < height):
        raise UserValueError(f"point ({x}, {y}) is outside the {width} x {height} image")
    scores = segmenter.scores(rgb)
    labels = segmenter.predict_labels(rgb, name)
    winner = int(scores[:, y, x].argmax())
    att = segmenter.query_attention(rgb)
    names = [i for i, c in enumerate(att.name_class) if c == winner]
    candidates = [(float(att.scores[i, q]), i, q) for i in names for q in range(att.scores.shape[1]) if att.kept[i, q]]
    if not candidates:
        candidates = [(float(att.scores[i].max()), i, int(att.scores[i].argmax())) for i in names]
    _, i, q = max(candidates)
    rows = att.rows[i][:, q]  # heads x (h * w)
    if head is not None and not 0 <= head < rows.shape[0]:
        raise UserValueError(f"head {head} does not exist: the decoder has {rows.shape[0]} heads (0..{rows.shape[0] - 1})")
    rows = normalize_rows(rows[head : head + 1] if head is not None else rows)
    entropy = row_entropy(rows)
    gh, gw = att.grid
    counts = np.bincount(labels.ravel(), minlength=len(segmenter.class_names))
    return ExplainView(
        spec=f"{segmenter.config()['attention']} (query {q} of {segmenter.vocabulary.flat_names[i]!r}, score {float(att.scores[i, q]):.2f})",
        attention=rows.mean(0).reshape(gh, gw).cpu().numpy(),
        labels=labels,
        class_names=segmenter.class_names,
        present={segmenter.class_names[c]: counts[c] / counts.sum() for c in np.argsort(-counts, kind="stable") if counts[c]},
        query=(min(int(y * gh / height), gh - 1), min(int(x * gw / width), gw - 1)),
        scale=(height / gh, width / gw),
        entropy=float(entropy.mean()),
        support=float(entropy.exp().mean()),
        nonzero=float((rows > 0).sum(-1).double().mean()),
        tokens=int(rows.shape[-1]),
        heads=f"head {head}" if head is not None else f"mean of {att.rows.shape[1]} heads",
        rgb=rgb,
        point=tuple(point),
    )


def attention_image(view: ExplainView, colormap: str = "inferno") -> np.ndarray:
    """H x W x 3 uint8: the image in grey where the attention is exactly 0, coloured by sqrt(attention /
    max) elsewhere (the square root shows the tail next to the usually dominant query patch) (each grid cell a block, no smoothing, so the support stays exact); the query point ringed."""
    from matplotlib import colormaps

    height, width = view.labels.shape
    cells = np.floor(np.arange(height) / view.scale[0]).astype(int), np.floor(np.arange(width) / view.scale[1]).astype(int)
    att = view.attention[np.minimum(cells[0], view.attention.shape[0] - 1)][:, np.minimum(cells[1], view.attention.shape[1] - 1)]
    grey = view.rgb.astype(np.float32).mean(-1, keepdims=True).repeat(3, -1) * 0.6
    colours = colormaps[colormap](np.sqrt(att / max(att.max(), 1e-12)))[..., :3] * 255
    out = np.where((att > 0)[..., None], 0.25 * grey + 0.75 * colours, grey)
    return _ring(out.astype(np.uint8), view.point)


def _ring(rgb: np.ndarray, point: tuple[int, int]) -> np.ndarray:
    img = Image.fromarray(rgb)
    r = max(4, min(img.size) // 40)
    x, y = point
    draw = ImageDraw.Draw(img)
    draw.ellipse((x - r, y - r, x + r, y + r), outline=(0, 255, 255), width=max(2, r // 3))
    return np.asarray(img)


def overlay_with_point(view: ExplainView) -> np.ndarray:
    """The segmentation overlay (image blended with class colours, legend of the classes present)."""
    return _ring(np.asarray(overlay_image(view.rgb, view.labels, view.present, view.class_names)), view.point)


def render_explain(views: Sequence[ExplainView], caption: str = "", width_inches: float = 10.0, dpi: int = 100):
    """A matplotlib Figure: one row per view, attention map | segmentation overlay, titled with the spec
    and the row's statistics, under an optional caption (model, weights). Size: width_inches x (rows *
    row height) at `dpi`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    height, width = views[0].labels.shape
    row_height = width_inches / 2 * height / width + 0.8
    fig = Figure(figsize=(width_inches, row_height * len(views)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(views), 2, squeeze=False)
    if caption:
        fig.suptitle(caption, fontsize=9)
    for (ax_att, ax_seg), view in zip(axes, views):
        ax_att.imshow(attention_image(view))
        ax_att.set_title(view.title, fontsize=8)
        ax_seg.imshow(overlay_with_point(view))
        ax_seg.set_title(f"{view.spec}: segmentation", fontsize=8)
        for ax in (ax_att, ax_seg):
            ax.set_axis_off()
    return fig


def write_explain(views: Sequence[ExplainView], path: str | Path, caption: str = "", dpi: int = 100) -> Path:
    """Render and save the figure as PNG (written via a temporary file)."""
    from ..runtime.atomic import atomic_path

    path = Path(path)
    with atomic_path(path) as tmp:
        render_explain(views, caption, dpi=dpi).savefig(tmp, format="png")
    return path
