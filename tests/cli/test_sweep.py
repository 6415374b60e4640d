"""What `sweep` prints (cli/sweep.py): a failed cell's label and error keep a spec's `[...]` modifiers (issue 35,
reliability 13)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from clipseg_sparse.cli.sweep import _print_summary


def test_a_failed_cell_is_named_with_its_whole_spec(capsys):
    cell = SimpleNamespace(label="tiny-vit voc21 qk[cos,scale:4]/softmax", hash="abc")
    failure = SimpleNamespace(cell=cell, error="spec qk[cos,scale:4]/softmax: [x] failed")
    _print_summary(SimpleNamespace(total=1, skipped=0, ran=1, stale=0, failed=[failure], wall_s=1.0), Path("out"))
    assert "failed tiny-vit voc21 qk[cos,scale:4]/softmax: spec qk[cos,scale:4]/softmax: [x] failed  (abc.error.json)" in capsys.readouterr().err
