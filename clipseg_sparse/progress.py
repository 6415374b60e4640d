"""Progress bars and the stderr console, shared by the library's long runs and the CLI."""

from __future__ import annotations

from rich.console import Console

err_console = Console(stderr=True)


_shown = 0  # bars of ours on screen now (nested ones are drawn under the outer one)


def progress_bar(unit: str, transient: bool | None = None):
    """A rich progress bar on stderr showing done/total, items per second, elapsed and remaining time.

    Bars nest (rich >= 14.1 draws an inner bar under the outer one, e.g. a vocabulary's text embedding
    inside a sweep cell). transient: remove the bar when it stops; None = only when it is nested and
    stderr is a terminal, so a long sweep does not leave one finished inner bar per cell on screen (a
    log file still gets each bar's final line).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:.2f} {unit}/s" if task.speed else f"- {unit}/s")

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
        TimeRemainingColumn(),
        console=err_console,
        transient=_shown > 0 and err_console.is_terminal if transient is None else transient,
    )
