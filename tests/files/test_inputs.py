import os
from pathlib import Path, PurePosixPath

import pytest

from clipseg_sparse.files.inputs import InputError, discover_images, safe_output_base


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def rels(found) -> dict[str, str]:
    return {str(job.rel): job.source.name for job in found.jobs}


def test_folders_are_walked_recursively_keeping_relative_paths(tmp_path):
    root = tmp_path / "photos"
    touch(root / "a.jpg")
    touch(root / "b" / "c" / "d.PNG")
    touch(root / "notes.txt")
    touch(root / ".hidden.jpg")
    touch(root / ".git" / "e.jpg")
    single = touch(tmp_path / "elsewhere" / "f.webp")
    found = discover_images([root, single], tmp_path / "out")
    assert rels(found) == {"a": "a.jpg", "b/c/d": "d.PNG", "f": "f.webp"}
    assert [p.name for p in found.not_images] == ["notes.txt"]


def test_same_file_twice_is_segmented_once(tmp_path):
    img = touch(tmp_path / "in" / "a.jpg")
    found = discover_images([tmp_path / "in", img], tmp_path / "out")
    assert len(found.jobs) == 1 and found.jobs[0].rel == PurePosixPath("a")


def test_missing_input_and_input_inside_output_are_refused(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        discover_images([tmp_path / "nope"], tmp_path / "out")
    touch(tmp_path / "out" / "x.jpg")
    with pytest.raises(InputError, match="inside the output folder"):
        discover_images([tmp_path / "out"], tmp_path / "out")
    with pytest.raises(InputError, match="inside the output folder"):
        discover_images([tmp_path / "out" / "x.jpg"], tmp_path / "out")


def test_output_folder_inside_an_input_is_not_searched(tmp_path):
    touch(tmp_path / "a.jpg")
    touch(tmp_path / "masks" / "a.png")  # an earlier run's output
    found = discover_images([tmp_path], tmp_path / "masks")
    assert rels(found) == {"a": "a.jpg"}


def test_clashing_stems_fall_back_to_full_names(tmp_path):
    touch(tmp_path / "in" / "c.jpg")
    touch(tmp_path / "in" / "c.png")
    touch(tmp_path / "in" / "C.tif")  # clashes on case-insensitive file systems
    touch(tmp_path / "in" / "x.jpg")
    touch(tmp_path / "in" / "x.overlay.jpg")  # its label PNG would be x.overlay.png, x.jpg's overlay
    touch(tmp_path / "in" / "solo.jpg")
    found = discover_images([tmp_path / "in"], tmp_path / "out")
    assert set(rels(found)) == {"c.jpg", "c.png", "C.tif", "x.jpg", "x.overlay.jpg", "solo"}


def test_same_relative_path_from_two_inputs_is_refused(tmp_path):
    a, b = touch(tmp_path / "a" / "x.jpg"), touch(tmp_path / "b" / "x.jpg")
    with pytest.raises(InputError, match="same outputs"):
        discover_images([a, b], tmp_path / "out")


def test_output_base_cannot_escape(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert safe_output_base(out, PurePosixPath("a/b")) == out / "a" / "b"
    for bad in ("../x", "a/../../x", "/etc/x"):
        with pytest.raises(InputError, match="leave"):
            safe_output_base(out, PurePosixPath(bad))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, out / "link")
    with pytest.raises(InputError, match="symlink"):
        safe_output_base(out, PurePosixPath("link/x"))
    os.symlink(out / "inner", out / "ok")  # a symlink that stays inside is fine
    assert safe_output_base(out, PurePosixPath("ok/x")) == out / "ok" / "x"
