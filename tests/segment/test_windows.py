import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import window_run
from clipseg_sparse import AttentionSpec, InferenceSettings, Segmenter, Vocabulary
from clipseg_sparse.segment.labels import ClassMaps, class_probabilities, probabilities_to_labels
from clipseg_sparse.segment.preprocess import resized_shape, to_pixels, window_boxes
from clipseg_sparse.segment.maps import DenseMap, factored as _factored
from clipseg_sparse.segment.vocabulary import embed_names, openai_imagenet_templates, resolve_templates


def test_vocabulary_parsing(tmp_path):
    v = Vocabulary.parse("cat, dog|puppy ,sky")
    assert v.names == (("cat",), ("dog", "puppy"), ("sky",))
    assert v.labels == ("cat", "dog", "sky")
    assert v.flat_names == ("cat", "dog", "puppy", "sky")
    assert v.name_to_class == [0, 1, 1, 2]
    f = tmp_path / "cls.txt"
    f.write_text("sky, wall, tree\naeroplane\nperson, person in shirt\n")
    v = Vocabulary.from_file(f)
    assert v.names[0] == ("sky", "wall", "tree") and v.names[2] == ("person", "person in shirt")
    bg = Vocabulary.parse("cat").with_background(["sky", "wall"])
    assert bg.labels == ("background", "cat") and bg.names[0] == ("sky", "wall")
    with pytest.raises(ValueError, match="empty"):
        Vocabulary.parse(" , ")


def test_templates(tmp_path):
    assert len(openai_imagenet_templates()) == 80
    assert all("{}" in t for t in openai_imagenet_templates())
    assert resolve_templates("single") == ("a photo of a {}.",)
    f = tmp_path / "t.txt"
    f.write_text("a {} here\n\nthe {}\n")
    assert resolve_templates(str(f)) == ("a {} here", "the {}")
    f.write_text("no placeholder\n")
    with pytest.raises(ValueError, match="placeholder"):
        resolve_templates(str(f))


def test_config_tells_template_lists_apart(tiny_clip):
    """Two different lists of the same length made the same configuration (only their count was kept)."""
    config = lambda t: Segmenter(tiny_clip, "a,b", templates=t).config()["templates"]  # noqa: E731
    assert config(["a {}.", "b {}."]) != config(["c {}.", "d {}."])
    assert config(["a {}.", "b {}."]) == ["a {}.", "b {}."]
    assert (config("openai"), config("single"), config("none")) == ("openai", "single", "none")
    assert config(list(openai_imagenet_templates())) == "openai"  # the same set, however it is given


def test_text_embedding_is_mean_of_normalised_templates(tiny_clip):
    templates = ("a photo of a {}.", "a drawing of a {}.")
    emb = embed_names(tiny_clip, ["cat", "dog"], templates, use_cache=False)
    per = F.normalize(tiny_clip.encode_text([t.format(n) for n in ["cat", "dog"] for t in templates]), dim=-1)
    ref = F.normalize(per.view(2, 2, -1).mean(1), dim=-1)
    assert torch.allclose(emb, ref, atol=1e-6)


