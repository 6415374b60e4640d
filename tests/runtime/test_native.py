"""The C kernels' build: cached per source, compiler and flags; no compiler or the switch off -> None (the torch path)."""

import logging
import shutil
import subprocess

import pytest
import torch

from clipseg_sparse.runtime import native
from clipseg_sparse.stages import pamr


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    native._load.cache_clear()
    yield tmp_path / "clipseg-sparse" / "native"
    native._load.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")
def test_kernel_is_built_once_then_loaded_from_the_cache(fresh_cache, monkeypatch):
    builds = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: builds.append(a[0]) or run(*a, **k))
    assert native.kernel("pamr") is not None
    built = list(fresh_cache.glob("pamr-*.so"))
    assert len(builds) == 1 and len(built) == 1 and list(fresh_cache.iterdir()) == built  # no partial file left
    native._load.cache_clear()
    assert native.kernel("pamr") is not None and len(builds) == 1  # a new process loads the cached file


def test_no_compiler_or_switched_off_runs_the_torch_path(fresh_cache, monkeypatch, caplog):
    g = torch.Generator().manual_seed(0)
    guide, cosine = torch.randn(3, 9, 11, generator=g), torch.randn(3, 9, 11, generator=g)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.kernel("pamr") is None
    expected = pamr(cosine, guide, 2, (1, 3))
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.kernel("pamr") is None
        assert torch.equal(pamr(cosine, guide, 2, (1, 3)), expected)
    assert "native kernel pamr not built" in caplog.text and "torch path" in caplog.text
    assert not list(fresh_cache.glob("*.so"))


def test_float_pointer_refuses_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        native.float_pointer(torch.zeros(3, 4).T)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        native.float_pointer(torch.zeros(3, dtype=torch.float64))
