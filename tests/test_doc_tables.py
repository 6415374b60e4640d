"""The hand-written tables of the docs (docs/methods/*.md, docs/datasets.md, docs/sweeps.md) and methods/README.md
against the registries: every preset, protocol, dataset, grid and method module a table names exists, and every
registered one is in a table, so a renamed, added or removed entry fails here until its documentation follows."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import pytest

import clipseg_sparse.methods as methods
from clipseg_sparse.attention.spec import PRESETS
from clipseg_sparse.datasets.benchmarks import DATASETS
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.sweeps.grid import GRIDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PRESET_PAGES = sorted((DOCS / "methods").glob("*.md"))  # the preset tables: index, proxy, regions
DATASETS_MD = DOCS / "datasets.md"
SWEEPS_MD = DOCS / "sweeps.md"
PRESETS_MD = DOCS / "presets.md"  # the preset guide: its table is `ls presets --markdown`
METHODS_MD = ROOT / "clipseg_sparse" / "methods" / "README.md"
TESTS = ROOT / "tests"


def tables(path: Path) -> list[tuple[list[str], list[list[str]]]]:
    """Each markdown table of `path` as (header cells, body rows of cells); a `|` inside backticks is text."""
    found: list[tuple[list[str], list[list[str]]]] = []
    block: list[list[str]] = []
    for line in [*path.read_text(encoding="utf-8").splitlines(), ""]:
        if line.startswith("|"):
            block.append(cells(line))
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            found.append((block[0], block[2:]))
        block = []
    return found


def cells(line: str) -> list[str]:
    parts, current, quoted = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            quoted = not quoted
        if char == "|" and not quoted:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def named(paths: Path | list[Path], header: str, column: int = 0) -> list[str]:
    """The backticked names in `column` of every table of `paths` whose first header cell is `header`, before
    the cell's first parenthesis (what follows it is a note: a source, a commit, a config path)."""
    paths = [paths] if isinstance(paths, Path) else paths
    found = [
        name
        for path in paths
        for head, rows in tables(path)
        if head[0] == header
        for row in rows
        for name in re.findall(r"`([^`]+)`", row[column].split(" (")[0])
    ]
    assert found, f"no table headed {header!r} in {', '.join(p.name for p in paths)}"
    return found


def test_the_parser_reads_cells_and_skips_prose(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text | not a table\n\n| a | b |\n|---|---|\n| `x|y` | `z` (`note`) |\n| 1 | 2 |\n\n| lone |\n")
    assert tables(page) == [(["a", "b"], [["`x|y`", "`z` (`note`)"], ["1", "2"]])]
    assert named(page, "a") == ["x|y"] and named(page, "a", 1) == ["z"]


def test_docs_preset_tables_name_every_preset_and_only_presets():
    names = named(PRESET_PAGES, "preset")
    listed = {name for name in names if "*" not in name}
    assert "*-entmax" in names, "the `*-entmax` rows cover the entmax variants"
    assert sorted(listed - set(PRESETS.names())) == []
    missing = [p for p in PRESETS.names() if p not in listed and p.removesuffix("-entmax") not in listed]
    assert missing == [], "presets the preset tables of docs/methods/ do not list"


def test_datasets_md_protocol_tables_name_every_protocol_and_only_protocols():
    listed = set(named(DATASETS_MD, "protocol"))
    assert sorted(listed - set(PROTOCOLS.names())) == []
    assert [p for p in PROTOCOLS.names() if p not in listed] == [], "protocols datasets.md's tables do not list"


def test_datasets_md_dataset_table_is_the_dataset_registry():
    assert sorted(named(DATASETS_MD, "`--dataset`")) == sorted(DATASETS.names())


def test_sweeps_grid_table_is_the_grid_registry():
    assert sorted(named(SWEEPS_MD, "grid")) == sorted(GRIDS.names())


def test_methods_readme_table_is_the_method_modules_their_protocols_and_grids():
    modules = {m.name for m in pkgutil.iter_modules(methods.__path__)}
    assert sorted(n.removesuffix(".py") for n in named(METHODS_MD, "module")) == sorted(modules)
    protocols = named(METHODS_MD, "module", 2)
    assert sorted(set(protocols) - set(PROTOCOLS.names())) == []
    assert [p for p in PROTOCOLS.names() if p not in protocols] == [], "protocols methods/README.md does not list"
    grids = [name.removesuffix(".toml") for name in named(METHODS_MD, "module", 3)]
    assert sorted(set(grids) - set(GRIDS.names())) == []
    homes = {PRESETS.where(p).rsplit(".", 1)[-1] for p in PRESETS.names()}
    assert homes <= modules


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.iter_modules(methods.__path__)))
def test_every_method_module_has_its_test_file(module):
    assert (TESTS / "methods" / f"test_{module}.py").is_file(), f"tests/methods/test_{module}.py"


