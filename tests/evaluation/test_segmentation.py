import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.datasets import DATASETS
from clipseg_sparse.evaluation.segmentation import evaluate, prediction_path
from clipseg_sparse.files.results import progress_path
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.evaluation.metrics import intersect_and_union, segmentation_metrics
from clipseg_sparse.files.results import ConfigMismatchError
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark

ADE_ROOT = Path(__file__).parents[1] / "data" / "ade20k"
FAST = dict(resolution=64, window=32, stride=16)  # small inputs for the tiny model


def run(clip, dataset, root, **kw):
    kw.setdefault("overrides", FAST)
    return evaluate(clip, dataset, root, "sclip", templates="single", progress=False, **kw)


@pytest.mark.parametrize("dataset, n", [("voc20", 3), ("voc21", 3), ("ade20k", 2)])
def test_reported_miou_equals_the_one_recomputed_from_saved_predictions(tiny_clip, tmp_path, dataset, n):
    root = ADE_ROOT if dataset == "ade20k" else tmp_path / "data"
    if dataset != "ade20k":
        make_benchmark(dataset, root, n=n)
    preds = tmp_path / "pred"
    record = run(tiny_clip, dataset, root, save_pred=preds, limit=n)
    bench = DATASETS.get(dataset)
    total = 0
    for sample in bench.samples(root)[:n]:
        saved = prediction_path(preds, sample)
        assert Image.open(saved).mode == "P"
        # saved in the dataset's label encoding, so the label reader decodes it back to classes
        total = total + intersect_and_union(bench.load_label(saved), bench.load_label(sample.label), bench.num_classes)
    m = segmentation_metrics(total)
    assert record["num_images"] == n
    assert record["metrics"]["mIoU"] == pytest.approx(100 * m["mIoU"])
    assert record["metrics"]["aAcc"] == pytest.approx(100 * m["aAcc"])
    ious = [v["IoU"] for v in record["per_class"].values()]
    np.testing.assert_allclose([np.nan if v is None else v for v in ious], 100 * m["IoU"])


def test_result_record_schema_and_config(tiny_clip, tmp_path):
    make_benchmark("voc21", tmp_path, n=2)
    out = tmp_path / "res" / "voc21.json"
    record = run(tiny_clip, "voc21", tmp_path, out=out)
    assert json.loads(out.read_text()) == record
    assert record["schema"] == 1 and record["kind"] == "eval" and record["num_images"] == 2
    c = record["config"]
    for key in ("model", "pretrained", "precision", "quick_gelu", "attention", "dataset", "root", "protocol", "class_names",
                "class_names_version", "resolution", "max_long_side", "window", "stride", "logit_scale",
                "bg_threshold", "area_threshold", "batch_size", "templates", "limit"):
        assert key in c, key
    assert (c["attention"], c["dataset"], c["protocol"], c["class_names"]) == ("qq+kk/softmax", "voc21", "sclip", "sclip")
    assert (c["logit_scale"], c["bg_threshold"], c["area_threshold"], c["resolution"]) == (65.0, 0.1, 0.1, 64)
    assert set(record["metrics"]) == {"mIoU", "mAcc", "aAcc"} and len(record["per_class"]) == 21
    assert record["timing"]["wall_s"] > 0 and record["timing"]["images_per_s"] > 0
    assert "torch" in record["versions"]


def test_interrupted_run_resumes_to_the_uninterrupted_result(tiny_clip, tmp_path, monkeypatch):
    make_benchmark("context60", tmp_path / "data", n=5)
    reference = run(tiny_clip, "context60", tmp_path / "data", out=tmp_path / "full.json")

    out = tmp_path / "interrupted.json"
    real = Segmenter.predict_labels
    calls = []

    def crash_after_two(self, image, name=None):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt  # what a Ctrl-C or a kill mid-run looks like to the loop
        return real(self, image, name)

    monkeypatch.setattr(Segmenter, "predict_labels", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_clip, "context60", tmp_path / "data", out=out)
    assert not out.exists()
    log = progress_path(out)
    assert len(log.read_text().splitlines()) == 1 + 2  # header + two finished images
    with log.open("a") as f:
        f.write('{"id": "2008_000002", "areas": {"0": [1, ')  # a line torn by the kill

    calls.clear()
    monkeypatch.setattr(Segmenter, "predict_labels", lambda self, image, name=None: (calls.append(1), real(self, image, name))[1])
    resumed = run(tiny_clip, "context60", tmp_path / "data", out=out)
    assert len(calls) == 3  # only the images not in the log were segmented
    assert resumed["timing"]["resumed_images"] == 2
    assert resumed["metrics"] == reference["metrics"]
    assert resumed["per_class"] == reference["per_class"]


