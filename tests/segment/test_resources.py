"""Resources (segment/resources.py): `--proxy-weights` naming backbones a spec does not run is said, not
silently ignored."""

import numpy as np
from PIL import Image

from test_common import TINY_CPU, cache_dir, invoke  # noqa: F401 (fixture)


def test_proxy_weights_a_spec_does_not_use_are_said(tmp_path):
    Image.fromarray(np.zeros((32, 40, 3), np.uint8)).save(tmp_path / "a.png")
    args = ["segment", tmp_path / "a.png", "--classes", "a,b", *TINY_CPU, "--templates", "single", "--resolution", "32", "--window", "0"]
    named = invoke(*args, "--preset", "sclip", "--proxy-weights", "dino_vitb16=dino.pth", "--out", tmp_path / "o1")
    assert named.exit_code == 0 and "note: --proxy-weights dino_vitb16=dino.pth is not used by" in named.stderr
    assert "it runs no external backbone" in named.stderr
    plain = invoke(*args, "--preset", "sclip", "--proxy-weights", "hub", "--out", tmp_path / "o2")
    assert plain.exit_code == 0 and "note: --proxy-weights hub is not used" in plain.stderr
    quiet = invoke(*args, "--preset", "sclip", "--out", tmp_path / "o3")  # the default (auto) says nothing
    assert quiet.exit_code == 0 and "--proxy-weights" not in quiet.stderr


def test_unused_proxy_weights_keeps_the_items_of_backbones_that_run():
    from clipseg_sparse.segment.resources import unused_proxy_weights

    assert unused_proxy_weights("dino_vitb16=a.pth,sam_vitb=b.pth", ["dino_vitb16"]) == "sam_vitb=b.pth"
    assert unused_proxy_weights("dino_vitb16=a.pth", ["dino_vitb16", "sam_vitb"]) == ""
    assert unused_proxy_weights("a.pth", []) == "a.pth" and unused_proxy_weights("a.pth", ["dino_vitb8"]) == ""
    assert unused_proxy_weights("auto", []) == ""
