"""Headless Chromium for the page tests (Debian's `chromium` package; .ci/run installs it when missing)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

TIMEOUT_S = 90
CONSOLE = re.compile(r":INFO:CONSOLE[^\]]*\] (.*)")


def chromium() -> str:
    """The chromium binary, or skip the test saying how to get it."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it before the tests)")


def run_chromium(url: str, *args: str, width: int = 1000, height: int = 800, timeout: float = TIMEOUT_S) -> tuple[str, list[str]]:
    """Load `url` headless with extra `args` (e.g. --screenshot=PATH, --dump-dom); returns (stdout, the
    page's console messages, errors included, as Chromium logs them to stderr)."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "--enable-logging=stderr", "--v=0",
             *args, url],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return proc.stdout, [m.group(1) for m in CONSOLE.finditer(proc.stderr)]


def screenshot(url: str, path: Path, width: int = 1000, height: int = 800, *args: str, **kwargs) -> list[str]:
    """Save a PNG of the page (`args`: more Chromium flags); returns the console messages."""
    _, console = run_chromium(url, f"--screenshot={path}", *args, width=width, height=height, **kwargs)
    assert path.is_file(), f"chromium wrote no screenshot of {url}"
    return console
