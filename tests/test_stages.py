import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import window_run
from clipseg_sparse import InferenceSettings, Segmenter
from clipseg_sparse.segment.labels import class_probabilities
from clipseg_sparse.segment.preprocess import resized_shape, to_pixels
from clipseg_sparse.segment.windows import dense_cosine
from clipseg_sparse.registry import UnknownNameError
from clipseg_sparse.stages import STAGES, Stage, pamr, parse_stage


def reference_pamr(mask: torch.Tensor, image: torch.Tensor, iterations: int, dilations) -> torch.Tensor:
    """NACLIP's pamr.py written out with clamped gathers instead of padded convolutions.

    mask N x H x W, image 3 x H x W. For every pixel: the 3 x 3 grid at each dilation (replicate border =
    clamped indices); sigma = unbiased std over all grid samples (centre included, once per dilation);
    affinity to the 8 off-centre samples per dilation = channel mean of -|I(p) - I(n)| / (1e-8 + 0.1 sigma);
    softmax over them; then `iterations` times mask(p) <- sum_n w(p, n) mask(n)."""
    _, H, W = image.shape
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")

    def at(t, oy, ox):
        return t[:, (ys + oy).clamp(0, H - 1), (xs + ox).clamp(0, W - 1)]

    grid = [(dy * d, dx * d, (dy, dx) == (0, 0)) for d in dilations for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    sigma = torch.stack([at(image, oy, ox) for oy, ox, _ in grid], dim=1).std(dim=1)  # 3 x H x W
    ring = [(oy, ox) for oy, ox, centre in grid if not centre]
    logits = torch.stack([(-(image - at(image, oy, ox)).abs() / (1e-8 + 0.1 * sigma)).mean(0) for oy, ox in ring])
    weights = torch.softmax(logits, dim=0)
    for _ in range(iterations):
        mask = sum(weights[k] * at(mask, oy, ox) for k, (oy, ox) in enumerate(ring))
    return mask


@pytest.mark.parametrize("iterations,dilations,size", [(10, (8, 16), (37, 45)), (3, (1, 2), (11, 9)), (1, (1,), (5, 6))])
def test_pamr_equals_the_published_loop(iterations, dilations, size):
    g = torch.Generator().manual_seed(sum(size))
    image = torch.randn(3, *size, generator=g)
    mask = torch.randn(4, *size, generator=g)
    out = pamr(mask, image, iterations, dilations)
    ref = reference_pamr(mask, image, iterations, dilations)
    assert out.shape == mask.shape
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, mask, atol=1e-2)  # it does something


def todays_pamr(cosine: torch.Tensor, guide: torch.Tensor, iterations: int, dilations) -> torch.Tensor:
    """PAMR before issue 33, kept as the reference: each iteration adds the 16 shifted views of the whole
    replicate-padded map."""
    from clipseg_sparse.stages import _shifted, pamr_affinity

    weights = pamr_affinity(guide, dilations)
    mask = cosine.float()
    for _ in range(iterations):
        out = torch.zeros_like(mask)
        for w, neighbour in zip(weights, _shifted(mask, dilations)):
            out.addcmul_(neighbour, w)
        mask = out
    return mask


@pytest.fixture(params=["torch", "C"])
def pamr_path(request, monkeypatch):
    """PAMR's torch loop, or its C kernel (`runtime/native/pamr.c`, built with the machine's compiler)."""
    from clipseg_sparse.runtime import native

    monkeypatch.setenv(native.ENV_SWITCH, "1" if request.param == "C" else "0")
    if request.param == "C" and native.kernel("pamr") is None:
        pytest.skip("no C compiler here: PAMR runs its torch loop")
    return request.param


@pytest.mark.parametrize("iterations,dilations,size,band", [(10, (8, 16), (37, 45), 3), (3, (1, 2), (11, 9), 8), (2, (20,), (9, 30), 2), (1, (1,), (5, 6), 1)])
def test_pamr_in_class_bands_is_bit_identical_to_the_padded_map(iterations, dilations, size, band, pamr_path):
    """Shifted slices of class bands with clamped ends (issue 33) give exactly today's sums, bands that split
    the classes and shifts wider than the image included. The C kernel sums in the same order with FMA, as
    ATen's addcmul on AVX2 / AVX-512 builds: the same bits there (measured), within 1e-6 on any CPU."""
    g = torch.Generator().manual_seed(sum(size))
    guide, cosine = torch.randn(3, *size, generator=g), torch.randn(5, *size, generator=g)
    today = todays_pamr(cosine, guide, iterations, dilations)
    strided = cosine.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # H x W x N memory, as the windows forward's map
    for got in (pamr(cosine, guide, iterations, dilations, band), pamr(strided, guide, iterations, dilations, band)):
        if pamr_path == "torch":
            assert torch.equal(got, today)
        else:
            torch.testing.assert_close(got, today, atol=1e-6, rtol=0)


