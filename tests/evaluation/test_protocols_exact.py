"""The published pipelines' arithmetic below the configs: positional-embedding rule, OpenCV resize,
window remainders, saved probabilities, and that nothing moves where a rule does not apply."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import window_run
from clipseg_sparse import AttentionSpec, InferenceSettings, Segmenter
from clipseg_sparse.segment.preprocess import resized_shape, to_pixels, window_boxes, window_geometry
from clipseg_sparse.segment.windows import dense_cosine
from clipseg_sparse.evaluation.protocols import PROTOCOLS


def _cubic(x: float, a: float = -0.75) -> float:
    """Keys' cubic convolution kernel with a = -0.75 (PyTorch's bicubic)."""
    x = abs(x)
    if x <= 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _bicubic_axis(values: np.ndarray, n_out: int, step: float) -> np.ndarray:
    """Resample axis 0 of `values` to n_out samples; output i reads source (i + 0.5) * step - 0.5,
    4 taps, indices clamped to the border."""
    n_in = values.shape[0]
    out = np.zeros((n_out,) + values.shape[1:])
    for i in range(n_out):
        src = (i + 0.5) * step - 0.5
        base = math.floor(src)
        for k in range(-1, 3):
            out[i] += _cubic(src - (base + k)) * values[min(max(base + k, 0), n_in - 1)]
    return out


def _hand_pos_embedding(pos: np.ndarray, native: int, grid: tuple[int, int], steps: tuple[float, float]) -> np.ndarray:
    patches = pos[1:].reshape(native, native, -1)
    rows = _bicubic_axis(patches, grid[0], steps[0])
    both = _bicubic_axis(rows.transpose(1, 0, 2), grid[1], steps[1]).transpose(1, 0, 2)
    return np.concatenate([pos[:1], both.reshape(grid[0] * grid[1], -1)])


@pytest.mark.parametrize("grid", [(6, 5), (3, 7), (9, 9)])
def test_scale_factor_rule_equals_hand_bicubic_and_differs_from_size(tiny_clip, grid):
    pos = tiny_clip.visual.positional_embedding.detach().double().numpy()
    native = tiny_clip.visual.grid_size[0]
    # published: scale_factor = (n + 0.1) / native, so the source step is native / (n + 0.1)
    scale = _hand_pos_embedding(pos, native, grid, (native / (grid[0] + 0.1), native / (grid[1] + 0.1)))
    size = _hand_pos_embedding(pos, native, grid, (native / grid[0], native / grid[1]))
    got_scale = tiny_clip.positional_embedding(grid, "scale").double().numpy()
    got_size = tiny_clip.positional_embedding(grid, "size").double().numpy()
    assert np.allclose(got_scale, scale, atol=1e-5)
    assert np.allclose(got_size, size, atol=1e-5)
    assert np.abs(got_scale - got_size).max() > 1e-3  # the two rules really differ off the native grid


def test_scale_factor_rule_keeps_the_native_embedding_when_the_token_count_matches(tiny_clip):
    """As the published `x.shape[1] != positional_embedding.shape[0]` check: a 2 x 8 grid has the native
    4 x 4 grid's 16 patches, so it gets the native embedding unchanged (row-major)."""
    pos = tiny_clip.visual.positional_embedding
    assert tiny_clip.visual.grid_size == (4, 4)
    assert torch.equal(tiny_clip.positional_embedding((2, 8), "scale"), pos)
    assert not torch.allclose(tiny_clip.positional_embedding((2, 8), "size"), pos)
    assert torch.equal(tiny_clip.positional_embedding((4, 4), "size"), pos)
    with pytest.raises(ValueError, match="choose size, scale"):
        tiny_clip.positional_embedding((3, 3), "nearest")


def test_mmcv_target_sizes_by_hand():
    # scale = min(2048 / long side, 336 / short side); each side int(side * scale + 0.5)
    assert resized_shape(375, 500, 336) == (336, 448)  # 336/375 = 0.896: 448.0 -> 448
    assert resized_shape(333, 500, 336) == (336, 505)  # 336/333 = 1.009009...: 504.50 + 0.5 -> 505
    assert resized_shape(500, 281, 336) == (598, 336)  # 336/281 = 1.195729...: 597.86 + 0.5 -> 598
    assert resized_shape(100, 5000, 336) == (41, 2048)  # long side caps: 2048/5000 = 0.4096 -> 40.96 -> 41
    assert resized_shape(1024, 2048, 560) == (560, 1120)  # Cityscapes at 560


