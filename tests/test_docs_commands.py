"""Every `clipseg-sparse` command written in the README and the docs names a command that exists and only options
that command has (typer's tests/test_tutorial idea, for every page): a renamed or removed flag fails here until
the documentation follows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

from clipseg_sparse.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), ROOT / "benchmarks" / "README.md"])
# `clipseg-sparse ...`, or the package under torchrun / python -m
START = re.compile(r"(?:^|[\s;&|(])(?:clipseg-sparse|-m clipseg_sparse)\s")


def shell_commands(text: str) -> list[str]:
    """The `clipseg-sparse` commands of the page's bash fences, continuation lines joined, comments dropped,
    each cut at a shell separator (`&&`, `;`, `|`)."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for piece in re.split(r"&&|;|\|\|", line):
                match = START.search(piece)
                if match:
                    found.append(piece[match.end():].split(" #", 1)[0].strip())
    return found


def resolve(argv: list[str]) -> tuple[object, list[str]]:
    """The click command that `argv` runs (walking nested groups: `bank build`, `dna train`) and the arguments
    left after its name."""
    command = typer.main.get_command(app)
    while hasattr(command, "get_command") and argv and not argv[0].startswith("-"):  # a group (typer's own click)
        sub = command.get_command(command.context_class(command), argv[0])
        if sub is None:
            raise AssertionError(f"no command {argv[0]!r} in `{command.name}`")
        command, argv = sub, argv[1:]
    return command, argv


def unknown_options(command_line: str) -> list[str]:
    argv = shlex.split(command_line)
    command, rest = resolve(argv)
    options = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
    return [a.split("=", 1)[0] for a in rest if a.startswith("-") and a != "-" and a.split("=", 1)[0] not in options]


COMMANDS = [(page, line) for page in PAGES for line in shell_commands(page.read_text(encoding="utf-8"))]


def test_the_pages_hold_commands():
    assert {p.name for p, _ in COMMANDS} >= {"README.md", "segment.md", "sweeps.md", "evaluation.md"} and len(COMMANDS) > 50


@pytest.mark.parametrize("page, line", COMMANDS, ids=[f"{p.relative_to(ROOT)}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_every_documented_command_exists_with_its_options(page, line):
    assert unknown_options(line) == [], f"{page.relative_to(ROOT)}: {line}"


def test_the_check_catches_a_wrong_flag_and_a_wrong_command():
    text = '```bash\nclipseg-sparse segment a/ --classes "a,b" --outt x/ && clipseg-sparse bank build d --regions r \\\n   --out b\n```\n'
    first, second = shell_commands(text)
    assert unknown_options(first) == ["--outt"] and unknown_options(second) == []
    with pytest.raises(AssertionError, match="no command 'segmnt'"):
        unknown_options("segmnt a/")
