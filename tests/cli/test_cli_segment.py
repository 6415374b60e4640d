"""`clipseg-sparse segment` end to end on the tiny model, with good and bad images."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets.labels import PALETTE
from conftest import TINY_CONFIG

runner = CliRunner()
CLASSES = "cat,dog|puppy,sky"
FAST = ["--templates", "single", "--resolution", "64", "--window", "64", "--stride", "32", "--device", "cpu"]


@pytest.fixture(scope="module")
def checkpoint(tiny_clip, tmp_path_factory):
    """The tiny model saved as safetensors, so that runs share weights (and the text cache applies)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip.model.state_dict().items()}, path)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Labels from the library for an image path, with the settings of FAST."""
    from clipseg_sparse import InferenceSettings, Segmenter, load_clip

    clip = load_clip(TINY_CONFIG, pretrained=checkpoint, device="cpu")
    settings = InferenceSettings(resolution=64, window=64, stride=32)
    seg = Segmenter(clip, CLASSES, spec="sclip", settings=settings, templates="single", cache_dir=None)
    return lambda path, probs=False: seg.predict(path).probs if probs else seg.predict(path).labels


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def rand(h, w, c=3, seed=0, dtype=np.uint8, high=255):
    shape = (h, w, c) if c > 1 else (h, w)
    return np.random.default_rng(seed).integers(0, high, shape).astype(dtype)


def make_inputs(root: Path) -> dict[str, tuple[int, int]]:
    """Images of every awkward kind plus a text file and a corrupt JPEG; returns rel stem -> (H, W) as displayed."""
    (root / "sub" / "deeper").mkdir(parents=True)
    Image.fromarray(rand(40, 56)).save(root / "rgb.jpg")
    Image.fromarray(rand(36, 48, 4, seed=1), "RGBA").save(root / "sub" / "deeper" / "rgba.png")
    sixteen = Image.fromarray(rand(32, 40, 1, seed=2, dtype=np.uint16, high=65535))
    assert sixteen.mode.startswith("I;16")
    sixteen.save(root / "sub" / "sixteen.png")
    Image.fromarray(rand(30, 44, seed=3)).convert("CMYK").save(root / "cmyk.jpg")
    Image.fromarray(rand(28, 36, seed=4)).convert("P").save(root / "pal.png")
    Image.fromarray(rand(28, 36, 1, seed=5), "L").save(root / "gray.png")
    Image.fromarray(rand(28, 36, 1, seed=6), "L").convert("LA").save(root / "la.png")
    rotated = Image.fromarray(rand(60, 40, seed=7))  # stored 40 wide x 60 high
    exif = rotated.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed: 60 wide x 40 high
    rotated.save(root / "rotated.jpg", exif=exif)
    good = (root / "rgb.jpg").read_bytes()
    (root / "corrupt.jpg").write_bytes(good[: len(good) // 3])
    (root / "readme.txt").write_text("not an image")
    return {
        "rgb": (40, 56), "sub/deeper/rgba": (36, 48), "sub/sixteen": (32, 40), "cmyk": (30, 44),
        "pal": (28, 36), "gray": (28, 36), "la": (28, 36), "rotated": (40, 60),
    }  # fmt: skip


def segment(*args, **kwargs):
    return runner.invoke(app, ["segment", *map(str, args)], env={"COLUMNS": "300"}, **kwargs)


def mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_segment_end_to_end(tmp_path, checkpoint, reference):
    images, out = tmp_path / "in", tmp_path / "out"
    sizes = make_inputs(images)
    run = ["--classes", CLASSES, "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST]
    result = segment(images, "--out", out, *run, "--save-probs")
    assert result.exit_code == 1, result.output  # the corrupt JPEG
    assert "corrupt.jpg" in result.stderr and "truncated" in result.stderr
    assert "not images" in result.stderr and "readme.txt" in result.stderr
    assert "segmented" in result.stdout and "8" in result.stdout
    assert not list(out.rglob("corrupt*")) and not list(out.rglob("readme*"))
    assert not list(out.rglob(".*"))  # no temporary files left

    fraction_sums: dict[str, float] = {}
    for rel, (height, width) in sizes.items():
        base = out / rel
        source = images / (rel + ".jpg" if (images / (rel + ".jpg")).exists() else rel + ".png")
        expected = reference(source)
        assert expected.shape == (height, width)  # EXIF rotation applied: rotated.jpg is 40 x 60
        labels = Image.open(f"{base}.png")
        assert labels.mode == "P" and np.array_equal(np.asarray(labels), expected)
        overlay = np.asarray(Image.open(f"{base}.overlay.png").convert("RGB")).astype(int)
        assert overlay.shape[0] >= height and overlay.shape[1] > width
        rgb = np.asarray(Image.open(source).convert("RGB"))
        if rel == "pal" or rel == "rgb":  # modes without alpha, EXIF or 16 bits: the blend can be recomputed here
            blend = (rgb.astype(int) + PALETTE[expected].astype(int)) / 2
            assert np.abs(overlay[:height, :width] - blend).max() <= 0.5 + 1e-9
        record = json.loads(Path(f"{base}.json").read_text())
        assert record["input"] == str(source)
        assert record["image_size"] == {"width": width, "height": height}
        assert record["class_names"] == ["cat", "dog", "sky"]
        for entry in record["classes_present"]:
            assert entry["fraction"] == pytest.approx((expected == entry["index"]).mean())
            fraction_sums[entry["name"]] = fraction_sums.get(entry["name"], 0) + entry["fraction"]
        assert {e["index"] for e in record["classes_present"]} == set(np.unique(expected).tolist())
        s = record["settings"]
        assert s["attention"] == "qq+kk/softmax"  # default preset: sclip
        assert s["classes"] == [["cat"], ["dog", "puppy"], ["sky"]]
        assert (s["resolution"], s["window"], s["stride"], s["logit_scale"]) == (64, 64, 32, 40.0)
        assert s["pretrained"] == checkpoint and s["templates"] == "single"
        assert record["files"] == {
            "labels": base.name + ".png", "overlay": base.name + ".overlay.png", "probs": base.name + ".probs.npz"
        }  # fmt: skip
        with np.load(f"{base}.probs.npz") as npz:
            assert npz["probs"].dtype == np.float16 and npz["probs"].shape == (3, height, width)
            assert list(npz["class_names"]) == ["cat", "dog", "sky"]
            assert np.allclose(npz["probs"], reference(source, probs=True), atol=1e-3)  # float16 rounding
    for name, total in fraction_sums.items():  # the summary table's mean fractions
        assert f"{name}" in result.stdout and f"{100 * total / len(sizes):.1f}%" in result.stdout


def test_rerun_skips_finished_images_and_overwrite_replaces(tmp_path, checkpoint):
    images, out = tmp_path / "in", tmp_path / "out"
    images.mkdir()
    for i in range(2):
        Image.fromarray(rand(32, 48, seed=i)).save(images / f"{i}.png")
    run = [images, "--out", out, "--classes", "a,b", "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST]
    done = segment(*run)
    assert done.exit_code == 0
    assert "text: 2 names x 1 templates" in done.stderr and "prompts/s" in done.stderr  # the text progress bar
    first = mtimes(out)
    assert len(first) == 6
    again = segment(*run, "--batch-size", "3")  # the batch size does not change predictions
    assert again.exit_code == 0, again.output
    assert "reusing the cached embeddings of 2 names x 1 templates" in again.stderr and "prompts/s" not in again.stderr
    assert mtimes(out) == first
    assert "skipped (already done)" in again.stdout and "│ 2" in again.stdout
    # a new image in the folder: only it is segmented
    Image.fromarray(rand(32, 48, seed=5)).save(images / "new.png")
    assert segment(*run).exit_code == 0
    now = mtimes(out)
    assert {k: now[k] for k in first} == first and len(now) == 9
    for path in out.iterdir():
        os.utime(path, ns=(1, 1))
    assert segment(*run, "--overwrite").exit_code == 0
    assert all(t > 1 for t in mtimes(out).values())


def test_interrupted_run_resumes(tmp_path, checkpoint, monkeypatch):
    import clipseg_sparse.files.outputs as outputs

    images, out = tmp_path / "in", tmp_path / "out"
    images.mkdir()
    for i in range(3):
        Image.fromarray(rand(32, 48, seed=i)).save(images / f"{i}.png")
    run = [images, "--out", out, "--classes", "a,b", "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST]
    real, calls = outputs.overlay_image, []

    def dies_on_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(outputs, "overlay_image", dies_on_second)
    assert segment(*run).exit_code != 0
    monkeypatch.undo()
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    done_before = mtimes(out)
    assert sorted(done_before) == ["0.json", "0.overlay.png", "0.png", "1.json", "1.png"]
    result = segment(*run)
    assert result.exit_code == 0, result.output
    after = mtimes(out)
    assert len(after) == 9
    assert {k: after[k] for k in ("0.json", "0.png", "0.overlay.png", "1.png")} == {
        k: done_before[k] for k in ("0.json", "0.png", "0.overlay.png", "1.png")
    }


def test_coco_rle_format(tmp_path, checkpoint, reference):
    from pycocotools import mask as mask_utils

    image = tmp_path / "photo.jpg"
    Image.fromarray(rand(40, 56, seed=9)).save(image)
    out = tmp_path / "out"
    result = segment(image, "--out", out, "--classes", CLASSES, "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST, "--format", "coco-rle")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["photo.json", "photo.overlay.png", "photo.rle.json"]
    data = json.loads((out / "photo.rle.json").read_text())
    expected = reference(image)
    assert (data["height"], data["width"]) == expected.shape
    decoded = np.full(expected.shape, -1)
    for ann in data["annotations"]:
        mask = mask_utils.decode(ann["segmentation"]).astype(bool)
        assert not (decoded[mask] >= 0).any()  # masks do not overlap
        decoded[mask] = ann["category_id"]
    assert np.array_equal(decoded, expected)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--classes", " , "], "empty"),
        (["--classes", "a", "--preset", "sclipp"], "did you mean"),
        (["--classes", "a", "--attn", "qq/entmax:2.5"], "alpha"),
        (["--classes", "a", "--attn", "qq/entmax:0.5"], "alpha"),
        ([], "exactly one of --classes"),
        (["--classes", "a", "--classes-file", "x.txt"], "exactly one of --classes"),
        (["--classes-file", "missing.txt"], "not found"),
        (["--classes", "a", "--format", "jpeg"], "mask format"),
        (["--classes", "a", "--bg-threshold", "0.2"], "needs --background"),
        (["--classes", "a", "--window", "64", "--stride", "100"], "stride"),
        (["--classes", "a", "--templates", "nope"], "templates"),
        (["--classes", ",".join(f"c{i}" for i in range(300))], "--format coco-rle"),
    ],
)
def test_bad_arguments_give_one_line_error_and_exit_2(tmp_path, args, message):
    image = tmp_path / "x.png"
    Image.fromarray(rand(8, 8)).save(image)
    result = segment(image, "--out", tmp_path / "out", "--model", TINY_CONFIG, "--pretrained", "none", *args)
    assert result.exit_code == 2, result.output
    assert message.lower() in result.stderr.lower()
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_input_exits_2(tmp_path):
    result = segment(tmp_path / "nothing", "--out", tmp_path / "out", "--classes", "a")
    assert result.exit_code == 2 and "no such file" in result.stderr


def test_outputs_of_other_settings_are_never_replaced(tmp_path, checkpoint):
    image, out = tmp_path / "x.png", tmp_path / "out"
    Image.fromarray(rand(32, 32)).save(image)
    base = [image, "--out", out, "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST]
    assert segment(*base, "--classes", "a,b").exit_code == 0
    before = mtimes(out)
    result = segment(*base, "--classes", "a,c")
    assert result.exit_code == 2 and "--overwrite" in result.stderr
    assert mtimes(out) == before
    (out / "x.json").unlink()  # now x.png / x.overlay.png have no record: not ours, kept
    result = segment(*base, "--classes", "a,b")
    assert result.exit_code == 2 and "no record" in result.stderr


def test_text_cache_is_used_across_runs(tmp_path, checkpoint, cache_dir, monkeypatch):
    from clipseg_sparse.models.clip import DenseCLIP

    image = tmp_path / "x.png"
    Image.fromarray(rand(32, 32)).save(image)
    run = [image, "--classes", "cat,dog|puppy", "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST]
    assert segment(*run, "--out", tmp_path / "one").exit_code == 0
    assert len(list((cache_dir / "text").glob("*.pt"))) == 1

    def no_text_encoder(self, texts, **kwargs):
        raise AssertionError("text encoder called although the embeddings are cached")

    monkeypatch.setattr(DenseCLIP, "encode_text", no_text_encoder)
    second = segment(*run, "--out", tmp_path / "two")
    assert second.exit_code == 0, second.output
    assert (tmp_path / "one" / "x.png").read_bytes() == (tmp_path / "two" / "x.png").read_bytes()


def test_random_weights_and_default_settings(tmp_path):
    image = tmp_path / "x.png"
    Image.fromarray(rand(48, 64)).save(image)
    result = segment(image, "--out", tmp_path / "out", "--classes", "a,b", "--background", "sky,wall", "--bg-threshold", "0.9", "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "x.json").read_text())
    s = record["settings"]
    assert (s["resolution"], s["window"], s["stride"], s["logit_scale"], s["batch_size"]) == (336, 224, 112, 40.0, 16)
    assert s["templates"] == "openai" and s["pretrained"] == "none" and s["bg_threshold"] == 0.9
    assert record["class_names"] == ["background", "a", "b"] and s["classes"][0] == ["sky", "wall"]
    assert not (tmp_path / "cache").exists()  # random weights are never cached


def test_outputs_cannot_escape_through_a_symlink(tmp_path, checkpoint):
    images, out, outside = tmp_path / "in", tmp_path / "out", tmp_path / "outside"
    (images / "sub").mkdir(parents=True)
    outside.mkdir()
    out.mkdir()
    Image.fromarray(rand(32, 32)).save(images / "sub" / "x.png")
    os.symlink(outside, out / "sub")
    result = segment(images, "--out", out, "--classes", "a", "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST)
    assert result.exit_code == 2 and "symlink" in result.stderr
    assert list(outside.iterdir()) == []


def test_the_class_summary_of_a_large_vocabulary_is_capped(tmp_path, checkpoint):
    from clipseg_sparse.cli.segment import SUMMARY_CLASSES

    Image.fromarray(rand(40, 56)).save(tmp_path / "a.png")
    names = [f"thing{i}" for i in range(SUMMARY_CLASSES + 15)]
    result = segment(tmp_path / "a.png", "--classes", ",".join(names), "--model", TINY_CONFIG, "--pretrained", checkpoint, *FAST, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1].strip() for line in result.stdout.split("classes over")[1].splitlines() if line.count("│") == 3]
    assert len(rows) == SUMMARY_CLASSES + 1 and rows[-1] == "... 15 more" and set(rows[:-1]) < set(names), result.stdout
