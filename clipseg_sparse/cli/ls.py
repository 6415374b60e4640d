"""Command-line pieces for the proxy backbones (kept out of cli.py, which only registers them)."""

from __future__ import annotations


def backbones_table():
    """`ls backbones`: each registered backbone with its timm tag, patch, features and published loader."""
    from rich.table import Table

    from ..models.backbones import BACKBONES

    table = Table("backbone", "kind", "timm / hub id", "patch", "features", "positions", "published loader")
    for name in BACKBONES:
        b = BACKBONES.get(name)
        table.add_row(name, b.kind, b.timm_name, str(b.patch_size), ", ".join(b.features) or "region masks", b.pos_rule, b.published)
    return table
