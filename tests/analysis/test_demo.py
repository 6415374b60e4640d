"""The Gradio demo: its computations directly, its API through gradio_client, its page in headless Chromium."""

import socket

import numpy as np
import pytest
from PIL import Image

from browser import run_chromium, screenshot
from test_common import TINY_CPU, cache_dir, no_model, one_line, invoke  # noqa: F401 (fixtures)
from test_proxyclip import proxy  # noqa: F401  (fixture: tiny CLIP + tiny DINO installed as dino_vitb8)
from clipseg_sparse.analysis.demo import DemoError, DemoModel, build_demo, launch
from clipseg_sparse.segment.settings import InferenceSettings

SETTINGS = InferenceSettings(resolution=64, window=32, stride=16)
PRESETS = ["clearclip", "clearclip-entmax"]
CALL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(1).integers(0, 255, (48, 80, 3), dtype=np.uint8)


def test_demo_model_gives_one_overlay_and_one_attention_map_per_preset(tiny_clip, image):
    model = DemoModel(tiny_clip, SETTINGS, "single")
    masks = model.predict(image, "a,b|bee", PRESETS)
    assert [c for _, c in masks] == ["clearclip (qq/softmax/nores/noffn)", "clearclip-entmax (qq/entmax:1.5/nores/noffn)"]
    assert all(m.shape[0] == 48 and m.shape[1] > 80 for m, _ in masks)  # the legend panel on the right
    maps = model.attention(image, "a,b", PRESETS, 30, 20)
    assert [m.shape for m, _ in maps] == [(48, 80, 3)] * 2
    assert maps[0][1].startswith("clearclip: entropy") and "non-zero 29.0/29" in maps[0][1]  # softmax: every token
    for bad, message in ((lambda: model.predict(None, "a", PRESETS), "upload"), (lambda: model.predict(image, "a", []), "preset"),
                         (lambda: model.attention(image, "a", PRESETS, 500, 5), "outside")):  # fmt: skip
        with pytest.raises(DemoError, match=message):
            bad()


