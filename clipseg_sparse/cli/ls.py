"""`clipseg-sparse ls`: the entries of each registry, printed by one loop over `Registry.describe` rows.

Every kind but `models` is a registry of the package (defined next to its entries' type, `registry.py`);
a row is the entry's own description plus its help, and for the plug-in kinds (presets, stages, taps, spec
options) a "defined in" column names the module that registered each entry. Presets also say what a run of
them needs besides CLIP (`preset_needs`, read off the run's plan) and what their papers report
(`preset_published`, from `evaluation.published`) and their measured time over sclip's (`preset_cost`, from
`bench.pipeline`'s COST_FILE). `models` lists open_clip's configurations,
each with the family of the registry `models.tower.FAMILIES` it belongs to. `--markdown` prints a registry's
table as markdown (the docs' preset guide is that output, tests/cli/test_ls.py checks it).
"""

from __future__ import annotations

import importlib
from enum import Enum
from functools import partial
from typing import Annotated, Callable

import typer

from .common import out_console, user_errors

app = typer.Typer()


class Listable(str, Enum):
    presets = "presets"
    normalizers = "normalizers"
    models = "models"
    datasets = "datasets"
    protocols = "protocols"
    grids = "grids"
    stages = "stages"
    backbones = "backbones"
    taps = "taps"
    options = "options"
    formats = "formats"
    pipelines = "pipelines"
    regions = "regions"
    published = "published"


# ls KIND -> (module, registry, first column's title, whether to show where each entry is defined)
REGISTRIES: dict[Listable, tuple[str, str, str, bool]] = {
    Listable.presets: ("clipseg_sparse.attention.spec", "PRESETS", "preset", True),
    Listable.normalizers: ("clipseg_sparse.attention.normalizers", "NORMALIZERS", "normalizer", False),
    Listable.datasets: ("clipseg_sparse.datasets", "DATASETS", "dataset", False),
    Listable.protocols: ("clipseg_sparse.evaluation.protocols", "PROTOCOLS", "protocol", False),
    Listable.grids: ("clipseg_sparse.sweeps.grid", "GRIDS", "grid", False),
    Listable.stages: ("clipseg_sparse.stages", "STAGES", "stage", True),
    Listable.backbones: ("clipseg_sparse.models.backbones", "BACKBONES", "backbone", False),
    Listable.taps: ("clipseg_sparse.attention.taps", "TAPS", "tap", True),
    Listable.options: ("clipseg_sparse.attention.spec", "OPTIONS", "spec option", True),
    Listable.formats: ("clipseg_sparse.files.outputs", "MASK_FORMATS", "mask format", False),
    Listable.pipelines: ("clipseg_sparse.segment.pipelines", "PIPELINES", "pipeline", True),
    Listable.regions: ("clipseg_sparse.segment.regions", "REGION_SOURCES", "region source", True),
    Listable.published: ("clipseg_sparse.evaluation.published", "PUBLISHED", "protocol", True),
}


