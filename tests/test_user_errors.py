"""One user-error base and one CLI boundary (issue 19 item 5): every user-facing error class derives from
`errors.UserError`, every command carries the boundary, and a UserError raised inside a command ends as one
stderr line with exit code 2."""

import ast
import importlib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import clipseg_sparse
from clipseg_sparse.cli.app import app
from clipseg_sparse.errors import UserError

PACKAGE = Path(clipseg_sparse.__file__).parent


def error_classes() -> dict[str, type]:
    """Every class named `*Error` defined in the package, found by reading its source (grep-like), then imported."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = [node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
        if names:
            module = importlib.import_module(".".join(("clipseg_sparse", *path.relative_to(PACKAGE).with_suffix("").parts)))
            found.update({f"{module.__name__}.{name}": getattr(module, name) for name in names})
    return found


ERRORS = error_classes()


def test_the_error_classes_are_found():
    """The search sees the error classes of every room (a broken search would pass the test below vacuously)."""
    names = {qualified.rpartition(".")[2] for qualified in ERRORS}
    assert len(ERRORS) >= 16, sorted(ERRORS)
    for expected in ("DatasetError", "InputError", "ImageReadError", "ClaimConflictError", "ConfigMismatchError", "ReportError", "TrainError",
                     "AdapterError", "UnknownNameError", "WeightsUnavailableError", "MissingExtraError", "BenchmarkFormatError", "MissingImageError"):
        assert expected in names, expected


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_error_class_is_a_user_error(name):
    """Each user-facing error also keeps the builtin it always was, so `except ValueError` callers keep working."""
    cls = ERRORS[name]
    assert issubclass(cls, UserError), f"{name} does not derive from clipseg_sparse.errors.UserError"
    if cls is not UserError:
        assert any(b.__module__ == "builtins" and b not in (Exception, BaseException, object) for b in cls.__mro__), f"{name}: no builtin base"


def commands(group, path=()):
    """(command path, click command) for every leaf command of the CLI, sub-groups included."""
    for name in group.list_commands(typer.Context(group)):
        command = group.get_command(typer.Context(group), name)
        if hasattr(command, "list_commands"):
            yield from commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


COMMANDS = dict(commands(typer.main.get_command(app)))


def test_every_command_carries_the_boundary():
    assert {"ls", "segment", "eval", "fgovd", "sweep", "report", "reproduce", "bench", "analyze", "explain", "demo",
            "convert coco-stuff", "convert coco-object", "dna train", "dna stats", "bank build", "bank info"} == set(COMMANDS)
    for name, command in COMMANDS.items():
        caught = getattr(command.callback, "user_errors", None)
        assert caught is not None and caught[0] is UserError, f"`{name}` is not wrapped by cli.common.user_errors"


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_a_user_error_inside_a_command_is_one_stderr_line_and_exit_2(name, monkeypatch):
    """Raised from inside `ls` (whose boundary names no builtin): the message, escaped, on one line; nothing on stdout."""
    from clipseg_sparse.cli import ls

    cls = ERRORS[name]
    message = f"{cls.__name__}: bad [input] at /some/path"

    def raises():
        raise cls(message)

    monkeypatch.setitem(ls.TABLES, ls.Listable.presets, raises)
    result = CliRunner().invoke(app, ["ls", "presets"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {message}"] and result.stdout == ""


def test_a_plain_error_is_not_swallowed(monkeypatch):
    """Only user errors become one line: a plain exception a command does not name still surfaces as itself."""
    from clipseg_sparse.cli import ls

    def raises():
        raise ValueError("a bug, not bad input")

    monkeypatch.setitem(ls.TABLES, ls.Listable.presets, raises)
    result = CliRunner().invoke(app, ["ls", "presets"])
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