def test_the_preset_guide_table_is_ls_presets_markdown():
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    text = PRESETS_MD.read_text(encoding="utf-8")
    table = text.split("<!-- clipseg-sparse ls presets --markdown -->\n", 1)[1].split("<!-- end -->", 1)[0]
    out = CliRunner().invoke(app, ["ls", "presets", "--markdown"])
    assert out.exit_code == 0
    assert table == out.stdout, "regenerate the table in docs/presets.md with `clipseg-sparse ls presets --markdown`"


def test_the_preset_guide_names_the_best_published_averages():
    """'Which preset' states the registry's leaders: a paper's number registered later that beats one fails here
    until the page says so."""
    from clipseg_sparse.cli.ls import preset_needs
    from clipseg_sparse.evaluation.published import PUBLISHED, published_for_preset

    text = PRESETS_MD.read_text(encoding="utf-8")
    best = text.split("## Best accuracy", 1)[1].split("\n## ", 1)[0]
    clip_only = text.split("## Best without extra models", 1)[1].split("\n## ", 1)[0]
    overall = max((e for e in map(PUBLISHED.get, PUBLISHED.names()) if e.average is not None), key=lambda e: e.average)
    assert f"{overall.average:.1f}" in best and overall.source.split(" ")[0] in best
    rows = [(e.average, p, e.clip) for p in PRESETS.names() if not p.endswith("-entmax") for e in published_for_preset(p) if e.average is not None]
    average, preset, _ = max(rows)
    assert f"`{preset}`: {average:.1f}" in best
    average, preset, _ = max(r for r in rows if r[2] == "ViT-B-16:openai")
    assert f"`{preset}`: {average:.1f}" in best
    average, preset, _ = max(r for r in rows if preset_needs(r[1]) == "CLIP only")
    assert f"`{preset}`: {average:.1f}" in clip_only


def test_the_preset_guide_names_the_fastest_and_the_cpu_front():
    """'Fastest' names the cheapest measured presets and 'Best on CPU' every preset no cheaper one beats in
    published avg-8 on OpenAI ViT-B/16 (the entry of the protocol its cost was measured with): a new cost file or
    paper's number that changes them fails here until the page says so."""
    from clipseg_sparse.bench.pipeline import preset_costs, preset_target, relative_cost
    from clipseg_sparse.evaluation.published import published_for_preset

    text = PRESETS_MD.read_text(encoding="utf-8")
    fastest = text.split("## Fastest", 1)[1].split("\n## ", 1)[0]
    cpu = text.split("## Best on CPU", 1)[1].split("\n## ", 1)[0]
    costs = preset_costs()
    measured = sorted((relative_cost(p, costs), p) for p in PRESETS.names() if relative_cost(p, costs) is not None)
    assert len(measured) >= len(PRESETS.names()) - 10  # the column covers the registry (the rest: said why on the page)
    own = [(c, p) for c, p in measured if not p.endswith("-entmax")]
    for cost, preset in own[:3]:  # the fastest presets (their twins alike)
        assert f"`{preset}`" in fastest, preset
    for cost, preset in own[-4:]:  # the slowest, with their cost
        assert f"`{preset}` ({cost:.0f}x" in fastest, preset
    rows = []
    for p in PRESETS.names():
        entries = [e for e in published_for_preset(p) if e.average is not None and e.clip == "ViT-B-16:openai" and e.protocol == preset_target(p)[1]]
        if entries and not p.endswith("-entmax") and relative_cost(p, costs) is not None:
            rows.append((relative_cost(p, costs), max(e.average for e in entries), p))
    best = -1.0
    for cost, average, preset in sorted(rows):
        if average > best:
            best = average
            assert f"`{preset}` ({average:.1f}, {cost:.1f}x)" in " ".join(cpu.split()), preset