def test_pamr_kernel_spreads_class_bands_over_threads(monkeypatch):
    """Bands of classes run on torch's threads (the weights given: torch's own reductions in the affinity
    may round by thread count)."""
    from clipseg_sparse.runtime import native
    from clipseg_sparse.stages import _RING, _pamr_native, pamr_affinity

    monkeypatch.setenv(native.ENV_SWITCH, "1")
    if native.kernel("pamr") is None:
        pytest.skip("no C compiler here: PAMR runs its torch loop")

    g = torch.Generator().manual_seed(5)
    guide, cosine = torch.randn(3, 23, 31, generator=g), torch.randn(13, 23, 31, generator=g)
    weights, offsets = pamr_affinity(guide, (2, 5)), [(dy * d, dx * d) for d in (2, 5) for dy, dx in _RING]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _pamr_native(native.kernel("pamr"), cosine, weights, offsets, 4, 2)
        torch.set_num_threads(3)
        assert torch.equal(_pamr_native(native.kernel("pamr"), cosine, weights, offsets, 4, 2), one)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, todays_pamr(cosine, guide, 4, (2, 5)), atol=1e-6, rtol=0)


def test_pamr_by_hand_on_one_pixel():
    """One iteration, dilation 1, at an interior pixel of a 3 x 3 image: weights from the explicit formula."""
    image = torch.tensor([[1.0, 2.0, 4.0], [0.5, 3.0, 1.5], [2.5, 0.0, 1.0]]).expand(3, 3, 3) * torch.tensor([1.0, 2.0, 0.5]).view(3, 1, 1)
    mask = torch.arange(9.0).view(1, 3, 3)
    centre = image[:, 1, 1]
    values = image.reshape(3, 9)
    sigma = values.std(dim=1)  # 9 samples: the whole 3 x 3 grid around the centre (dilation 1)
    neighbours = [i for i in range(9) if i != 4]
    a = torch.tensor([(-(centre - values[:, i]).abs() / (1e-8 + 0.1 * sigma)).mean() for i in neighbours])
    w = torch.softmax(a, 0)
    expected = sum(w[k] * mask.flatten()[i] for k, i in enumerate(neighbours))
    assert pamr(mask, image, 1, (1,))[0, 1, 1].item() == pytest.approx(expected.item(), rel=1e-6)


def test_pamr_keeps_constant_maps():
    image = torch.randn(3, 20, 30)
    mask = torch.full((2, 20, 30), 0.25)
    assert torch.allclose(pamr(mask, image), mask)


def test_stage_texts_parse_and_name_themselves():
    assert parse_stage("pamr").name == "pamr:10:8,16"
    assert parse_stage("pamr:5:1,2,4").name == "pamr:5:1,2,4"
    assert parse_stage("pamr").kind == "post"
    for bad in ("pamr:0", "pamr:x", "pamr:3:", "pamr:3:0,8", "pamr:1:2:3"):
        with pytest.raises(ValueError, match="expected pamr"):
            parse_stage(bad)
    with pytest.raises(UnknownNameError, match="unknown stage 'pamrr'.*Did you mean 'pamr'"):
        parse_stage("pamrr")
    with pytest.raises(ValueError, match="more than once: pamr:10:8,16"):
        InferenceSettings(pamr=True, stages=("pamr:10:8,16",))
    with pytest.raises(ValueError, match="unknown stage"):
        InferenceSettings().replace(stages=["nope"])
    assert InferenceSettings(stages=["pamr:2"]).stages == ("pamr:2",)  # lists from JSON / TOML become tuples


def test_segmenter_with_pamr_refines_the_full_size_cosine(tiny_clip):
    """predict with pamr on = the cosine at the original size, refined with the resized network input
    upsampled back to the original size as the guide, then the usual softmax and synonym max."""
    image = np.random.default_rng(4).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    base = dict(resolution=32, window=0, logit_scale=40.0)
    seg = Segmenter(tiny_clip, "a,b|c", spec="naclip", settings=InferenceSettings(**base, pamr=True), templates="single")
    plain = Segmenter(tiny_clip, "a,b|c", spec="naclip", settings=InferenceSettings(**base), templates="single")
    size = resized_shape(50, 70, 32)
    pixels = to_pixels(image, tiny_clip, size)
    cos = dense_cosine(window_run(tiny_clip, pixels, seg.spec, seg.text, window=0), (50, 70)).rows(0, 50)
    guide = F.interpolate(pixels, size=(50, 70), mode="bilinear", align_corners=False)[0]
    expected = class_probabilities(reference_pamr(cos.contiguous(), guide, 10, (8, 16)) * 40.0, [0, 1, 1], 2)
    result = seg.predict(image)
    assert np.allclose(result.probs, expected.numpy(), atol=1e-5)
    assert not np.allclose(result.probs, plain.predict(image).probs, atol=1e-3)
    assert seg.config()["stages"] == ["pamr:10:8,16"] and seg.config()["pamr"] is True
    assert plain.config()["stages"] == []


