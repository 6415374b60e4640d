"""One-line errors instead of tracebacks, checked before any model loads where possible (issue 15, findings 5 and 10)."""

import json
import os
from pathlib import Path

import pytest

from clipseg_sparse.evaluation.fgovd import BenchmarkFormatError, evaluate_fgovd, read_benchmark
from clipseg_sparse.segment.settings import InferenceSettings
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark
from test_common import assert_one_line_error, cache_dir, image, invoke  # noqa: F401 - fixtures

TINY = ["--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--device", "cpu"]
SUBSET = Path(__file__).parents[1] / "data" / "fgovd" / "subset" / "transparency.json"


def test_unwritable_out_and_save_pred_fail_before_the_model_is_loaded(image, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    no_model = ["--model", "no-such-model"]  # loading it would fail with another message
    result = invoke("segment", image, "--classes", "a", "--out", blocker / "masks", *no_model)
    assert_one_line_error(result, f"--out {blocker / 'masks'}", f"{blocker} is a file")
    make_benchmark("voc21", tmp_path / "data", n=1, size=(32, 32))
    voc = ["eval", "--dataset", "voc21", "--root", tmp_path / "data", *no_model]
    assert_one_line_error(invoke(*voc, "--out", blocker / "r.json"), "--out", "is a file")
    assert_one_line_error(invoke(*voc, "--save-pred", blocker / "pred"), "--save-pred", "is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_folder_fails_before_the_model_is_loaded(image, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = invoke("segment", image, "--classes", "a", "--out", locked / "masks", "--model", "no-such-model")
        assert_one_line_error(result, "cannot write in", str(locked))
    finally:
        locked.chmod(0o700)


def test_spec_deeper_than_the_model(image, tmp_path):
    result = invoke("segment", image, "--classes", "a,b", "--out", tmp_path / "o", *TINY, "--attn", "qq/softmax/layers:99")
    assert_one_line_error(result, "layers", "99", "has 3")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("model, says", [("RN50", "ResNet"), ("RN50x4", "ResNet")])
def test_resnet_towers_are_refused_by_name(image, tmp_path, model, says):
    result = invoke("segment", image, "--classes", "a", "--out", tmp_path / "o", "--model", model, "--pretrained", "none")
    assert_one_line_error(result, repr(model), says)


def test_model_json_that_is_not_a_model_config(image, tmp_path):
    config = tmp_path / "novision.json"
    config.write_text(json.dumps({"embed_dim": 8, "text_cfg": {}}))
    result = invoke("segment", image, "--classes", "a", "--out", tmp_path / "o", "--model", config, "--pretrained", "none")
    assert_one_line_error(result, str(config), "'vision_cfg'")


def test_garbage_checkpoint_says_it_is_not_a_weights_file(image, tmp_path):
    garbage = tmp_path / "weights.pt"
    garbage.write_bytes(b"this is not a checkpoint at all" * 50)
    result = invoke("segment", image, "--classes", "a", "--out", tmp_path / "o", "--model", TINY_CONFIG, "--pretrained", garbage)
    assert_one_line_error(result, str(garbage), "not a weights file")
    assert "weights_only" not in result.stderr


@pytest.mark.parametrize("template", ["a {} of {}", "a {0} photo", "a {name}", "a {} }"])
def test_template_that_is_not_one_placeholder(image, tmp_path, template):
    file = tmp_path / "t.txt"
    file.write_text(f"a photo of a {{}}.\n{template}\n")
    result = invoke("segment", image, "--classes", "a", "--out", tmp_path / "o", *TINY[:4], "--templates", file)
    assert_one_line_error(result, "exactly one '{}'", str(file))


def _benchmark(tmp_path, edit) -> Path:
    data = json.loads(SUBSET.read_text())
    edit(data)
    path = tmp_path / "b" / "transparency.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_fgovd_mask_region_with_a_string_segmentation(tiny_clip, tmp_path):
    path = _benchmark(tmp_path, lambda d: d["annotations"][2].update(segmentation="not a polygon"))
    with pytest.raises(BenchmarkFormatError, match="annotation id 114 .*'segmentation' must be a list of polygons"):
        evaluate_fgovd(tiny_clip, [path], tmp_path, "clip", region="mask", settings=InferenceSettings(resolution=64), progress=False)
    result = invoke("fgovd", "-b", path, "--images", tmp_path, *TINY[:4], "--region", "mask")
    assert_one_line_error(result, "'segmentation' must be a list of polygons")


@pytest.mark.parametrize("bbox", [[1.0, 2.0, float("nan"), 5.0], [1.0, 2.0, 3.0], [1.0, float("inf"), 3.0, 4.0]])
def test_fgovd_bbox_message_has_the_count_and_refuses_nan(tmp_path, bbox):
    path = _benchmark(tmp_path, lambda d: d["annotations"][1].update(bbox=bbox))  # json writes NaN / Infinity
    with pytest.raises(BenchmarkFormatError, match=r"field 'bbox' must be 4 finite numbers \[x, y, w, h\]"):
        read_benchmark(path)
    result = invoke("fgovd", "-b", path, "--images", tmp_path, *TINY[:4])
    assert_one_line_error(result, "'bbox' must be 4 finite numbers [x, y, w, h]")


def test_help_shows_no_value_type_for_flags():
    """`--overwrite <bool>` in --help read as if it took a value; users then wrote `--overwrite true`."""
    for command in (["segment"], ["eval"], ["reproduce"], ["report"], []):
        result = invoke(*command, "--help")
        assert result.exit_code == 0
        assert "<bool>" not in result.output, command
    segment_help = invoke("segment", "--help").output
    assert "--overwrite" in segment_help and "--save-probs" in segment_help and "<int>" in segment_help


def test_reproduce_help_names_the_report_table():
    result = invoke("reproduce", "--help")
    assert result.exit_code == 0 and "[report] table" in result.output


def test_empty_voc_split_file_says_the_split_file_is_empty(tmp_path):
    make_benchmark("voc21", tmp_path / "data", n=2, size=(32, 32))
    [split] = list((tmp_path / "data").rglob("val.txt"))
    split.write_text("\n")
    result = invoke("eval", "--dataset", "voc21", "--root", tmp_path / "data", "--model", "no-such-model")
    assert_one_line_error(result, f"split file {split} lists no image ids")
    assert "no images ending in" not in result.stderr


def test_entmax_alpha_one_says_it_is_softmax(image, tmp_path):
    result = invoke("segment", image, "--classes", "a,b", "--out", tmp_path / "o", *TINY, "--resolution", "32", "--attn", "qk/entmax:1")
    assert result.exit_code == 0, result.output
    assert "entmax:1 is softmax" in result.stderr
    assert json.loads((tmp_path / "o" / "x.json").read_text())["settings"]["attention"] == "qk/softmax"
    quiet = invoke("segment", image, "--classes", "a,b", "--out", tmp_path / "o2", *TINY, "--resolution", "32", "--attn", "qk/entmax:1.5")
    assert quiet.exit_code == 0 and "is softmax" not in quiet.stderr


def test_offline_with_an_empty_cache_fails_in_seconds(tmp_path):
    """Issue 15 finding 11: without HF_HUB_OFFLINE, huggingface_hub retried for ~51 s before our message.
    The sandbox has no network, so this measures the real path; where the Hub host resolves, an endpoint
    on a closed local port stands in for it, so the test never downloads."""
    import socket
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    try:
        socket.getaddrinfo("huggingface.co", 443)
        env["HF_ENDPOINT"] = "https://127.0.0.1:9"
    except OSError:
        pass
    script = (
        "import time\nimport huggingface_hub, open_clip\nfrom clipseg_sparse.models.clip import WeightsUnavailableError, load_clip\n"
        "start = time.perf_counter()\n"
        "try:\n    load_clip('ViT-B-16', 'openai', device='cpu')\nexcept WeightsUnavailableError as e:\n"
        "    print(f'{time.perf_counter() - start:.2f}', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    seconds, message = run.stdout.split(" ", 1)
    assert float(seconds) < 10, run.stdout  # the load itself, imports excluded (it took 51-56 s)
    assert "unreachable" in message and "could not obtain weights 'openai' for ViT-B-16" in message
