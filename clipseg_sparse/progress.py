"""Progress bars and the stderr console, shared by the library's long runs and the CLI."""

from __future__ import annotations

from rich.console import Console

err_console = Console(stderr=True)


def progress_bar(unit: str):
    """A rich progress bar on stderr showing done/total, items per second, elapsed and remaining time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:.2f} {unit}/s" if task.speed else f"- {unit}/s")

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
    )