def test_text_cache(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    from clipseg_sparse import load_clip
    from conftest import TINY_CONFIG

    ckpt = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip.model.state_dict().items()}, ckpt)
    clip = load_clip(TINY_CONFIG, pretrained=str(ckpt))
    cache = tmp_path / "cache"
    first = embed_names(clip, ["cat", "dog"], "single", cache_dir=cache)
    files = list((cache / "text").glob("*.pt"))
    assert len(files) == 1
    calls = []
    original = clip.encode_text
    clip.encode_text = lambda texts, **kw: calls.append(texts) or original(texts)
    again = embed_names(clip, ["cat", "dog"], "single", cache_dir=cache)
    assert calls == [] and torch.equal(first, again)
    embed_names(clip, ["cat", "bird"], "single", cache_dir=cache)  # new vocabulary: new entry
    assert len(calls) == 1 and len(list((cache / "text").glob("*.pt"))) == 2
    # the activation changes the text tower: QuickGELU weights must not be served GELU embeddings
    gelu = load_clip(TINY_CONFIG, pretrained=str(ckpt), quick_gelu=True)
    assert not torch.allclose(embed_names(gelu, ["cat", "dog"], "single", cache_dir=cache), first, atol=1e-4)
    # random weights are never cached: their embeddings change with every initialisation
    embed_names(tiny_clip, ["cat"], "single", cache_dir=tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_resized_shape_follows_mmcv_rescale():
    assert resized_shape(500, 375, 336) == (448, 336)
    assert resized_shape(336, 5000, 336) == (138, 2048)  # long side capped
    assert resized_shape(100, 200, 0) == (100, 200)


def test_max_long_side_0_means_no_cap(tiny_clip):
    assert resized_shape(16, 100, 32, 0) == (32, 200)
    image = np.random.default_rng(4).integers(0, 255, (16, 100, 3), dtype=np.uint8)
    results = [
        Segmenter(tiny_clip, "a,b", settings=InferenceSettings(resolution=32, max_long_side=cap, window=32, stride=32), templates="single").predict(image)
        for cap in (0, 200)  # 200: the uncapped long side, so both see the same input
    ]
    assert results[0].labels.shape == (16, 100)
    assert np.array_equal(results[0].probs, results[1].probs)


def test_window_boxes_cover_image_and_stay_inside():
    boxes = window_boxes(336, 500, 224, 112)
    assert len(boxes) == 2 * 4
    assert all(y2 - y1 == 224 and x2 - x1 == 224 for y1, y2, x1, x2 in boxes)
    assert max(x2 for *_, x2 in boxes) == 500 and min(x1 for _, _, x1, _ in boxes) == 0
    cover = np.zeros((336, 500), int)
    for y1, y2, x1, x2 in boxes:
        cover[y1:y2, x1:x2] += 1
    assert cover.min() >= 1
    assert window_boxes(100, 150, 224, 112) == [(0, 100, 0, 150)]
    assert window_boxes(100, 150, 0, 0) == [(0, 100, 0, 150)]


def test_class_probabilities_max_over_synonyms():
    cos = torch.tensor([[0.1, 0.9], [0.5, 0.2], [0.3, 0.1]]).view(3, 1, 2)
    probs = class_probabilities(cos * 10.0, [0, 1, 1], 2)
    names = torch.softmax(cos * 10, dim=0)
    assert torch.allclose(probs[0], names[0])
    assert torch.allclose(probs[1], torch.maximum(names[1], names[2]))


def test_background_rules():
    probs = torch.tensor([[0.2, 0.1, 0.5, 0.1], [0.3, 0.85, 0.25, 0.1], [0.5, 0.05, 0.25, 0.8]]).view(3, 1, 4)
    assert probabilities_to_labels(probs).flatten().tolist() == [2, 1, 0, 2]
    assert probabilities_to_labels(probs, bg_threshold=0.6).flatten().tolist() == [0, 1, 0, 2]
    # class 1 covers 1 of 3 non-background pixels: an area threshold of 0.4 drops it
    assert probabilities_to_labels(probs, area_threshold=0.4).flatten().tolist() == [2, 0, 0, 2]


@pytest.mark.parametrize("bg_threshold, area_threshold", [(0.0, 0.0), (0.3, 0.0), (0.0, 0.2), (0.25, 0.15)])
def test_labels_read_off_the_logits_equal_the_labels_of_the_probabilities(bg_threshold, area_threshold):
    # ClassMaps.labels never builds the probabilities; the labels must be those of the probability path
    torch.manual_seed(0)
    name_to_class = [0, 0, 1, 2, 2, 2, 3, 4]  # synonyms for classes 0 and 2
    cosine = torch.randn(len(name_to_class), 37, 53) * 0.1
    cosine[6] -= 0.2  # class 3 wins rarely: the area threshold drops it
    maps = ClassMaps(DenseMap(cosine.clone()), name_to_class, 5, 40.0, budget=4000)
    assert len(maps.bands) > 1
    probs = class_probabilities(cosine * 40.0, name_to_class, 5)
    expected = probabilities_to_labels(probs, bg_threshold, area_threshold).numpy()
    labels = maps.labels(bg_threshold, area_threshold)
    np.testing.assert_array_equal(labels, expected)
    # the factored map of the window grids: its labels come block by block from its pieces
    ly, lx = torch.rand(37, 6), torch.rand(53, 9)
    factored = _factored(torch.randn(6, 9, len(name_to_class)) * 0.1, ly / ly.sum(1, keepdim=True), lx / lx.sum(1, keepdim=True))
    whole = factored.rows(0, 37)
    probs_f = class_probabilities(whole * 40.0, name_to_class, 5)
    labels_f = ClassMaps(factored, name_to_class, 5, 40.0, budget=4000).labels(bg_threshold, area_threshold)
    np.testing.assert_array_equal(labels_f, probabilities_to_labels(probs_f, bg_threshold, area_threshold).numpy())
    if bg_threshold:
        assert (labels == 0).mean() > (probs.argmax(0).numpy() == 0).mean()  # the threshold acted
    if area_threshold:
        assert 3 in probs.argmax(0) and 3 not in labels


def test_predict_whole_image_equals_direct_computation(tiny_clip):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    settings = InferenceSettings(resolution=0, window=0, logit_scale=40.0)
    seg = Segmenter(tiny_clip, "cat,dog|puppy,sky", spec="clearclip-entmax", settings=settings, templates="single")
    result = seg.predict(image)
    # by hand: encode_dense, cosine with each name, upsample, softmax * 40, max over synonyms, argmax
    pixels = (torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255 - torch.tensor(tiny_clip.mean).view(1, 3, 1, 1)) / torch.tensor(
        tiny_clip.std
    ).view(1, 3, 1, 1)
    feats = tiny_clip.encode_dense(pixels, "qq/entmax:1.5/nores/noffn")[0]
    text = embed_names(tiny_clip, ["cat", "dog", "puppy", "sky"], ("a photo of a {}.",), use_cache=False)
    cos = F.interpolate((feats @ text.T).permute(2, 0, 1)[None], size=(64, 96), mode="bilinear", align_corners=False)[0]
    p = torch.softmax(40 * cos, dim=0)
    probs = torch.stack([p[0], torch.maximum(p[1], p[2]), p[3]])
    assert np.allclose(result.probs, probs.numpy(), atol=1e-5)
    assert np.array_equal(result.labels, probs.argmax(0).numpy())
    assert result.class_names == ("cat", "dog", "sky")
    assert result.settings["attention"] == "qq/entmax:1.5/nores/noffn"


def test_sliding_windows_are_batched_and_average_overlaps(tiny_clip):
    image = np.random.default_rng(1).integers(0, 255, (80, 120, 3), dtype=np.uint8)
    base = dict(resolution=0, window=64, stride=32, logit_scale=40.0)
    seg1 = Segmenter(tiny_clip, "a,b", spec="sclip", settings=InferenceSettings(**base, batch_size=1), templates="single")
    seg8 = Segmenter(tiny_clip, "a,b", spec="sclip", settings=InferenceSettings(**base, batch_size=8), templates="single")
    assert np.allclose(seg1.predict(image).probs, seg8.predict(image).probs, atol=1e-5)
    # a single window covering the whole image equals whole-image inference
    whole = Segmenter(tiny_clip, "a,b", spec="sclip", settings=InferenceSettings(resolution=0, window=0), templates="single")
    one = Segmenter(tiny_clip, "a,b", spec="sclip", settings=InferenceSettings(resolution=0, window=128, stride=64), templates="single")
    assert np.allclose(whole.predict(image).probs, one.predict(image).probs, atol=1e-5)


def test_predict_resizes_back_to_original(tiny_clip):
    image = np.random.default_rng(2).integers(0, 255, (90, 130, 3), dtype=np.uint8)
    seg = Segmenter(tiny_clip, "a,b,c", settings=InferenceSettings(resolution=64, window=64, stride=32), templates="single")
    r = seg.predict(image)
    assert r.labels.shape == (90, 130) and r.probs.shape == (3, 90, 130)
    assert sum(r.present().values()) == pytest.approx(1.0)


def test_to_pixels_normalises(tiny_clip):
    img = np.full((4, 4, 3), 255, np.uint8)
    px = to_pixels(img, tiny_clip, (4, 4))
    expected = (1 - torch.tensor(tiny_clip.mean)) / torch.tensor(tiny_clip.std)
    assert torch.allclose(px[0, :, 0, 0], expected, atol=1e-5)


@pytest.mark.parametrize("window,stride,out_size", [(48, 20, None), (40, 24, (131, 77)), (0, 0, (50, 90))])
def test_dense_cosine_equals_per_window_upsample_and_average(tiny_clip, window, stride, out_size):
    # the reference does it the slow, obvious way: each window upsampled (padded to the patch grid,
    # then cropped), added into place, divided by the overlap count, then resized to out_size
    from clipseg_sparse.segment.windows import dense_cosine

    torch.manual_seed(3)
    pixels = torch.randn(1, 3, 70, 101)
    text = F.normalize(torch.randn(5, tiny_clip.embed_dim), dim=-1)
    spec = AttentionSpec.parse("qq/entmax:1.5/nores/noffn")
    total, count = torch.zeros(5, 70, 101), torch.zeros(1, 70, 101)
    for y1, y2, x1, x2 in window_boxes(70, 101, window, stride):
        ph, pw = -(y2 - y1) % tiny_clip.patch_size, -(x2 - x1) % tiny_clip.patch_size
        feats = tiny_clip.encode_dense(F.pad(pixels[..., y1:y2, x1:x2], (0, pw, 0, ph)), spec)[0]
        cos = F.interpolate((feats @ text.T).permute(2, 0, 1)[None], size=(y2 - y1 + ph, x2 - x1 + pw), mode="bilinear")
        total[:, y1:y2, x1:x2] += cos[0, :, : y2 - y1, : x2 - x1]
        count[:, y1:y2, x1:x2] += 1
    ref = total / count
    if out_size:
        ref = F.interpolate(ref[None], size=out_size, mode="bilinear", align_corners=False)[0]
    cosine = dense_cosine(window_run(tiny_clip, pixels, spec, text, window=window, stride=stride, batch_size=3), out_size)
    assert cosine.shape == tuple(ref.shape)
    out = cosine.rows(0, ref.shape[1])
    assert torch.allclose(out, ref, atol=1e-5)
    # any band of rows is the same rows of the whole map, bit for bit
    for step in (1, 2, 7):
        bands = torch.cat([cosine.rows(y, min(y + step, ref.shape[1])) for y in range(0, ref.shape[1], step)], dim=1)
        assert torch.equal(bands, out)


def test_settings_replace_names_unknown_settings():
    """One check for eval overrides, sweep grids and the library (it used to be a bare TypeError here)."""
    with pytest.raises(ValueError, match="unknown inference setting.*windw.*choose from resolution"):
        InferenceSettings().replace(windw=3)
    assert InferenceSettings().replace(window=0, stride=None) == InferenceSettings(window=0)
