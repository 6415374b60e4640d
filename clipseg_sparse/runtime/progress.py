"""Progress bars and the stderr console, shared by the library's long runs and the CLI.

On a terminal a rich bar; otherwise (nohup, Slurm, CI: stderr is a file or a pipe) a live bar would only be
written when the run ends, so plain lines are printed instead, one per task every
`$CLIPSEG_SPARSE_PROGRESS_SECONDS` seconds (default 30) and one when the task ends.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import Progress, Task, TaskID

err_console = Console(stderr=True)

LOG_EVERY_S = 30.0


_shown = 0  # bars of ours on screen now (nested ones are drawn under the outer one)


def progress_bar(unit: str, transient: bool | None = None):
    """A rich progress bar on stderr showing done/total, items per second, elapsed and remaining time;
    off a terminal a LogProgress writing plain lines instead.

    Bars nest (rich >= 14.1 draws an inner bar under the outer one, e.g. a vocabulary's text embedding
    inside a sweep cell). transient: remove the bar when it stops; None = only when it is nested and
    stderr is a terminal, so a long sweep does not leave one finished inner bar per cell on screen.
    """
    if not err_console.is_terminal:
        return LogProgress(unit, every=float(os.environ.get("CLIPSEG_SPARSE_PROGRESS_SECONDS", LOG_EVERY_S)))
    from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            speed = rate(task)
            return Text(f"{speed:.2f} {unit}/s" if speed else f"- {unit}/s")

    class RemainingColumn(ProgressColumn):
        def render(self, task) -> Text:
            left = remaining(task)
            return Text(_clock(left) if left is not None else "-:--:--", style="progress.remaining")

    class Bar(Progress):
        counted = False

        def start(self) -> None:
            global _shown
            if not self.counted:
                _shown, self.counted = _shown + 1, True
            super().start()

        def stop(self) -> None:
            global _shown
            if self.counted:
                _shown, self.counted = _shown - 1, False
            super().stop()

    return Bar(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        RemainingColumn(),
        console=err_console,
        transient=_shown > 0 and err_console.is_terminal if transient is None else transient,
    )


@contextmanager
def inner_progress(unit: str, description: str, show: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A bar for the work inside one item of an outer bar (the windows of the image under way), nested
    under it; yields `update(done, total)`, which starts the bar again for each new item. Off a terminal
    it writes its lines like the outer one, so a long image shows progress before it finishes."""
    if not show:
        yield lambda done, total: None
        return
    with progress_bar(unit) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            now = bar._tasks[task]
            if now.total != total or done < now.completed:  # the next item
                bar.reset(task, total=total, completed=done)
            else:
                bar.update(task, completed=done)

        yield update


def rate(task: Task) -> float | None:
    """Items per second: rich's estimate over its last 30 s, else the mean since the task began (items
    slower than 30 s leave rich fewer than two samples in its window, so it has no estimate and no ETA)."""
    if task.speed:
        return task.speed
    return task.completed / task.elapsed if task.completed and task.elapsed else None


def remaining(task: Task) -> float | None:
    """Seconds left at `rate`, or None (no rate yet, no total, or finished)."""
    speed = rate(task)
    return (task.total - task.completed) / speed if speed and task.total and not task.finished else None


def _clock(seconds: float | None) -> str:
    seconds = int(seconds or 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LogProgress(Progress):
    """The Progress API (add_task / advance / update / disable) writing plain lines for log files:
    `HH:MM:SS segmenting: 12/40 images (30%), 0.52 images/s, elapsed 0:00:23, ETA 0:00:54`."""

    def __init__(self, unit: str, every: float = LOG_EVERY_S) -> None:
        super().__init__(console=err_console, auto_refresh=False)
        self.unit, self.every = unit, every
        self._logged: dict[TaskID, tuple[float, float]] = {}  # task -> (time, completed) of its last line

    def start(self) -> None:  # no live display off a terminal
        pass

    def stop(self) -> None:
        for task in self.tasks:
            if task.id in self._logged and task.completed != self._logged[task.id][1]:
                self._line(task)

    def add_task(self, description: str, *args, **kwargs) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self._logged[task_id] = (self.get_time(), self._tasks[task_id].completed)
        return task_id

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._tick(task_id)

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._tick(task_id)

    def _tick(self, task_id: TaskID) -> None:
        if self.get_time() - self._logged[task_id][0] >= self.every:
            self._line(self._tasks[task_id])

    def _line(self, task: Task) -> None:
        self._logged[task.id] = (self.get_time(), task.completed)
        if self.disable:
            return
        done = f"{task.completed:g}/{task.total:g} {self.unit} ({100 * task.completed / task.total:.0f}%)" if task.total else f"{task.completed:g} {self.unit}"
        speed, left = rate(task), remaining(task)
        per_second = f"{speed:.2f} {self.unit}/s" if speed else f"- {self.unit}/s"
        eta = f", ETA {_clock(left)}" if left else ""
        line = f"{time.strftime('%H:%M:%S')} {task.description}: {done}, {per_second}, elapsed {_clock(task.elapsed)}{eta}"
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
