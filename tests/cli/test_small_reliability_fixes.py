"""Issue 25, reliability 6: the smaller findings, one test each. `explain` and the demo refuse duplicate class
names as `segment` does; the demo reads an animated GIF (first frame) and says so when its port is taken,
before the model loads; `--proxy-weights` naming backbones a spec does not run is said, not silently
ignored; `--proxy-weights hub` offline fails through the same fast probe as CLIP's weights; help texts keep
their square brackets (`.[proxy]`) instead of losing them to rich markup."""

from __future__ import annotations

import re
import socket

import numpy as np
import pytest
import typer
from PIL import Image

from conftest import TINY_CONFIG
from test_common import invoke

TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def no_model(monkeypatch):
    import clipseg_sparse.cli.analysis as analysis

    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(analysis, "load_model", refuse)


def one_line(result, *fragments: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_explain_refuses_a_repeated_class_name_before_the_model_loads(tmp_path, no_model):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "a.png")
    one_line(invoke("explain", tmp_path / "a.png", "--point", "1,1", "--classes", "sky,tree|sky", *TINY, "--out", tmp_path / "e.png"),
             "duplicate class name: 'sky'")  # fmt: skip


def animated_gif(path) -> Image.Image:
    frames = [Image.fromarray(np.full((40, 56, 3), v, np.uint8)).convert("P") for v in (30, 200)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return Image.open(path)


def test_the_demo_refuses_repeated_names_and_reads_an_animated_gif(tiny_clip, tmp_path):
    from clipseg_sparse.analysis.demo import DemoError, DemoModel
    from clipseg_sparse.segment.settings import InferenceSettings

    model = DemoModel(tiny_clip, InferenceSettings(resolution=32, window=0), "single")
    gif = animated_gif(tmp_path / "a.gif")
    assert gif.is_animated and gif.mode == "P"
    [(overlay, caption)] = model.predict(gif, "a,b", ["sclip"])  # the page hands a PIL image (type="pil")
    assert overlay.shape[0] == 40 and overlay.ndim == 3 and caption.startswith("sclip")
    [(attention, _)] = model.attention(gif, "a,b", ["sclip"], 5, 5)
    assert attention.shape == (40, 56, 3)
    # a palette array, as Gradio's numpy images of GIFs were (H x W indices), is no longer what the page sends;
    # an RGBA array still works
    rgba = np.dstack([np.asarray(gif.convert("RGB")), np.full((40, 56), 255, np.uint8)])
    assert model.predict(rgba, "a,b", ["sclip"])[0][0].shape[0] == 40
    with pytest.raises(DemoError, match="duplicate class name: 'a'"):
        model.predict(gif, "a,b|a", ["sclip"])


def test_the_demo_says_its_port_is_taken_before_the_model_loads(no_model):
    pytest.importorskip("gradio")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line(invoke("demo", *TINY, "--port", port), f"--port {port}: cannot serve there", "pick another --port")


def test_proxy_weights_a_spec_does_not_use_are_said(tmp_path):
    Image.fromarray(np.zeros((32, 40, 3), np.uint8)).save(tmp_path / "a.png")
    args = ["segment", tmp_path / "a.png", "--classes", "a,b", *TINY, "--templates", "single", "--resolution", "32", "--window", "0"]
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


def test_proxy_weights_from_the_hub_offline_use_the_fast_probe(monkeypatch, tmp_path):
    """Unreachable Hub: the download runs in huggingface_hub's offline mode (fails at once from the cache)
    instead of retrying for about a minute, and the message says the host is unreachable. A closed local
    port stands in for the Hub, so nothing is downloaded anywhere."""
    import huggingface_hub
    from huggingface_hub import constants

    from clipseg_sparse.models.backbones import BACKBONES, create_backbone_model
    from clipseg_sparse.runtime.weights import WeightsUnavailableError

    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")
    offline = []

    def download(*_a, **_k):
        offline.append(constants.HF_HUB_OFFLINE)
        raise OSError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(WeightsUnavailableError, match=r"127\.0\.0\.1 is unreachable .*--proxy-weights"):
        create_backbone_model(BACKBONES.get("dino_vitb16"), "hub", cache_dir=str(tmp_path))
    assert offline and all(offline)


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


README = (__import__("pathlib").Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")


def test_readme_never_reads_region_masks_from_a_folder_it_writes_label_maps_to():
    commands = " ".join(re.findall(r"```bash\n(.*?)```", README, flags=re.S))
    written = set(re.findall(r"--out (\S+)", commands))
    regions = set(re.findall(r"--regions (\S+)", commands)) - {"sam2", "sam3"}
    assert regions and not regions & written, regions & written


@pytest.fixture
def wide_image(tmp_path):
    """57 windows of 32 px at stride 16 on the 64 x 320 network input."""
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 320, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    return ["segment", tmp_path / "wide.png", "--classes", "a,b", *TINY, "--templates", "single", "--resolution", "64",
            "--window", "32", "--stride", "16", "--batch-size", "4", "--out", tmp_path / "out"]  # fmt: skip


def test_progress_inside_an_image_off_a_terminal(wide_image, monkeypatch):
    """Off a terminal a line came only when an image finished (minutes of silence on a large photo): the
    windows of the image under way are reported too, every $CLIPSEG_SPARSE_PROGRESS_SECONDS."""
    monkeypatch.setenv("CLIPSEG_SPARSE_PROGRESS_SECONDS", "0")
    result = invoke(*wide_image)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    inside = [int(m[1]) for line in lines if (m := re.search(r"windows of the image under way: (\d+)/57 windows", line))]
    finished = next(i for i, line in enumerate(lines) if "segmenting: 1/1 images" in line)
    assert len(inside) >= 10 and inside == sorted(inside) and inside[-1] == 57 and min(inside) < 57
    assert all(i < finished for i, line in enumerate(lines) if "windows of the image under way" in line)


def test_progress_inside_an_image_on_a_terminal(wide_image, monkeypatch):
    """On a terminal the image bar sat at 0/1 while an image ran: a nested bar counts its windows."""
    import io

    from rich.console import Console

    import clipseg_sparse.runtime.progress as progress

    screen = io.StringIO()
    monkeypatch.setattr(progress, "err_console", Console(file=screen, force_terminal=True, width=160))
    result = invoke(*wide_image)
    assert result.exit_code == 0, result.output
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert "windows of the image under way" in drawn and re.search(r"\b([1-9]\d?)/57\b", drawn), drawn[-2000:]
