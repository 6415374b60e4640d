"""Region masks for CorrCLIP: files in a folder, binary masks to an id map, the SAM2 source."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.runtime.weights import MissingExtraError
from clipseg_sparse.cli.app import app
from clipseg_sparse.segment.regions import RegionFolder, Sam2Regions, masks_to_regions, read_region_map


def test_region_files_in_three_formats(tmp_path):
    regions = np.array([[-1, 0, 0], [1, 1, 300]], dtype=np.int32)
    Image.fromarray((regions + 1).astype(np.uint16)).save(tmp_path / "a.png")  # 16-bit: 0 = unsegmented
    np.save(tmp_path / "b.npy", regions)
    np.savez(tmp_path / "c.npz", regions=regions)
    for name in ("a.png", "b.npy", "c.npz"):
        assert read_region_map(tmp_path / name).tolist() == regions.tolist()
    np.save(tmp_path / "bad.npy", np.zeros((2, 2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match=r"bad\.npy: region masks must be a 2-D integer map"):
        read_region_map(tmp_path / "bad.npy")


def test_region_folder_matches_images_by_relative_name(tmp_path):
    (tmp_path / "sub").mkdir()
    np.save(tmp_path / "sub" / "x.npy", np.zeros((2, 3), dtype=np.int32))
    folder = RegionFolder(tmp_path)
    assert folder(np.zeros((2, 3, 3), np.uint8), "sub/x.jpg").shape == (2, 3)
    with pytest.raises(ValueError, match="region masks are 3x2, the image is 4x2"):
        folder(np.zeros((2, 4, 3), np.uint8), "sub/x.jpg")
    with pytest.raises(ValueError, match="no region masks for y.jpg"):
        folder(np.zeros((2, 3, 3), np.uint8), "y.jpg")
    assert "\n" not in str(pytest.raises(ValueError, RegionFolder, tmp_path / "missing").value)


def test_masks_to_regions_paints_small_masks_over_large():
    big = np.ones((3, 3), bool)
    small = np.zeros((3, 3), bool)
    small[0, 0] = True
    apart = np.zeros((4, 4), bool)
    regions = masks_to_regions([small, big], (3, 3))
    assert regions[0, 0] == 0 and (regions.ravel()[1:] == 1).all()
    assert (masks_to_regions([apart], (4, 4)) == -1).all()


@pytest.mark.skipif(importlib.util.find_spec("sam2") is not None, reason="sam2 is installed here")
def test_sam2_regions_without_the_extra_is_one_line(tmp_path):
    with pytest.raises(MissingExtraError) as e:
        Sam2Regions(tmp_path)(np.zeros((8, 8, 3), np.uint8), "a.jpg")
    assert "\n" not in str(e.value) and "sam2" in str(e.value) and ".[proxy]" in str(e.value)


def test_sam2_regions_are_cached(tmp_path, monkeypatch):
    """The generator is faked (sam2 is not in the test extra: PyPI has only its source, whose build
    pulls a second torch); what is tested is the cache around it."""
    source = Sam2Regions(tmp_path)
    calls = []

    class Fake:
        def generate(self, image):
            calls.append(1)
            return [{"segmentation": np.ones(image.shape[:2], bool)}]

    monkeypatch.setattr(source, "_load", lambda: Fake())
    image = np.zeros((4, 5, 3), np.uint8)
    assert (source(image, "a.jpg") == 0).all() and (source(image, "a.jpg") == 0).all()
    assert len(calls) == 1


def test_ls_backbones_lists_the_registry():
    result = CliRunner().invoke(app, ["ls", "backbones"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    for name in ("dino_vitb8", "vit_base_patch8_224.dino", "dinov2_vitb14_reg", "samvit_base_patch16.sa1b", "sam2_hiera_l"):
        assert name in result.output
