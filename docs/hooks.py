"""mkdocs hook: one reference page per method module, rendered from the registries at build time.

Each page (`methods/reference/<module>.md`, listed under "One page per method") is the module's docstring and
every entry the module registered (`Registry.where`): presets, protocols, stages, taps, spec options, forwards,
pipelines, region sources, with the rows `clipseg-sparse ls` prints, and the published code's quirks each of its
presets copies or fixes (`Preset.notes`). Nothing here is written by hand, so a new method module gets its page
without an edit to the docs.
"""

from __future__ import annotations

import importlib
import pkgutil

from mkdocs.structure.files import File

from clipseg_sparse.cli.ls import markdown_table, markdown_text

REFERENCE = "methods/reference"
NAV_TITLE = "One page per method"

# (registry module, registry, section title); the order of the sections on a page
REGISTRIES = (
    ("clipseg_sparse.attention.spec", "PRESETS", "Presets"),
    ("clipseg_sparse.segment.pipelines", "PIPELINES", "Pipelines"),
    ("clipseg_sparse.evaluation.protocols", "PROTOCOLS", "Protocols"),
    ("clipseg_sparse.stages", "STAGES", "Stages"),
    ("clipseg_sparse.attention.taps", "TAPS", "Score taps"),
    ("clipseg_sparse.attention.spec", "OPTIONS", "Spec options"),
    ("clipseg_sparse.segment.plan", "FORWARDS", "Forwards"),
    ("clipseg_sparse.segment.regions", "REGION_SOURCES", "Region sources"),
)


def method_modules() -> list[str]:
    """The method modules in the order `ls` lists them (`methods.METHODS` first, then any other)."""
    import clipseg_sparse.methods as methods

    found = {m.name for m in pkgutil.iter_modules(methods.__path__)}
    return [m for m in methods.METHODS if m in found] + sorted(found - set(methods.METHODS))


def table(registry, names: list[str], title: str) -> list[str]:
    """The section of one registry's entries: the rows `clipseg-sparse ls` prints, as markdown."""
    rows = {name: registry.describe(name) for name in names}
    columns = [c for c in dict.fromkeys(k for row in rows.values() for k in row) if any(row.get(c) for row in rows.values())]
    body = [[name, *(row.get(c, "") for c in columns)] for name, row in rows.items()]
    return [f"## {title}", "", markdown_table(["name", *columns], body)]


def method_page(module: str) -> str:
    """The reference page of `clipseg_sparse.methods.<module>`."""
    qualified = f"clipseg_sparse.methods.{module}"
    doc = (importlib.import_module(qualified).__doc__ or "").strip()
    lines = [f"# {module}", "", f"`{qualified}`", "", markdown_text(doc), ""]
    for registry_module, attr, title in REGISTRIES:
        registry = getattr(importlib.import_module(registry_module), attr)
        names = [n for n in registry.names() if registry.where(n) == qualified]
        if names:
            lines += table(registry, names, title)
    presets = importlib.import_module("clipseg_sparse.attention.spec").PRESETS
    notes: dict[str, list[str]] = {}
    for name in presets.names():
        if presets.where(name) == qualified and presets.get(name).notes:
            notes.setdefault(presets.get(name).notes, []).append(name)
    if notes:
        lines += ["## Quirks of the published code", ""]
        lines += [f"- {', '.join(f'`{n}`' for n in names)}: {markdown_text(text)}" for text, names in notes.items()]
    return "\n".join(lines) + "\n"


def index_page(modules: list[str]) -> str:
    lines = [
        f"# {NAV_TITLE}",
        "",
        "Generated from the registries when the site is built: each page is a method module's docstring (the paper,",
        "the repository and commit its arithmetic was read from, the quirks) and every preset, protocol, stage, tap,",
        "option and forward it registers, as `clipseg-sparse ls` prints them.",
        "",
        "| module | what |",
        "|---|---|",
    ]
    for module in modules:
        doc = (importlib.import_module(f"clipseg_sparse.methods.{module}").__doc__ or "").strip()
        lines.append(f"| [{module}]({module}.md) | {markdown_text(doc.splitlines()[0] if doc else '')} |")
    return "\n".join(lines) + "\n"


def on_config(config):
    """Put the generated pages under the nav entry that names the reference index."""
    modules = method_modules()
    section = [f"{REFERENCE}/index.md", *({m: f"{REFERENCE}/{m}.md"} for m in modules)]

    def replace(items):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                (title, value), = item.items()
                if title == NAV_TITLE:
                    items[i] = {title: section}
                elif isinstance(value, list):
                    replace(value)

    replace(config["nav"])
    return config


def on_files(files, config):
    modules = method_modules()
    files.append(File.generated(config, f"{REFERENCE}/index.md", content=index_page(modules)))
    for module in modules:
        files.append(File.generated(config, f"{REFERENCE}/{module}.md", content=method_page(module)))
    return files
