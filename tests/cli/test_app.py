import re
import subprocess
import sys

import typer
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from test_common import invoke

runner = CliRunner()


def test_ls_presets_lists_every_registered_preset():
    from clipseg_sparse.attention import PRESETS

    result = runner.invoke(app, ["ls", "presets"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in PRESETS:
        assert name in result.output
    assert "qq+kk/softmax" in result.output
    rows = [line for line in result.output.splitlines() if " sclip-entmax " in line]
    assert rows and "methods.sclip" in rows[0]  # the "defined in" column


def test_version_and_help_are_fast_and_do_not_import_torch():
    code = "import sys; from clipseg_sparse.cli.app import app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("clipseg-sparse ")


def test_ctrl_c_says_how_to_resume(monkeypatch, capsys):
    import pytest

    from clipseg_sparse import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("clipseg_sparse.attention.PRESETS.describe", interrupted)
    monkeypatch.setattr(sys, "argv", ["clipseg-sparse", "ls", "presets"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 130
    assert "run the same command again to resume" in capsys.readouterr().err


def test_main_restores_the_callers_sigterm_handler(monkeypatch):
    import signal

    from clipseg_sparse import cli

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(sys, "argv", ["clipseg-sparse", "--version"])
    try:
        cli.main()
    except SystemExit:
        pass
    assert signal.getsignal(signal.SIGTERM) == before


def rendered_help(group, path=()):
    """(command, param, its help with rich's escapes undone) for every option whose help has a [...] part."""
    for name in group.list_commands(typer.Context(group)):
        command = group.get_command(typer.Context(group), name)
        if hasattr(command, "list_commands"):
            yield from rendered_help(command, (*path, name))
            continue
        for param in command.params:
            text = getattr(param, "help", None) or ""
            if re.search(r"\[[a-z0-9_]+\]", text.replace("\\[", "[")):
                yield (*path, name), param.name, text.replace("\\[", "[")


def test_help_texts_keep_their_square_brackets(monkeypatch):
    from clipseg_sparse.cli.app import app

    monkeypatch.setenv("COLUMNS", "400")
    found = list(rendered_help(typer.main.get_command(app)))
    assert any(p == "regions" and ".[proxy]" in t for _, p, t in found), found
    for command, param, text in found:
        shown = re.sub(r"[\s│]+", " ", invoke(*command, "--help").stdout)
        for bracket in re.findall(r"\S*\[[a-z0-9_]+\]\S*", text):
            assert bracket in shown, (command, param, bracket)
