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
    assert {"ls", "segment", "eval", "calibrate", "fgovd", "sweep", "report", "reproduce", "bench", "analyze", "explain", "demo",
            "floss rank", "convert coco-stuff", "convert coco-object", "dna train", "dna stats", "bank build", "bank info"} == set(COMMANDS)
    for name, command in COMMANDS.items():
        caught = getattr(command.callback, "user_errors", None)
        assert caught is not None, f"`{name}` is not wrapped by cli.common.user_errors"
        assert caught == (UserError,), f"`{name}` also catches {caught[1:]}: a plain exception there is a bug, shown as its traceback"


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


def _bad_inputs():
    """(folder, call) pairs: one user-facing error per migrated folder, each a bad argument a user can give."""
    import numpy as np

    from clipseg_sparse.analysis.gallery import parse_columns
    from clipseg_sparse.datasets.classnames import class_names_file
    from clipseg_sparse.datasets.labels import label_image
    from clipseg_sparse.dna.convert import block_indices
    from clipseg_sparse.dna.data import image_folder
    from clipseg_sparse.dna.spec_option import check_arg
    from clipseg_sparse.evaluation.fgovd.data import read_benchmark
    from clipseg_sparse.evaluation.metrics import intersect_and_union
    from clipseg_sparse.files.outputs import OutputOptions
    from clipseg_sparse.runtime.accel import attention_backend
    from clipseg_sparse.runtime.distributed import parse_shard
    from clipseg_sparse.stages import parse_stage
    from clipseg_sparse.sweeps.grid import Grid

    def enter(context):
        with context:
            pass

    return {
        "runtime: --shard": lambda: parse_shard("5/4"),
        "runtime: attention backend": lambda: enter(attention_backend("cudnn")),
        "datasets: class names": lambda: class_names_file("ade20k", "/no/such/names.txt"),
        "datasets: palette": lambda: label_image(np.full((2, 2), 300)),
        "files: mask format": lambda: OutputOptions().check_classes(300),
        "evaluation: metrics": lambda: intersect_and_union(np.zeros((2, 2), int), np.zeros((3, 3), int), 2),
        "evaluation: fgovd file": lambda: read_benchmark("/no/such/benchmark.json"),
        "sweeps: grid key": lambda: Grid.from_dict({"datasets": ["ade20k"], "resolutoins": [336]}),
        "dna: --blocks": lambda: block_indices(12, 13),
        "dna: adapter option": lambda: check_arg(""),
        "dna: image folder": lambda: image_folder("/no/such/folder"),
        "methods: stage arguments": lambda: parse_stage("lof:3"),
        "analysis: gallery column": lambda: parse_columns(["/no/such/folder"]),
    }


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_migrated_folders_raise_user_errors_for_bad_input(case):
    """The folders migrated so far (issue 30 item 5) raise a UserError for input a user gives, still a ValueError
    (or FileNotFoundError), so callers' `except ValueError` keeps working."""
    with pytest.raises(UserError) as caught:
        BAD_INPUTS[case]()
    assert isinstance(caught.value, (ValueError, FileNotFoundError)), type(caught.value).__mro__


def test_an_internal_value_error_in_a_command_is_a_traceback(tmp_path, monkeypatch):
    """A bug in the library (here planted: a plain ValueError from a function `segment` calls before any
    model loads) must surface as itself (exit 1, the exception kept for the traceback), not as a one-line
    `error:` blaming the user's input with exit 2."""
    from PIL import Image

    from clipseg_sparse.files import inputs

    def internal(*args, **kwargs):
        raise ValueError("internal")

    monkeypatch.setattr(inputs, "discover_images", internal)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    result = CliRunner().invoke(app, ["segment", str(tmp_path / "a.png"), "--classes", "cat,dog", "--out", str(tmp_path / "out")])
    assert "error: internal" not in result.stderr, result.stderr
    assert result.exit_code == 1 and type(result.exception) is ValueError and str(result.exception) == "internal"