@app.command("ls")
@user_errors()
def ls(
    what: Annotated[Listable, typer.Argument(help="What to list.")],
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a markdown table instead (the docs' tables).")] = False,
) -> None:
    """List registered names: attention presets (with what each needs and its papers' avg-8), normalizers, CLIP models, datasets,
    protocols, sweep grids, stages, proxy backbones, score taps, spec options, mask formats, pipelines, region
    sources, and the papers' numbers (`published`: what `report` puts beside a run of the protocol)."""
    if markdown:
        typer.echo(markdown_table(*registry_rows(what)) if what in REGISTRIES else markdown_table(*models_rows()), nl=False)
    else:
        out_console().print(TABLES[what]())


def preset_needs(name: str) -> str:
    """What a run of preset `name` needs besides CLIP, read off its plan (`Plan.of`: the backbones its taps and
    stages run, other models they load, region maps, an image bank) and its spec's depth (more blocks than the
    default ViT-B/16 has)."""
    import open_clip

    from ..attention.blocks import min_depth
    from ..attention.spec import PRESETS
    from ..models.clip import DEFAULT_MODEL
    from ..segment.plan import Plan

    plan = Plan.of(PRESETS.get(name).spec)
    needs = list(plan.needs.backbones) + list(plan.needs.models)
    needs += ["--regions"] * bool(plan.needs.regions) + ["--bank"] * bool(plan.needs.bank)
    depth, default = min_depth(plan.spec), open_clip.get_model_config(DEFAULT_MODEL)["vision_cfg"]["layers"]
    if depth > default:
        needs.insert(0, f"a CLIP of {depth}+ blocks ({DEFAULT_MODEL} has {default})")
    return ", ".join(needs) or "CLIP only"


def preset_published(name: str) -> str:
    """The avg-8 mIoU each paper reports for preset `name`, with the CLIP it was measured on
    (`evaluation.published`); empty for an `-entmax` twin (no paper reports it) and where no paper does."""
    from ..evaluation.published import published_for_preset

    if name.endswith("-entmax"):
        return ""
    entries = published_for_preset(name)
    return ", ".join(f"{e.average:.1f} ({e.clip})" if e.average is not None else f"{len(e.miou)} of 8 ({e.clip})" for e in entries)


def preset_cost(name: str) -> str:
    """Preset `name`'s measured CPU time for one image over `sclip`'s (`bench.pipeline.relative_cost`: 480 x 640,
    150 classes, random weights, its paper's protocol); empty where it was not measured."""
    from ..bench.pipeline import relative_cost

    cost = relative_cost(name)
    return "" if cost is None else f"{cost:.1f}x"


# ls KIND -> columns added after "defined in": name -> {column: text}
EXTRA_COLUMNS: dict[Listable, Callable[[str], dict[str, str]]] = {
    Listable.presets: lambda name: {
        "needs": preset_needs(name), "published avg-8 (CLIP)": preset_published(name), "CPU time (x sclip)": preset_cost(name),
    },
}


def registry_rows(what: Listable) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of one registry: a row per entry (`Registry.describe`), for plug-in kinds the module that
    defined it (`Registry.where`: `methods.<name>`, or a plug-in's), and the kind's `EXTRA_COLUMNS`."""
    module, attr, title, show_where = REGISTRIES[what]
    registry = getattr(importlib.import_module(module), attr)
    extra = EXTRA_COLUMNS.get(what, lambda name: {})
    rows = {name: {**({"defined in": registry.where(name).removeprefix("clipseg_sparse.")} if show_where else {}), **extra(name),
                   **registry.describe(name)} for name in registry}  # fmt: skip
    columns = [c for c in dict.fromkeys(k for row in rows.values() for k in row) if any(row.get(c) for row in rows.values())]
    return [title, *columns], [[name, *(row.get(c, "") for c in columns)] for name, row in rows.items()]


def registry_table(what: Listable):
    """`registry_rows` as a rich table: names and modules stay whole, a spec too long for its column folds
    (it has no spaces to wrap at), the other columns wrap."""
    from rich.markup import escape
    from rich.table import Table

    header, rows = registry_rows(what)
    table = Table()
    for i, column in enumerate(header):
        whole = i == 0 or column == "defined in"
        table.add_column(column, no_wrap=whole, min_width=max((len(r[i]) for r in rows), default=0) if whole else None,
                         overflow="fold" if column == "spec" else "ellipsis")  # fmt: skip
    for row in rows:
        table.add_row(*(escape(c) for c in row))  # spec text such as [cos] is not markup
    return table


def markdown_text(text: str) -> str:
    """Plain text as markdown: code spans kept, and outside them the characters markdown would read as links,
    emphasis, HTML or a table's cell border (`sam3[:CONFIDENCE][/NORMALIZER]`, `W * S`, `<name>`, `a|b`) escaped."""
    import re

    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else re.sub(r"([\[\]*|])", r"\\\1", p).replace("<", "&lt;") for p in parts)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the first column, modules and specs as code, other text through `markdown_text`, line
    breaks as <br>."""

    def cell(text: str, column: str) -> str:
        if column == header[0] or column in ("defined in", "spec"):
            return f"`{text}`" if text else ""
        return markdown_text(text).replace("\n", "<br>")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(text, column) for text, column in zip(row, header)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def models_rows() -> tuple[list[str], list[list[str]]]:
    """`ls models`: every open_clip configuration with its family (the first of the registered families,
    `models.tower.FAMILIES`, that matches it), whether dense inference runs on it (and why not where it does
    not), and its pretrained tags."""
    import open_clip

    from ..models.tower import model_family

    rows = []
    for name in open_clip.list_models():
        family = model_family(name, open_clip.get_model_config(name))
        if family.reason is None:
            rows.append([name, family.name, "yes", ", ".join(open_clip.list_pretrained_tags_by_model(name))])
        else:
            rows.append([name, family.name, "no", family.reason])
    return ["model", "family", "dense", "pretrained tags / why not"], rows


def models_table():
    from rich.table import Table

    header, rows = models_rows()
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    return table


TABLES: dict[Listable, Callable] = {what: partial(registry_table, what) for what in REGISTRIES} | {Listable.models: models_table}