def test_text_and_token_stages_run_where_their_kind_says(tiny_clip, monkeypatch):
    """A text stage edits the text embeddings once; a token stage sees the hidden states entering the
    edited block (B x (1 + h*w) x C) with the patch grid."""
    from clipseg_sparse import stages as stages_module
    from clipseg_sparse.registry import Registry

    registry = Registry("stage")
    for name in STAGES:
        registry.register(name, STAGES.get(name))
    seen = []
    registry.register("flip", lambda args: Stage("text", "flip", lambda text: -text))
    registry.register("spy", lambda args: Stage("token", "spy", lambda x, grid: seen.append((tuple(x.shape), grid)) or x * 0))
    monkeypatch.setattr(stages_module, "STAGES", registry)
    image = np.random.default_rng(5).integers(0, 255, (32, 48, 3), dtype=np.uint8)
    settings = InferenceSettings(resolution=0, window=0)
    plain = Segmenter(tiny_clip, "a,b", spec="sclip", settings=settings, templates="single")
    flipped = Segmenter(tiny_clip, "a,b", spec="sclip", settings=settings.replace(stages=("flip",)), templates="single")
    assert torch.equal(flipped.text, -plain.text)
    assert torch.allclose(flipped.cosine(image).rows(0, 32), -plain.cosine(image).rows(0, 32), atol=1e-6)
    spied = Segmenter(tiny_clip, "a,b", spec="sclip", settings=settings.replace(stages=("spy",)), templates="single")
    spied.cosine(image)
    h, w = 32 // tiny_clip.patch_size, 48 // tiny_clip.patch_size
    assert seen == [((1, 1 + h * w, tiny_clip.visual.transformer.width), (h, w))]
    assert spied.config()["stages"] == ["spy"]


def test_cli_pamr_follows_the_protocol_and_the_flag(tmp_path):
    """eval: naclip has PAMR on, --no-pamr turns it off; each result file names the stages that ran."""
    import json

    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app
    from conftest import TINY_CONFIG
    from fake_benchmarks import make_benchmark

    make_benchmark("ade20k", tmp_path / "ade", n=1)
    base = ["eval", "--dataset", "ade20k", "--root", str(tmp_path / "ade"), "--model", TINY_CONFIG, "--pretrained", "none",
            "--templates", "single", "--resolution", "48", "--window", "32", "--stride", "16", "--protocol", "naclip"]  # fmt: skip
    configs = {}
    for flag in ("", "--no-pamr"):
        out = tmp_path / f"ade{flag}.json"
        result = CliRunner().invoke(app, base + ["--out", str(out)] + ([flag] if flag else []), env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        configs[flag] = json.loads(out.read_text())["config"]
    assert (configs[""]["pamr"], configs[""]["stages"]) == (True, ["pamr:10:8,16"])
    assert (configs["--no-pamr"]["pamr"], configs["--no-pamr"]["stages"]) == (False, [])
    assert configs[""]["pos_interp"] == "scale" and configs[""]["resize"] == "opencv" and configs[""]["renormalize"] is True


def test_cli_sweep_pamr_joins_every_cell(tmp_path):
    """sweep --pamr adds pamr to the grid's overrides: the sclip protocol's cell (PAMR off there) runs it."""
    import json

    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app
    from conftest import TINY_CONFIG
    from fake_benchmarks import make_benchmark

    make_benchmark("ade20k", tmp_path / "data", n=1)
    out = tmp_path / "sweep"
    args = ["sweep", "--models", TINY_CONFIG, "--pretrained", "none", "--datasets", "ade20k", "--resolutions", "48",
            "--templates", "single", "--protocol", "sclip", "--root", str(tmp_path / "data"), "--out", str(out),
            "--device", "cpu", "--pamr"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (path,) = [p for p in out.glob("*.json") if not p.name.endswith((".error.json", "summary.json"))]
    config = json.loads(path.read_text())["config"]
    assert config["pamr"] is True and config["stages"] == ["pamr:10:8,16"]
