import subprocess
import sys

from typer.testing import CliRunner

from clipseg_sparse.cli.app import app

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
