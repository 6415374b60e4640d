"""Runs under nohup / Slurm / CI: plain progress lines in log files, SIGTERM keeps work and says how to
resume, a FIFO named .png does not hang the run (issue 15, finding 8)."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from clipseg_sparse.files.inputs import discover_images
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark
from test_common import invoke

TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--device", "cpu"]
LINE = r"\d\d:\d\d:\d\d {what}: {done}/{total} {unit} \({pct}%\), [-0-9.]+ {unit}/s, elapsed \d:\d\d:\d\d"


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CLIPSEG_SPARSE_PROGRESS_SECONDS", "0")  # a line at every step


def make_images(folder, n, size=(32, 40)):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"im{i:03d}.png")


def test_segment_eval_and_sweep_write_plain_progress_lines_off_a_terminal(tmp_path):
    make_images(tmp_path / "in", 3)
    seg = invoke("segment", tmp_path / "in", "--classes", "a,b", "--out", tmp_path / "o", *TINY, "--resolution", "32")
    assert seg.exit_code == 0, seg.output
    for done, pct in ((1, 33), (2, 67), (3, 100)):
        assert re.search(LINE.format(what="segmenting", done=done, total=3, unit="images", pct=pct), seg.stderr), seg.stderr
    make_benchmark("voc21", tmp_path / "data", n=2, size=(32, 32))
    ev = invoke("eval", "--dataset", "voc21", "--root", tmp_path / "data", *TINY, "--resolution", "32", "--window", "0")
    assert ev.exit_code == 0, ev.output
    assert re.search(LINE.format(what="eval voc21", done=1, total=2, unit="images", pct=50), ev.stderr), ev.stderr
    sw = invoke("sweep", "--models", TINY_CONFIG, "--pretrained", "none", "--datasets", "voc21", "--root", tmp_path / "data",
                "--specs", "qq/softmax,kk/softmax", "--templates", "single", "--resolutions", "32", "--out", tmp_path / "s")  # fmt: skip
    assert sw.exit_code == 0, sw.output
    # the grid: the unmodified block (qk/softmax, no presets given) and the two specs
    assert re.search(LINE.format(what="sweep", done=3, total=3, unit="cells", pct=100), sw.stderr), sw.stderr


def test_progress_lines_are_spaced_by_the_interval(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_PROGRESS_SECONDS", "3600")
    make_images(tmp_path / "in", 3)
    seg = invoke("segment", tmp_path / "in", "--classes", "a,b", "--out", tmp_path / "o", *TINY, "--resolution", "32")
    assert seg.exit_code == 0
    lines = [line for line in seg.stderr.splitlines() if "segmenting:" in line]
    assert len(lines) == 1 and "3/3 images (100%)" in lines[0]  # only the closing line


def test_sigterm_exits_143_keeps_finished_images_and_the_rerun_resumes(tmp_path):
    make_images(tmp_path / "in", 40, size=(32, 32))
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "clipseg_sparse", "segment", str(tmp_path / "in"), "--classes", "a,b", "--out", str(out),
           *TINY, "--resolution", "32", "--window", "0"]  # fmt: skip
    env = {**os.environ, "COLUMNS": "300"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not any(out.glob("*.overlay.png")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "interrupted: finished work is kept; run the same command again to resume" in stderr and "Traceback" not in stderr
    finished = len(list(out.glob("*.overlay.png")))
    assert 0 < finished < 40
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    skipped = int(re.search(r"skipped \(already done\)\s*│\s*(\d+)", again.stdout).group(1))
    assert skipped >= finished - 1 and len(list(out.glob("*.overlay.png"))) == 40  # the image being written may be redone


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_png_is_skipped_with_a_note(tmp_path):
    make_images(tmp_path / "in", 1)
    os.mkfifo(tmp_path / "in" / "pipe.png")
    found = discover_images([tmp_path / "in"], tmp_path / "o")
    assert [j.source.name for j in found.jobs] == ["im000.png"] and [p.name for p in found.special] == ["pipe.png"]
    cmd = [sys.executable, "-m", "clipseg_sparse", "segment", str(tmp_path / "in"), "--classes", "a,b", "--out", str(tmp_path / "o"),
           *TINY, "--resolution", "32"]  # fmt: skip
    run = subprocess.run(cmd, env={**os.environ, "COLUMNS": "300"}, capture_output=True, text=True, timeout=120)  # hung before
    assert run.returncode == 0, run.stderr
    assert "note: skipping 1 file(s) that are not regular files (FIFO, socket, device)" in run.stderr and "pipe.png" in run.stderr


@pytest.fixture
def wide_image(tmp_path):
    """57 windows of 32 px at stride 16 on the 64 x 320 network input."""
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 320, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    return ["segment", tmp_path / "wide.png", "--classes", "a,b", *TINY, "--resolution", "64",
            "--window", "32", "--stride", "16", "--batch-size", "4", "--out", tmp_path / "out"]  # fmt: skip


def test_progress_inside_an_image_off_a_terminal(wide_image, monkeypatch):
    """Off a terminal a line came only when an image finished (minutes of silence on a large photo): the
    windows of the image under way are reported too, every $CLIPSEG_SPARSE_PROGRESS_SECONDS."""
    monkeypatch.setenv("CLIPSEG_SPARSE_PROGRESS_SECONDS", "0")
    result = invoke(*wide_image)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    inside = [int(m[1]) for line in lines if (m := re.search(r"windows of the image under way: (\d+)/57 windows", line))]
    finished = next(i for i, line in enumerate(lines) if "segmenting: 1/1 images" in line)
    assert len(inside) >= 10 and inside == sorted(inside) and inside[-1] == 57 and min(inside) < 57
    assert all(i < finished for i, line in enumerate(lines) if "windows of the image under way" in line)


def test_progress_inside_an_image_on_a_terminal(wide_image, monkeypatch):
    """On a terminal the image bar sat at 0/1 while an image ran: a nested bar counts its windows."""
    import io

    from rich.console import Console

    import clipseg_sparse.runtime.progress as progress

    screen = io.StringIO()
    monkeypatch.setattr(progress, "err_console", Console(file=screen, force_terminal=True, width=160))
    result = invoke(*wide_image)
    assert result.exit_code == 0, result.output
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert "windows of the image under way" in drawn and re.search(r"\b([1-9]\d?)/57\b", drawn), drawn[-2000:]


def test_a_progress_line_has_a_rate_and_an_eta_when_items_take_longer_than_30_s(capsys):
    """rich estimates the rate over its last 30 s: items slower than that left it no estimate, so lines said
    `- images/s` and no ETA for a long photo (issue 35, reliability 12); the mean since the start fills in."""
    from clipseg_sparse.runtime.progress import LogProgress

    now = [1000.0]
    bar = LogProgress("images", every=0)
    bar.get_time = lambda: now[0]
    task = bar.add_task("segmenting", total=4)
    for _ in range(2):
        now[0] += 40.0
        bar.advance(task)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("segmenting: 2/4 images (50%), 0.03 images/s, elapsed 0:01:20, ETA 0:01:20"), line
