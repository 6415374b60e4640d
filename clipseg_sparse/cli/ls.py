"""`clipseg-sparse ls`: the registered names of each kind, one table builder per kind."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

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


@app.command("ls")
@user_errors()
def ls(what: Annotated[Listable, typer.Argument(help="What to list.")]) -> None:
    """List registered names: attention presets, normalizers, CLIP models, datasets, protocols, sweep grids, stages, proxy backbones."""
    out_console().print(TABLES[what]())


def presets_table():
    """`ls presets`: each preset's canonical spec, the module defining it (`methods.<name>`, or a plug-in's) and
    the method it follows."""
    from rich.markup import escape
    from rich.table import Table

    from ..attention import PRESETS

    table = Table()
    table.add_column("preset", no_wrap=True)
    table.add_column("defined in", no_wrap=True)
    table.add_column("spec", no_wrap=True)
    table.add_column("follows")
    for name in PRESETS:
        where = PRESETS.where(name).removeprefix("clipseg_sparse.")
        table.add_row(name, where, escape(str(PRESETS.get(name).spec)), PRESETS.help(name))  # [..] is not markup
    return table


def normalizers_table():
    """`ls normalizers`: the normalizer kinds a spec accepts."""
    from rich.table import Table

    table = Table("normalizer", "meaning")
    table.add_row("softmax", "standard attention (alpha = 1)")
    table.add_row("entmax:ALPHA", "alpha-entmax, 1 < ALPHA <= 2: exact zeros below a data-dependent threshold")
    table.add_row("sparsemax", "entmax:2, Euclidean projection onto the simplex")
    table.add_row("randmask:ALPHA", "control: softmax on a random subset as large as entmax:ALPHA's support")
    return table


def models_table():
    """`ls models`: open_clip's model names and their pretrained tags."""
    import open_clip
    from rich.table import Table

    from ..models.clip import supported_models

    table = Table("model", "pretrained tags")
    for name in supported_models():
        table.add_row(name, ", ".join(open_clip.list_pretrained_tags_by_model(name)))
    return table


def datasets_table():
    """`ls datasets`: each benchmark's classes, label encoding and layout under --root."""
    from rich.table import Table

    from ..datasets import DATASETS

    table = Table("dataset", "classes", "background", "reduce_zero_label", "val images", "layout under --root", "what")
    for name in DATASETS:
        b = DATASETS.get(name)
        layout = "/".join(p for p in (b.layout, b.img_dir) if p) + f"/*{b.img_suffix}"
        table.add_row(name, str(b.num_classes), "class 0" if b.background else "-", "yes" if b.reduce_zero_label else "no",
                      str(b.num_images), layout, DATASETS.help(name))
    return table


def protocols_table():
    """`ls protocols`: each protocol's attention, class names and settings (all datasets, then per dataset)."""
    from rich.table import Table

    from ..evaluation.protocols import PROTOCOLS

    table = Table("protocol", "attention", "class names", "all datasets", "per dataset", "follows (source)")
    fmt = lambda d: ", ".join(  # noqa: E731
        f"{k}={','.join(v)}" if isinstance(v, tuple) else f"{k}={v}" if isinstance(v, (bool, str)) else f"{k}={v:g}" for k, v in d.items()
    )
    for name in PROTOCOLS:
        p = PROTOCOLS.get(name)
        per = "\n".join(f"{ds}: {fmt(d)}" for ds, d in p.per_dataset.items())
        table.add_row(name, p.attention, p.class_names, fmt(p.defaults), per, f"{PROTOCOLS.help(name)}\n{p.source}")
    return table


def grids_table():
    """`ls grids` (and `reproduce --list`): each shipped grid, its number of cells and what it reproduces."""
    from rich.table import Table

    from ..sweeps.grid import GRIDS, read_grid_file

    table = Table("grid", "cells", "what")
    for name in GRIDS:
        cells = len(read_grid_file(GRIDS.get(name), benchmarks_dir=".").grid.cells())
        table.add_row(name, str(cells), GRIDS.help(name))
    return table


def stages_table():
    """`ls stages`: each pipeline stage with its kind and meaning."""
    from rich.table import Table

    from ..stages import STAGES

    table = Table("stage", "kind and meaning")
    for name in STAGES:
        table.add_row(name, STAGES.help(name))
    return table


def backbones_table():
    """`ls backbones`: each registered backbone with its timm tag, patch, features and published loader."""
    from rich.table import Table

    from ..models.backbones import BACKBONES

    table = Table("backbone", "kind", "timm / hub id", "patch", "features", "positions", "published loader")
    for name in BACKBONES:
        b = BACKBONES.get(name)
        table.add_row(name, b.kind, b.timm_name, str(b.patch_size), ", ".join(b.features) or "region masks", b.pos_rule, b.published)
    return table


TABLES = {
    Listable.presets: presets_table,
    Listable.normalizers: normalizers_table,
    Listable.models: models_table,
    Listable.datasets: datasets_table,
    Listable.protocols: protocols_table,
    Listable.grids: grids_table,
    Listable.stages: stages_table,
    Listable.backbones: backbones_table,
}