def test_opencv_resize_is_cv2_on_uint8_then_normalised(tiny_clip):
    cv2 = pytest.importorskip("cv2")
    image = np.random.default_rng(6).integers(0, 256, (333, 500, 3), dtype=np.uint8)
    size = resized_shape(333, 500, 336)
    resized = cv2.resize(image, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)  # (width, height), as mmcv
    assert resized.dtype == np.uint8 and resized.shape == (*size, 3)
    mean = np.array(tiny_clip.mean) * 255
    std = np.array(tiny_clip.std) * 255
    expected = ((resized.astype(np.float64) - mean) / std).transpose(2, 0, 1)
    got = to_pixels(image, tiny_clip, size, "opencv")[0].double().numpy()
    assert np.allclose(got, expected, atol=1e-5)
    # the float resize differs from it, by less than one grey level per pixel
    floats = to_pixels(image, tiny_clip, size, "torch")[0].double().numpy()
    grey = np.abs(floats - got) * std.reshape(3, 1, 1)
    assert grey.max() > 0.2 and grey.max() < 1.0
    assert np.array_equal(to_pixels(image, tiny_clip, (333, 500), "opencv"), to_pixels(image, tiny_clip, (333, 500), "torch"))


def test_window_geometry_by_hand():
    # a 505-pixel side with 16-pixel patches: 31 whole patches and 9 pixels over
    assert window_geometry(505, 16, "pad") == (32, 0, 7, 512)
    assert window_geometry(505, 16, "centre") == (32, 3, 4, 512)  # ClearCLIP: 7 pixels, 3 before, 4 after
    assert window_geometry(505, 16, "drop") == (31, 0, -9, 505)
    assert window_geometry(505, 16, "centre", whole_image=True) == (31, 0, -9, 505)
    assert window_geometry(224, 16, "drop") == window_geometry(224, 16, "pad") == (14, 0, 0, 224)
    with pytest.raises(ValueError, match="smaller than one 16-pixel patch"):
        window_geometry(10, 16, "drop")


