"""The documentation site builds with `mkdocs build --strict` and not one warning: every internal link, anchor and
included file resolves (mkdocs.yml's `validation`), the API pages render from the docstrings, and the generated
reference has a page per method module holding each preset it registers."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import clipseg_sparse.methods as methods
from clipseg_sparse.attention.spec import PRESETS

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs", reason="the docs build needs the test extra (mkdocs-material, mkdocstrings-python)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return out, run.stdout + run.stderr


def test_the_site_builds_strict_without_a_warning(site):
    out, log = site
    assert "WARNING" not in log, log
    assert (out / "index.html").is_file() and (out / "api" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The validation settings are what makes a bad link or anchor an error: a copy of the docs with one of each fails."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    for name in ("benchmarks", "clipseg_sparse/methods", "tests"):  # the snippets the pages include
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name / "README.md", tmp_path / name)
    page = tmp_path / "docs" / "speed.md"
    page.write_text(page.read_text() + "\n[gone](nowhere.md) [anchor](datasets.md#no-such-heading)\n")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode != 0
    assert "'nowhere.md'" in run.stderr and "#no-such-heading" in run.stderr


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.iter_modules(methods.__path__)))
def test_every_method_module_has_a_generated_page_with_its_presets(site, module):
    page = (site[0] / "methods" / "reference" / module / "index.html").read_text(encoding="utf-8")
    for name in PRESETS.names():
        if PRESETS.where(name) == f"clipseg_sparse.methods.{module}":
            assert f"<code>{name}</code>" in page, name


def test_the_readme_links_to_files_that_exist(site):
    """The README is not part of the site: its relative links are checked here, those into docs/ against the
    built pages' anchors."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(#[^)]*)?\)", readme)
    assert len(links) > 10
    for path, anchor in links:
        assert (ROOT / path).exists(), path
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            page = site[0] / path.removeprefix("docs/").removesuffix("index.md").removesuffix(".md") / "index.html"
            assert f'id="{anchor[1:]}"' in page.read_text(encoding="utf-8"), path + anchor
