"""The docs' table of `reproduce` grids (docs/sweeps.md) lists exactly the shipped grids with their true cell counts."""

import re
from pathlib import Path

from clipseg_sparse.sweeps.grid import GRID_DIR, GRIDS, read_grid_file

SWEEPS_MD = Path(__file__).parent.parent / "docs" / "sweeps.md"


def docs_grids() -> dict[str, int]:
    """grid -> cells, from the rows of the `| grid | cells | what |` table (up to the first non-table line)."""
    lines = SWEEPS_MD.read_text(encoding="utf-8").split("| grid | cells | what |\n", 1)[1].splitlines()
    assert lines[0].startswith("|---")
    rows = {}
    for line in lines[1:]:
        if not line.startswith("|"):
            break
        name, cells = re.fullmatch(r"\| `([^`]+)` \| (\d+) \| .+ \|", line).groups()
        assert name not in rows, f"{name} listed twice"
        rows[name] = int(cells)
    return rows


def test_docs_list_every_shipped_grid_with_its_cell_count():
    shipped = sorted(p.stem for p in GRID_DIR.glob("*.toml"))
    assert sorted(GRIDS.names()) == shipped and len(shipped) > 3
    counted = {name: len(read_grid_file(GRIDS.get(name), benchmarks_dir=".").grid.cells()) for name in shipped}
    assert docs_grids() == counted