def test_finished_result_is_not_recomputed_unless_overwritten(tiny_clip, tmp_path, monkeypatch):
    make_benchmark("coco-object", tmp_path, n=2)
    out = tmp_path / "r.json"
    first = run(tiny_clip, "coco-object", tmp_path, out=out)

    def boom(self, image, name=None):
        raise AssertionError("recomputed")

    monkeypatch.setattr(Segmenter, "predict_labels", boom)
    assert run(tiny_clip, "coco-object", tmp_path, out=out) == first
    with pytest.raises(ConfigMismatchError, match="different configuration"):
        run(tiny_clip, "coco-object", tmp_path, out=out, overrides={**FAST, "logit_scale": 10.0})
    with pytest.raises(AssertionError, match="recomputed"):
        run(tiny_clip, "coco-object", tmp_path, out=out, overwrite=True)


def test_protocol_pairings_and_background_guard(tiny_clip, tmp_path):
    make_benchmark("voc21", tmp_path, n=1)
    record = evaluate(tiny_clip, "voc21", tmp_path, protocol="clearclip", class_names=None, overrides={"resolution": 64},
                      templates="single", progress=False)
    c = record["config"]
    assert (c["attention"], c["class_names"], c["window"], c["stride"], c["logit_scale"], c["bg_threshold"]) == (
        "qq/softmax/nores/noffn", "plain", 448, 224, 50.0, 0.5)
    with pytest.raises(ValueError, match="no background class"):
        run(tiny_clip, "voc20", tmp_path, overrides={**FAST, "bg_threshold": 0.2})


def test_cli_eval_prints_table_writes_result_and_fails_cleanly(tmp_path):
    runner = CliRunner()
    make_benchmark("cityscapes", tmp_path / "cs", n=2)
    out = tmp_path / "cs.json"
    args = ["eval", "--dataset", "cityscapes", "--root", str(tmp_path / "cs"), "--model", TINY_CONFIG, "--pretrained", "none",
            "--templates", "single", "--resolution", "64", "--window", "32", "--stride", "16", "--out", str(out),
            "--save-pred", str(tmp_path / "pred")]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert "traffic light" in result.output and f"{record['metrics']['mIoU']:.2f}" in result.output
    assert len(list((tmp_path / "pred" / "lindau").glob("*.png"))) == 2
    assert "text: 19 names x 1 templates" in result.stderr and "prompts/s" in result.stderr
    again = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert again.exit_code == 0 and "not recomputing" in again.output
    assert json.loads(out.read_text()) == record
    bad = runner.invoke(app, ["eval", "--dataset", "ade20k", "--root", str(tmp_path / "nowhere")], env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "ADEChallengeData2016/images/validation not found" in bad.output and "datasets.md" in bad.output
    typo = runner.invoke(app, ["eval", "--dataset", "voc", "--root", str(tmp_path)], env={"COLUMNS": "200"})
    assert typo.exit_code == 2 and "Did you mean" in typo.output


def test_cli_ls_datasets_and_protocols():
    runner = CliRunner()
    datasets = runner.invoke(app, ["ls", "datasets"], env={"COLUMNS": "250"})
    assert datasets.exit_code == 0 and all(name in datasets.output for name in DATASETS)
    assert "1449" in datasets.output and "5105" in datasets.output
    protocols = runner.invoke(app, ["ls", "protocols"], env={"COLUMNS": "250"})
    assert protocols.exit_code == 0 and all(name in protocols.output for name in ("sclip", "clearclip", "naclip"))


def test_cli_convert_coco_object(tmp_path):
    src = tmp_path / "annotations" / "val2017"
    src.mkdir(parents=True)
    Image.fromarray(np.array([[0, 91, 255]], dtype=np.uint8)).save(src / "000000000001.png")
    result = CliRunner().invoke(app, ["convert", "coco-object", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert np.array(Image.open(src / "000000000001_instanceTrainIds.png")).tolist() == [[1, 0, 0]]
    missing = CliRunner().invoke(app, ["convert", "coco-stuff", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "datasets.md" in missing.output
