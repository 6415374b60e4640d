"""The `clipseg-sparse` command line: the root app, one typer app per command group, and the entry point.

Each command module (`ls`, `segment`, `evaluate`, `calibrate`, `sweep`, `bench`, `analysis`, `dna`) builds its own
`typer.Typer()`; this module only assembles them, as typer's one-file-per-command layout does.
Heavy imports (torch, open_clip) happen inside command bodies so that `--help` is instant.
Progress and logs go to stderr; tables and JSON to stdout.
"""

from __future__ import annotations

from typing import Annotated

import typer

from . import analysis, bank, bench, calibrate, dna, evaluate, floss, ls, segment, sweep
from .common import flags_show_no_value_type
from ..runtime.progress import err_console

HELP = "Training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention."


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"clipseg-sparse {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """Training-free open-vocabulary semantic segmentation with a frozen CLIP and sparse attention."""
    from ..runtime.allocator import keep_freed_memory

    keep_freed_memory()  # no page-fault churn between repeated same-sized tensors (see allocator.py)


def build_app() -> typer.Typer:
    """The root app: its callback, then every command group in the order `--help` lists them."""
    flags_show_no_value_type()
    root = typer.Typer(name="clipseg-sparse", help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    root.callback()(_root)
    for group in (ls.app, segment.app, evaluate.app, calibrate.app, sweep.app, bench.app, analysis.app):  # their commands join the root
        root.add_typer(group)
    root.add_typer(evaluate.convert_app, name="convert")
    root.add_typer(dna.dna_app, name="dna")
    root.add_typer(bank.bank_app, name="bank")
    root.add_typer(floss.floss_app, name="floss")
    return root


app = build_app()


INTERRUPTED = (
    "interrupted: finished work is kept; run the same command again to resume "
    "(segment and sweep always resume; eval, fgovd and analyze when given --out)"
)


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, Slurm's time limit, docker stop) handled as Ctrl-C: the run stops where it is and
    keeps its finished work (every write is atomic), then exits with 143 (128 + SIGTERM)."""


_signals: list[int] = []


def _on_sigterm(signum: int, frame) -> None:
    _signals.append(signum)
    raise Terminated()


def main() -> None:
    import signal

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    from ..runtime.distributed import leave

    try:
        app()
    except SystemExit as e:  # every end of a command, an error or a signal included (typer exits)
        leave()  # torchrun: the process group is torn down now, not during interpreter exit
        if e.code == 130:  # typer's exit status for Ctrl-C, and for SIGTERM (raised as a KeyboardInterrupt)
            err_console.print(INTERRUPTED, highlight=False)
            if _signals:
                raise SystemExit(128 + _signals[0]) from None
        raise
    finally:  # main() called in-process (tests, notebooks) leaves the caller's handler as it was
        signal.signal(signal.SIGTERM, previous)
