"""Per-class description prompts (`--prompts FILE`, OV-Stitcher's class_biased_template.json format): the
average against a hand computation, bad files, and what result files and report tables record."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark
from test_report import write_result
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.vocabulary import Prompts, embed_names
from clipseg_sparse.sweeps.grid import Grid
from clipseg_sparse.sweeps.records import collect, split_groups, title_of

TEMPLATES = ("a photo of a {}.", "{} in the wild")
SENTENCES = {"cat": ["a small furry pet with whiskers.", "it sleeps on the sofa."], "bird": ["feathers."]}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "class_biased_template.json"
    path.write_text(json.dumps(SENTENCES))
    return path


def test_prompt_sentences_join_the_template_average(tiny_clip, prompt_file):
    got = embed_names(tiny_clip, ["cat", "dog"], TEMPLATES, use_cache=False, prompts=prompt_file)
    one = lambda text: tiny_clip.encode_text([text])[0]  # noqa: E731  (L2-normalised, one prompt at a time)
    cat = [one("a photo of a cat."), one("cat in the wild"), one("a small furry pet with whiskers."), one("it sleeps on the sofa.")]
    dog = [one("a photo of a dog."), one("dog in the wild")]
    by_hand = torch.stack([sum(cat) / 4, sum(dog) / 2])
    by_hand = by_hand / by_hand.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-6)
    plain = embed_names(tiny_clip, ["cat", "dog"], TEMPLATES, use_cache=False)
    torch.testing.assert_close(got[1], plain[1], rtol=0, atol=1e-6)  # a name the file lacks: templates only
    assert (got[0] - plain[0]).abs().max() > 1e-3


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a JSON prompt file"),
    ('["a", "b"]', "a prompt file is a JSON object"),
    ('{"cat": "one sentence"}', "class 'cat': expected a list of non-empty sentences"),
    ('{"cat": ["ok", 3]}', "class 'cat': expected a list"),
])  # fmt: skip
def test_a_bad_prompt_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        Prompts.read(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read the prompt file"):
        Prompts.read(tmp_path / "missing.json")


def test_segment_and_eval_record_the_prompt_file(tiny_clip, prompt_file, tmp_path):
    from clipseg_sparse.cli.app import app

    seg = Segmenter(tiny_clip, "cat,dog", spec="sclip", templates=TEMPLATES, prompts=prompt_file)
    assert seg.config()["prompts"] == {"file": prompt_file.name, "sha256": Prompts.read(prompt_file).sha256}
    assert "prompts" not in Segmenter(tiny_clip, "cat,dog", spec="sclip", templates=TEMPLATES).config()
    (tmp_path / "img").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "img" / "a.png")
    args = ["segment", str(tmp_path / "img"), "--classes", "cat,dog", "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu",
            "--templates", "single", "--resolution", "0", "--window", "0", "--out", str(tmp_path / "out")]  # fmt: skip
    res = CliRunner().invoke(app, [*args, "--prompts", str(prompt_file)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / "a.json").read_text())["settings"]["prompts"]["file"] == prompt_file.name
    (tmp_path / "bad.json").write_text("[1]")
    make_benchmark("voc21", tmp_path / "voc", n=1)
    for command in (args, ["eval", "--dataset", "voc21", "--root", str(tmp_path / "voc"), "--model", TINY_CONFIG, "--pretrained", "none"]):
        res = CliRunner().invoke(app, [*command, "--prompts", str(tmp_path / "bad.json")], env={"COLUMNS": "300"})
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and f"{tmp_path / 'bad.json'}: a prompt file is a JSON object" in lines[0], res.output


def test_sweep_cells_and_report_rows_name_the_prompt_file(prompt_file, tmp_path):
    base = dict(models=[TINY_CONFIG], pretrained="none", datasets=["voc21"], presets=["sclip"])
    plain, with_prompts = Grid(**base).cells()[0], Grid(**base, prompts=str(prompt_file)).cells()[0]
    assert "prompts" not in plain.config() and with_prompts.config()["prompts"]["file"] == prompt_file.name
    assert plain.hash != with_prompts.hash
    with pytest.raises(ValueError, match="cannot read the prompt file"):
        Grid(**base, prompts=str(tmp_path / "missing.json"))
    config = {"model": "ViT-B-16", "dataset": "voc21", "attention": "qk/softmax", "protocol": "ovstitcher"}
    write_result(tmp_path / "r" / "a.json", "eval", config, {"mIoU": 1.0})
    write_result(tmp_path / "r" / "b.json", "eval", {**config, "prompts": {"file": "cbt.json", "sha256": "0123456789abcdef"}}, {"mIoU": 2.0})
    titles = sorted(title_of(group) for group, _ in split_groups(collect([tmp_path / "r"]), ["dataset"]))
    assert titles == ["prompts=-", "prompts=cbt.json@01234567"]


def test_a_prompt_file_that_names_no_class_is_refused_in_one_line(tiny_clip, prompt_file, tmp_path):
    with pytest.raises(ValueError, match=r"class_biased_template.json: none of its names \(cat, bird\) is a class name here \(sky, road\)"):
        embed_names(tiny_clip, ["sky", "road"], TEMPLATES, use_cache=False, prompts=prompt_file)
    from clipseg_sparse.cli.app import app

    (tmp_path / "img").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "img" / "a.png")
    res = CliRunner().invoke(app, ["segment", str(tmp_path / "img"), "--classes", "sky,road", "--model", TINY_CONFIG, "--pretrained", "none",
                                   "--device", "cpu", "--templates", "single", "--resolution", "0", "--window", "0", "--prompts", str(prompt_file),
                                   "--out", str(tmp_path / "out")], env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-1].startswith(f"error: {prompt_file}: none of its names"), res.output
    assert not (tmp_path / "out" / "a.json").exists()