@pytest.fixture(scope="module")
def server(tiny_clip):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_demo(tiny_clip, SETTINGS, "single", PRESETS)
    launch(demo, port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def test_predict_and_attention_endpoints_through_gradio_client(server, image, tmp_path):
    from gradio_client import Client, handle_file

    path = tmp_path / "in.png"
    Image.fromarray(image).save(path)
    client = Client(server, verbose=False)
    masks = client.submit(handle_file(str(path)), "a,b", ["clearclip"], "both", api_name="/predict").result(timeout=CALL_TIMEOUT_S)
    assert [m["caption"] for m in masks] == ["clearclip (qq/softmax/nores/noffn)", "clearclip-entmax (qq/entmax:1.5/nores/noffn)"]
    for m in masks:
        assert Image.open(m["image"]).size[1] == 48
    maps = client.submit(handle_file(str(path)), "a,b", ["clearclip"], "both", 30, 20, api_name="/attention").result(timeout=CALL_TIMEOUT_S)
    assert len(maps) == 2 and Image.open(maps[1]["image"]).size == (80, 48) and "entropy" in maps[1]["caption"]
    entmax = client.submit(handle_file(str(path)), "a,b", ["clearclip", "sclip"], "entmax:1.5", api_name="/predict").result(timeout=CALL_TIMEOUT_S)
    assert [m["caption"].split(" ")[0] for m in entmax] == ["clearclip-entmax", "sclip-entmax"]
    # an error is said in the page (the client gets its message), not left as a spinner
    with pytest.raises(Exception, match="duplicate class name"):
        client.submit(handle_file(str(path)), "a,a", ["clearclip"], "softmax", api_name="/predict").result(timeout=CALL_TIMEOUT_S)


def test_demo_page_in_headless_chromium_shows_the_form_and_the_random_weights_note(server, tmp_path):
    shot = tmp_path / "demo.png"
    budget = "--virtual-time-budget=15000"  # let the page's scripts build the form before the shot
    console = screenshot(server, shot, 1200, 900, budget, timeout=120)
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape == (900, 1200, 3)
    assert img.std() > 20 and len(np.unique(img.reshape(-1, 3), axis=0)) > 50  # not a blank page
    dom, _ = run_chromium(server, "--dump-dom", budget, width=1200, height=900, timeout=120)
    assert "Random weights" in dom and "segment" in dom
    # methods once each, the entmax twin behind the normalizer choice, and what is not offered (and why)
    assert "methods to compare" in dom and "clearclip" in dom and "entmax:1.5" in dom and "presets not offered here" in dom
    assert "clearclip-entmax" not in dom.split("presets not offered here")[0]
    assert not [m for m in console if "Uncaught" in m]


def test_demo_command_without_gradio_says_how_to_install_it(monkeypatch):
    import sys

    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    monkeypatch.setitem(sys.modules, "gradio", None)  # what `import gradio` meets when the extra is missing
    result = CliRunner().invoke(app, ["demo", "--pretrained", "none"])
    assert result.exit_code == 2 and 'pip install -e ".[demo]"' in result.stderr.strip().splitlines()[-1]


def test_the_demo_offers_what_it_can_run_grouped_by_method(tiny_clip):
    """Issue 25, reliability 5: of the 38 presets the tiny 3-block model runs only those whose taps fit in
    it, and CorrCLIP's need region masks the demo was not given: both left out with the reason; each
    method is offered once, its -entmax twin behind the normalizer choice."""
    from clipseg_sparse.analysis.demo import methods_of, offered_presets, presets_for
    from clipseg_sparse.attention import list_presets

    offered, left_out = offered_presets(tiny_clip)
    assert set(offered) | set(left_out) == set(list_presets()) and not set(offered) & set(left_out)
    assert {"clearclip", "clearclip-entmax", "sclip", "maskclip"} <= set(offered)
    assert "scclip-l14" in left_out and "needs more blocks than" in left_out["scclip-l14"]
    assert "corrclip" in left_out
    with_regions, why_not = offered_presets(tiny_clip, regions=object())
    assert "needs region masks" not in " ".join(why_not.values())
    methods = methods_of(offered)
    assert methods["clearclip"] == {"softmax": "clearclip", "entmax:1.5": "clearclip-entmax"} and "clearclip-entmax" not in methods
    assert methods["maskclip"] == {"softmax": "maskclip"}
    assert presets_for(methods, ["clearclip", "maskclip"], "both") == ["clearclip", "clearclip-entmax", "maskclip"]
    assert presets_for(methods, ["clearclip", "maskclip"], "entmax:1.5") == ["clearclip-entmax", "maskclip"]  # maskclip has no twin
    with pytest.raises(DemoError, match="not offered"):
        presets_for(methods, ["scclip-l14"], "softmax")


def test_a_preset_that_fails_says_why_as_a_demo_error(tiny_clip, image):
    """corrclip without a region source was a ValueError in the server log and a spinner in the page."""
    model = DemoModel(tiny_clip, SETTINGS, "single")
    with pytest.raises(DemoError, match="corrclip: "):
        model.predict(image, "a,b", ["corrclip"])


def test_attention_of_a_preset_reading_region_maps_uses_the_demo_region_source(proxy, tmp_path):  # noqa: F811
    """Clicking for CorrCLIP's attention failed ("needs region masks") while /predict, given the demo's
    region source, worked: the attention now reads the same source (an upload is named "image")."""
    from test_corrclip import TINY, region_map

    from clipseg_sparse.analysis.explain import attention_image, explain
    from clipseg_sparse.segment.regions import RegionFolder

    clip, _ = proxy
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    np.save(tmp_path / "image.npy", region_map(rng, 64, 96).numpy().astype(np.int32))
    source, spec, settings = RegionFolder(tmp_path), TINY.format(eps=0.2, norm="entmax:1.5"), InferenceSettings(resolution=0, window=64, stride=32)
    with pytest.raises(DemoError, match="needs region masks for each image"):
        DemoModel(clip, settings, "single").attention(rgb, "cat,dog", [spec], 30, 20)
    model = DemoModel(clip, settings, "single", regions=source)
    assert len(model.predict(rgb, "cat,dog", [spec])) == 1
    ((drawn, caption),) = model.attention(rgb, "cat,dog", [spec], 30, 20)
    view = explain(clip, rgb, "cat,dog", [spec], (30, 20), settings, "single", regions=source, name="image")[0]
    assert np.array_equal(drawn, attention_image(view)) and caption == f"{spec}: {view.title.splitlines()[1]}"
    assert view.nonzero < view.tokens == 96  # entmax over DINO's 8 x 12 grid, scoped by the regions


def test_presets_with_a_retrieval_stage_are_left_out_naming_the_bank(vit_b16):
    """corrclipv2 was offered and failed on pick ("needs an image bank"): the demo takes no --bank."""
    from clipseg_sparse.analysis.demo import offered_presets

    offered, left_out = offered_presets(vit_b16, regions=object())
    for name in ("corrclipv2", "corrclipv2-entmax"):
        assert name not in offered and "retrieve:20:0.5 needs an image bank" in left_out[name] and "--bank BANK" in left_out[name]
    assert "needs more blocks than" in left_out["corrclipv2-l14"]  # too deep for a ViT-B first
    assert {"corrclipv2-values", "corrclip"} <= set(offered)  # the same region maps, no retrieval stage
    assert "needs region masks" in offered_presets(vit_b16)[1]["corrclipv2"]  # without a region source, that first


@pytest.fixture
def offline(monkeypatch):
    """Hub weights cached for the backbones in the returned set only, the Hub unreachable, and any load or
    download an error (the check must look at files only)."""
    import huggingface_hub

    from clipseg_sparse.models import backbones, proxies

    cached: set[str] = set()

    def refuse(*args, **kwargs):
        raise AssertionError("the availability check loaded or downloaded weights")

    monkeypatch.setattr(proxies, "hub_weights_cached", lambda info: info.name in cached)
    monkeypatch.setattr(proxies, "hub_unavailable", lambda repo: "huggingface.co is unreachable")
    for module, name in ((proxies, "load_backbone"), (backbones, "create_backbone_model"), (huggingface_hub, "hf_hub_download")):
        monkeypatch.setattr(module, name, refuse)
    return cached


def _pretrained(clip, proxy_weights: str = "auto"):
    """The model as if it had real weights (its backbones then default to the Hub), weights unchanged."""
    import copy

    clip = copy.copy(clip)
    clip.pretrained, clip.proxy_weights = "openai", proxy_weights
    return clip


def test_random_weights_leave_no_preset_out_for_backbone_weights(vit_b16, offline):
    """With --pretrained none the proxies run with random weights too: nothing is missing, even offline."""
    from clipseg_sparse.analysis.demo import offered_presets
    from clipseg_sparse.attention import list_presets

    clip = _pretrained(vit_b16)
    clip.pretrained = "none"
    offered, left_out = offered_presets(clip, regions=object())
    assert {"proxyclip", "proxyclip-sam", "corrclip", "ovstitcher", "trident", "lposs", "lposs+"} <= set(offered)
    assert not [why for why in left_out.values() if "backbone weights" in why]
    assert set(offered) | set(left_out) == set(list_presets())


def test_presets_whose_backbone_weights_are_not_at_hand_offline_are_left_out_naming_them(vit_b16, offline, tmp_path, monkeypatch):
    from clipseg_sparse.analysis.demo import offered_presets
    from clipseg_sparse.models import proxies

    offline.add("dinov2_vitb14_reg")
    offered, left_out = offered_presets(_pretrained(vit_b16), regions=object())
    assert {"sclip", "pearl", "proxyclip-dinov2", "proxyclip-dinov2-entmax"} <= set(offered)  # no backbone, or a cached one
    for name in ("proxyclip", "corrclip", "ovstitcher", "corrclipv2-values"):
        why = left_out[name]
        assert why.startswith("needs backbone weights: dino_vitb8's weights (timm/vit_base_patch8_224.dino)"), why
        assert "huggingface.co is unreachable" in why and why.endswith("--proxy-weights dino_vitb8=FILE")
    assert "sam_vitb's weights (timm/samvit_base_patch16.sa1b)" in left_out["proxyclip-sam"]
    assert left_out["trident"].endswith("--proxy-weights dino_vitb16=FILE,sam_vitb=FILE")  # both of its backbones
    assert "timm/vit_base_patch16_224.dino" in left_out["lposs+"]
    assert "image bank" in left_out["corrclipv2"]  # the retrieval stage is said first

    offline.add("sam_vitb")
    assert "sam_vitb" not in offered_presets(_pretrained(vit_b16), regions=object())[1]["trident"]

    # a checkpoint file given for one backbone: offered once the file exists
    dino = tmp_path / "dino.pth"
    clip = _pretrained(vit_b16, f"dino_vitb8={dino}")
    why = offered_presets(clip, regions=object())[1]["proxyclip"]
    assert str(dino) in why and "not found" in why
    dino.write_bytes(b"weights")
    offered, left_out = offered_presets(clip, regions=object())
    assert {"proxyclip", "corrclip"} <= set(offered) and "trident" in left_out  # dino_vitb16 still from the Hub

    # online, what is not cached is downloaded when picked, as for CLIP's own weights
    monkeypatch.setattr(proxies, "hub_unavailable", lambda repo: None)
    offered, left_out = offered_presets(_pretrained(vit_b16), regions=object())
    assert {"proxyclip", "trident", "lposs"} <= set(offered) and not [w for w in left_out.values() if "backbone weights" in w]


def test_the_page_lists_presets_left_out_for_weights_with_the_reason(vit_b16, offline):
    """The reasons reach the page's "not offered here" list (built, not served)."""
    demo = build_demo(_pretrained(vit_b16), SETTINGS, "single", PRESETS)
    listed = [b.value for b in demo.blocks.values() if getattr(b, "elem_id", None) == "left-out"]
    assert len(listed) == 1 and "- `proxyclip`: needs backbone weights: dino_vitb8's weights" in listed[0]
    assert "- `corrclip`: needs region masks" in listed[0]


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
        one_line(invoke("demo", *TINY_CPU, "--port", port), f"--port {port}: cannot serve there", "pick another --port")
