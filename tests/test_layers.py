"""The package's layers, kept true by import-linter (`.importlinter` at the repository root; `.ci/run` runs it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(root / ".importlinter"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_layers():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 kept, 0 broken" in run.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # an upward import: the engine reaching for a published method
        ("attention/spec.py", "from ..methods import sclip  # noqa", "clipseg_sparse.attention is not allowed to import clipseg_sparse.methods"),
        # a lower folder reaching for the command line
        ("segment/images.py", "from ..cli import common  # noqa", "clipseg_sparse.segment is not allowed to import clipseg_sparse.cli"),
    ],
)
def test_a_planted_upward_import_breaks_the_contract(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "clipseg_sparse", tmp_path / "clipseg_sparse", ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    path = tmp_path / "clipseg_sparse" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    run = lint(tmp_path)
    assert run.returncode != 0
    assert broken in run.stdout