def _reference_cosine(clip, pixels, text, spec, window, stride, rule, pos_interp, out_size):
    """The published sliding-window loop: crop each window; drop = keep floor(side / patch) patches
    and stretch their map over the window; centre = zero-pad half before, half after, upsample to the
    padded size and cut the window back out; average overlaps; resize to out_size."""
    _, _, H, W = pixels.shape
    ps = clip.patch_size
    total, count = torch.zeros(len(text), H, W), torch.zeros(1, H, W)
    for y1, y2, x1, x2 in window_boxes(H, W, window, stride):
        crop = pixels[..., y1:y2, x1:x2]
        h, w = y2 - y1, x2 - x1
        if rule == "drop":
            feats = clip.encode_dense(crop[..., : h // ps * ps, : w // ps * ps], spec, pos_interp=pos_interp)[0]
            cos = F.interpolate((feats @ text.T).permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0]
        else:
            eh, ew = -h % ps, -w % ps
            t, left = eh // 2, ew // 2
            padded = F.pad(crop, (left, ew - left, t, eh - t))
            feats = clip.encode_dense(padded, spec, pos_interp=pos_interp)[0]
            cos = F.interpolate((feats @ text.T).permute(2, 0, 1)[None], size=padded.shape[-2:], mode="bilinear")[0]
            cos = cos[:, t : t + h, left : left + w]
        total[:, y1:y2, x1:x2] += cos
        count[:, y1:y2, x1:x2] += 1
    return F.interpolate((total / count)[None], size=out_size, mode="bilinear", align_corners=False)[0]


@pytest.mark.parametrize("rule,window,stride", [("drop", 0, 0), ("drop", 40, 24), ("centre", 40, 24)])
def test_dense_cosine_follows_the_published_window_remainders(tiny_clip, rule, window, stride):
    torch.manual_seed(7)
    pixels = torch.randn(1, 3, 70, 101)
    text = F.normalize(torch.randn(5, tiny_clip.embed_dim), dim=-1)
    spec = AttentionSpec.parse("qq/softmax/nores/noffn")
    ref = _reference_cosine(tiny_clip, pixels, text, spec, window, stride, rule, "scale", (83, 120))
    run = window_run(tiny_clip, pixels, spec, text, window=window, stride=stride or 1, batch_size=3, pos_interp="scale", remainder=rule)
    out = dense_cosine(run, (83, 120)).rows(0, 83)
    assert torch.allclose(out, ref, atol=1e-5)
    padded = dense_cosine(window_run(tiny_clip, pixels, spec, text, window=window, stride=stride or 1, batch_size=3, pos_interp="scale"), (83, 120)).rows(0, 83)
    assert not torch.allclose(out, padded, atol=1e-3)


PUBLISHED_CODE = {
    "sclip": dict(resize="opencv", pos_interp="scale", remainder="drop", renormalize=False),
    "clearclip": dict(resize="opencv", pos_interp="scale", remainder="centre", renormalize=False),
    "naclip": dict(resize="opencv", pos_interp="scale", remainder="drop", renormalize=True),
    "naclip-v1": dict(resize="opencv", pos_interp="scale", remainder="drop", renormalize=False),
}


@pytest.mark.parametrize("protocol", list(PUBLISHED_CODE))
def test_protocols_use_the_published_code_paths_and_segment_keeps_its_own(protocol):
    for dataset in ("voc21", "ade20k", "cityscapes"):
        settings = PROTOCOLS.get(protocol).settings(dataset)
        assert {k: getattr(settings, k) for k in PUBLISHED_CODE[protocol]} == PUBLISHED_CODE[protocol]
    default = InferenceSettings()
    assert (default.resize, default.pos_interp, default.remainder, default.renormalize, default.pamr) == ("torch", "size", "pad", False, False)


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(8).integers(0, 256, (48, 80, 3), dtype=np.uint8)


VOCAB = "a,b|c|d,e,f,g,h|i"  # 6 classes, 9 names: synonym maxima do not sum to 1


def test_saved_probabilities_zero_the_classes_the_area_threshold_drops(tiny_clip, image):
    base = InferenceSettings(resolution=0, window=0)
    probs = Segmenter(tiny_clip, VOCAB, spec="sclip", settings=base, templates="single").predict(image).probs
    counts = np.bincount(probs.argmax(0).ravel(), minlength=6)[1:]
    fractions = sorted(set(counts[counts > 0] / counts.sum()))
    assert len(fractions) >= 2, "the fixture should predict foreground classes of different sizes"
    threshold = (fractions[0] + fractions[1]) / 2
    dropped = [k + 1 for k in range(5) if counts[k] / counts.sum() <= threshold]
    expected = probs.copy()
    expected[dropped] = 0  # SCLIP: seg_logits[1:] *= (area > area_thd * foreground area)
    result = Segmenter(tiny_clip, VOCAB, spec="sclip", settings=base.replace(area_threshold=threshold), templates="single").predict(image)
    assert dropped and np.array_equal(result.probs, expected)
    assert np.array_equal(result.labels, expected.argmax(0))


def test_saved_probabilities_renormalised_after_the_synonym_max(tiny_clip, image):
    base = InferenceSettings(resolution=0, window=0, bg_threshold=0.3)
    plain = Segmenter(tiny_clip, VOCAB, spec="naclip", settings=base, templates="single").predict(image)
    renorm = Segmenter(tiny_clip, VOCAB, spec="naclip", settings=base.replace(renormalize=True), templates="single").predict(image)
    assert not np.allclose(plain.probs.sum(0), 1.0, atol=1e-3)
    assert np.allclose(renorm.probs, plain.probs / plain.probs.sum(0, keepdims=True), atol=1e-6)
    assert np.array_equal(renorm.labels, plain.labels)  # labels (and the prob_thd test) use the raw maxima


@pytest.mark.parametrize("protocol", ["sclip", "clearclip", "naclip", "naclip-v1"])
def test_outputs_unchanged_where_the_published_rules_do_not_apply(tiny_clip, protocol):
    """No resize, whole-patch 64-pixel windows on the native 64-pixel grid: the OpenCV resize, the
    scale-factor rule and the remainder rules are no-ops, so the protocol gives what the old pipeline
    gave (its PAMR and renormalisation switched off, as they do change outputs)."""
    settings = PROTOCOLS.get(protocol).settings("ade20k", {"resolution": 0, "window": 64, "stride": 16}).replace(pamr=False, renormalize=False)
    old = settings.replace(resize="torch", pos_interp="size", remainder="pad")
    image = np.random.default_rng(9).integers(0, 256, (64, 96, 3), dtype=np.uint8)  # 64 x 64 windows: the native grid
    new_result = Segmenter(tiny_clip, "a,b|c,d", spec=protocol.split("-")[0], settings=settings, templates="single").predict(image)
    old_result = Segmenter(tiny_clip, "a,b|c,d", spec=protocol.split("-")[0], settings=old, templates="single").predict(image)
    assert np.array_equal(new_result.probs, old_result.probs) and np.array_equal(new_result.labels, old_result.labels)
