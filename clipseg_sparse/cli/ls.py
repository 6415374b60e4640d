"""`clipseg-sparse ls`: the entries of each registry, printed by one loop over `Registry.describe` rows.

Every kind but `models` is a registry of the package (defined next to its entries' type, `registry.py`);
a row is the entry's own description plus its help, and for the plug-in kinds (presets, stages, taps, spec
options) a "defined in" column names the module that registered each entry. `models` lists open_clip's
configurations, each with the family of the registry `models.tower.FAMILIES` it belongs to.
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
def ls(what: Annotated[Listable, typer.Argument(help="What to list.")]) -> None:
    """List registered names: attention presets, normalizers, CLIP models, datasets, protocols, sweep grids, stages,
    proxy backbones, score taps, spec options, mask formats, pipelines, region sources, and the papers' numbers
    (`published`: what `report` puts beside a run of the protocol)."""
    out_console().print(TABLES[what]())


def registry_table(what: Listable):
    """The table of one registry: a row per entry (`Registry.describe`), and for plug-in kinds the module
    that defined it (`Registry.where`: `methods.<name>`, or a plug-in's)."""
    from rich.markup import escape
    from rich.table import Table

    module, attr, title, show_where = REGISTRIES[what]
    registry = getattr(importlib.import_module(module), attr)
    rows = {name: registry.describe(name) for name in registry}
    where = {name: registry.where(name).removeprefix("clipseg_sparse.") for name in registry}
    columns = [c for c in dict.fromkeys(k for row in rows.values() for k in row) if any(row.get(c) for row in rows.values())]
    table = Table()
    table.add_column(title, no_wrap=True, min_width=max(map(len, rows), default=0))  # names stay whole beside long specs
    if show_where:
        table.add_column("defined in", no_wrap=True, min_width=max(map(len, where.values()), default=0))
    for column in columns:
        table.add_column(column, no_wrap=column == "spec")
    for name, row in rows.items():
        cells = [name] + ([where[name]] if show_where else []) + [row.get(c, "") for c in columns]
        table.add_row(*(escape(c) for c in cells))  # spec text such as [cos] is not markup
    return table


def models_table():
    """`ls models`: every open_clip configuration with its family (the first of the registered families,
    `models.tower.FAMILIES`, that matches it), whether dense inference runs on it (and why not where it does
    not), and its pretrained tags."""
    import open_clip
    from rich.table import Table

    from ..models.tower import model_family

    table = Table("model", "family", "dense", "pretrained tags / why not")
    for name in open_clip.list_models():
        family = model_family(name, open_clip.get_model_config(name))
        if family.reason is None:
            table.add_row(name, family.name, "yes", ", ".join(open_clip.list_pretrained_tags_by_model(name)))
        else:
            table.add_row(name, family.name, "no", family.reason)
    return table


TABLES: dict[Listable, Callable] = {what: partial(registry_table, what) for what in REGISTRIES} | {Listable.models: models_table}
