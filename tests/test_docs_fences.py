"""Every code fence of the README and the docs is closed: an unclosed one renders the rest of the page as code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(p for p in [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/*.md"),
                           *ROOT.glob("clipseg_sparse/**/*.md")] if p.is_file())  # fmt: skip
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def unclosed_fences(text: str) -> list[str]:
    """CommonMark's rule: a fence closes on a line of the same character, at least as long, with nothing after
    it. A fence line with an info string (```bash) while a block is open means the previous block was never
    closed (it would be read as code); a block still open at the end is unclosed too."""
    problems, opened = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not m:
            continue
        fence, info = m.groups()
        if opened is None:
            opened = (number, fence)
        elif fence[0] != opened[1][0] or len(fence) < len(opened[1]):
            continue  # a shorter or other fence inside the block is its content
        elif not info.strip():
            opened = None
        else:
            problems.append(f"the fence opened at line {opened[0]} is not closed before line {number}")
            opened = (number, fence)
    if opened is not None:
        problems.append(f"the fence opened at line {opened[0]} is never closed")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_is_closed(page):
    assert unclosed_fences(page.read_text()) == []


def test_the_check_finds_an_unclosed_fence():
    text = "```bash\nrun\n\n### heading\n\n```bash\nmore\n```\n"
    assert unclosed_fences(text) == ["the fence opened at line 1 is not closed before line 6"]
    assert unclosed_fences("```\ncode\n") == ["the fence opened at line 1 is never closed"]
    assert unclosed_fences("````md\n```bash\nx\n```\n````\n") == []
