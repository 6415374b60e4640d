"""Issue 25, reliability 7: every command, run with an output it cannot write and with one malformed file of
each kind it reads, ends with one `error:` line on stderr naming the path, and exit code 2: never a
traceback, never exit 1 after its work. (Progress lines written before, e.g. the text embedding's, are
allowed; nothing else is.)

The class of bug is closed at the boundary: every command carries `cli.common.user_errors` (checked in
test_user_errors.py), outputs go through `check_out`, and library sites raise `errors.UserError` subclasses.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark
from test_common import invoke

MODEL = ["--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu"]
FAST = ["--templates", "single", "--resolution", "32", "--window", "0"]
SUBSET = Path(__file__).parents[1] / "data" / "fgovd" / "subset" / "transparency.json"
GARBAGE = b"\x00\xff\xfe not a file of this kind \x00" * 8


@pytest.fixture(autouse=True)
def quiet_root_logger(tmp_path, monkeypatch):
    """open_clip's random-weights warning goes through the root logger, whose first handler would keep the
    stderr of the first CliRunner call (a closed stream later): give the root a handler of its own."""
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])


def files(tmp: Path) -> dict[str, Path]:
    """Good inputs, then `bad_*` ones: one malformed file of each kind a command reads."""
    image = tmp / "in" / "a.png"
    image.parent.mkdir(parents=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(image)
    make_benchmark("voc21", tmp / "voc", n=2, size=(32, 32))
    make_benchmark("ade20k", tmp / "ade", n=2, size=(32, 32))
    make_benchmark("ade20k-train", tmp / "ade", n=2, size=(64, 80))
    make_benchmark("coco-stuff", tmp / "stuff", n=1, size=(32, 32))
    p = {"image": image, "voc": tmp / "voc", "ade": tmp / "ade", "stuff": tmp / "stuff", "results": tmp / "results"}
    p["results"].mkdir()
    bad = tmp / "bad"
    bad.mkdir()
    for name in ("image.png", "model.json", "weights.pt", "adapter.safetensors", "grid.toml", "transparency.json"):
        (bad / name).write_bytes(GARBAGE)
    (bad / "names.txt").write_bytes(b"\xff\xfecat\n")  # not UTF-8
    (bad / "templates.txt").write_text("a photo of a thing\n")  # no {} placeholder
    (bad / "masks").mkdir()
    np.save(bad / "masks" / "a.npy", np.zeros((32, 40), np.float32))
    (bad / "result.json").write_text('{"schema": 1, "kind": "eval", "config": ')  # torn
    p |= {f"bad_{f.stem if f.is_file() else f.name}": f for f in bad.iterdir()}
    for dataset, root in (("voc", p["voc"]), ("ade", p["ade"])):  # each dataset with one label file per split torn
        copy = tmp / f"bad_{dataset}"
        shutil.copytree(root, copy)
        for labels in ("SegmentationClass", "annotations/training", "annotations/validation"):
            for label in sorted(copy.rglob(f"{labels}/*.png"))[:1]:
                label.write_bytes(GARBAGE)
        p[f"bad_{dataset}"] = copy
    bad_stuff = tmp / "bad_stuff"
    shutil.copytree(p["stuff"], bad_stuff)
    next(bad_stuff.rglob("annotations/**/*.png")).write_bytes(GARBAGE)
    p["bad_stuff"] = bad_stuff
    imagefolder = tmp / "bad_imagefolder"
    for cls in ("cat", "dog"):
        (imagefolder / cls).mkdir(parents=True)
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(imagefolder / cls / "ok.png")
    (imagefolder / "dog" / "torn.png").write_bytes(GARBAGE)
    p["bad_imagefolder"] = imagefolder
    good_masks = tmp / "good_masks"
    good_masks.mkdir()
    np.save(good_masks / "a.npy", np.zeros((32, 40), np.int32))
    bad_bank = tmp / "bad_bank"
    bad_bank.mkdir()
    for name in ("bank.json", "manifest.json", "keys.npy", "index.faiss"):
        (bad_bank / name).write_bytes(GARBAGE)
    return p | {"good_masks": good_masks, "bad_bank": bad_bank}


SEGMENT = ["segment", "{image}", "--classes", "cat,sky", *MODEL, *FAST]
EVAL = ["eval", "--dataset", "voc21", "--root", "{voc}", *MODEL, *FAST]
FGOVD = ["fgovd", "-b", str(SUBSET), "--images", "{image}", *MODEL, *FAST, "--negatives", "2"]
ANALYZE = ["analyze", "--dataset", "ade20k", "--root", "{ade}", *MODEL, "--resolution", "32", "--window", "0"]
EXPLAIN = ["explain", "{image}", "--point", "1,1", "--classes", "cat,sky", *MODEL, "--templates", "single", "--resolution", "32"]
DNA = ["dna", "train", "--root", "{ade}", "--dataset", "ade20k", *MODEL, "--steps", "1", "--batch-size", "2", "--resolution", "32", "--templates", "single"]

# (command, what is bad) -> (arguments, the path the one error line must name). OUT: an output under a
# regular file (`blocker/out`), so nothing can be written there.
CASES = {
    ("segment", "output"): ([*SEGMENT, "--out", "OUT"], "OUT"),
    ("segment", "class-names file"): (["segment", "{image}", "--classes-file", "{bad_names}", *MODEL, *FAST, "--out", "{tmp}/o"], "{bad_names}"),
    ("segment", "templates file"): ([*SEGMENT[:-6], "--resolution", "32", "--templates", "{bad_templates}", "--out", "{tmp}/o"], "{bad_templates}"),
    ("segment", "model config"): (["segment", "{image}", "--classes", "a,b", "--model", "{bad_model}", "--pretrained", "none", "--out", "{tmp}/o"], "{bad_model}"),
    ("segment", "checkpoint"): (["segment", "{image}", "--classes", "a,b", "--model", TINY_CONFIG, "--pretrained", "{bad_weights}", "--out", "{tmp}/o"], "{bad_weights}"),
    ("segment", "region masks"): ([*SEGMENT, "--attn", "qk[region:0.5]/softmax", "--regions", "{bad_masks}", "--out", "{tmp}/o"], "{bad_masks}/a.npy"),
    ("eval", "output"): ([*EVAL, "--out", "OUT"], "OUT"),
    ("eval", "label file"): (["eval", "--dataset", "voc21", "--root", "{bad_voc}", *MODEL, *FAST], "{bad_voc}"),
    ("eval", "class-names file"): ([*EVAL, "--class-names", "{bad_names}"], "{bad_names}"),
    ("fgovd", "output"): ([*FGOVD, "--out", "OUT"], "OUT"),
    ("fgovd", "benchmark file"): (["fgovd", "-b", "{bad_transparency}", "--images", "{image}", *MODEL, *FAST], "{bad_transparency}"),
    ("sweep", "output"): (["sweep", "--models", TINY_CONFIG, "--pretrained", "none", "--datasets", "voc21", "--root", "{voc}", "--out", "OUT"], "OUT"),
    ("sweep", "grid file"): (["sweep", "--grid", "{bad_grid}", "--out", "{tmp}/sw"], "{bad_grid}"),
    ("reproduce", "grid file"): (["reproduce", "{bad_grid}", "--out", "{tmp}/rp"], "{bad_grid}"),
    ("report", "output"): (["report", "{results}", "--csv", "OUT"], "OUT"),
    ("report", "result file"): (["report", "{bad_result}"], "{bad_result}"),
    ("analyze", "output"): ([*ANALYZE, "--out", "OUT"], "OUT"),
    ("analyze", "label file"): (["analyze", "--dataset", "ade20k", "--root", "{bad_ade}", *MODEL, "--resolution", "32", "--window", "0"], "{bad_ade}"),
    ("explain", "output"): ([*EXPLAIN, "--out", "OUT.png"], "OUT"),
    ("explain", "image"): (["explain", "{bad_image}", *EXPLAIN[2:], "--out", "{tmp}/e.png"], "{bad_image}"),
    ("explain", "region masks"): ([*EXPLAIN, "--attn", "qk[region:0.5]/softmax", "--regions", "{bad_masks}", "--out", "{tmp}/e.png"], "{bad_masks}/a.npy"),
    ("dna train", "output"): ([*DNA, "--out", "OUT"], "OUT"),
    ("dna train", "label file"): (["dna", "train", "--root", "{bad_ade}", *DNA[4:], "--out", "{tmp}/dna"], "{bad_ade}"),
    ("dna train", "image"): (["dna", "train", "--objective", "image", "--root", "{bad_imagefolder}", *MODEL, "--steps", "1", "--batch-size", "4",
                              "--resolution", "32", "--templates", "single", "--out", "{tmp}/dna2"], "{bad_imagefolder}/dog/torn.png"),  # fmt: skip
    ("dna stats", "output"): (["dna", "stats", "{bad_adapter}", *MODEL, "--out", "OUT.json"], "OUT"),
    ("dna stats", "adapter"): (["dna", "stats", "{bad_adapter}", *MODEL], "{bad_adapter}"),
    ("bank build", "output"): (["bank", "build", "{image}", "--regions", "{good_masks}", *MODEL, "--out", "OUT"], "OUT"),
    ("bank build", "region masks"): (["bank", "build", "{image}", "--regions", "{bad_masks}", *MODEL, "--out", "{tmp}/bank"], "{bad_masks}/a.npy"),
    ("bank info", "bank folder"): (["bank", "info", "{bad_bank}"], "{bad_bank}"),
    ("floss rank", "output"): (["floss", "rank", "{image}", "--classes", "cat,sky", *MODEL, *FAST[2:], "--out", "OUT.json"], "OUT"),
    ("floss rank", "class-names file"): (["floss", "rank", "{image}", "--classes-file", "{bad_names}", *MODEL, *FAST[2:]], "{bad_names}"),
    ("calibrate", "output"): (["calibrate", "{image}", "--classes", "cat,sky", "--proxy-weights", "sam3=none", "--out", "OUT.npz"], "OUT"),
    ("convert", "output"): (["convert", "coco-stuff", "{stuff}", "--out", "OUT"], "OUT"),
    ("convert", "label file"): (["convert", "coco-stuff", "{bad_stuff}", "--out", "{tmp}/conv"], "{bad_stuff}"),
}


def test_every_command_that_reads_or_writes_files_is_here():
    from test_errors import COMMANDS

    no_files = {"ls", "bench", "demo"}  # they read and write no files of the user's
    assert {command.split(" ")[0] if command.startswith("convert") else command for command in COMMANDS} - no_files == {c for c, _ in CASES}


@pytest.mark.parametrize("command,bad", list(CASES))
def test_one_line_and_exit_2(command, bad, tmp_path):
    paths = {k: str(v) for k, v in files(tmp_path).items()} | {"tmp": str(tmp_path)}
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    line, names = CASES[command, bad]
    args = [a.replace("OUT", str(blocker / "out")).format(**paths) for a in line]
    result = invoke(*args)
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:], result.exception)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("error:"), result.stderr[-3000:]
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in lines[:-1]), result.stderr[-3000:]  # progress lines only
    named = names.replace("OUT", str(blocker / "out")).format(**paths)
    assert named in lines[-1] or (named == str(blocker / "out") and str(blocker) in lines[-1]), lines[-1]


# command -> (arguments, the end of the path whose write meets a full disk)
DISK_FULL = {
    "segment": ([*SEGMENT, "--out", "{tmp}/seg"], "a.png"),
    "eval": ([*EVAL, "--out", "{tmp}/voc.json"], "voc.json"),
    "analyze": ([*ANALYZE, "--out", "{tmp}/analysis"], ".json"),
    "explain": ([*EXPLAIN, "--out", "{tmp}/e.png"], "e.png"),
    "report --html": (["report", "{tmp}/seg", "--html", "{tmp}/g.html"], "g.html"),
}  # bank build: tests/segment/test_bank.py (it needs the tiny backbones installed there)


@pytest.mark.parametrize("command", list(DISK_FULL))
def test_a_full_disk_is_one_line_naming_the_file_and_exit_1_and_the_same_command_then_finishes(command, tmp_path, monkeypatch):
    """Issue 35, reliability 10: ENOSPC from a write (which names no file) ends the command with one `error:` line
    naming the file and "no space left", exit 1; run again with space, the command finishes."""
    paths = {k: str(v) for k, v in files(tmp_path).items()} | {"tmp": str(tmp_path)}
    if command == "report --html":
        assert invoke(*[a.format(**paths) for a in DISK_FULL["segment"][0]]).exit_code == 0
    line, end = DISK_FULL[command]
    args = [a.format(**paths) for a in line]
    replace, full = Path.replace, []

    def disk_full(self, target):
        if str(target).endswith(end):
            full.append(str(target))
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", disk_full)
    result = invoke(*args)
    assert result.exit_code == 1, (result.output[-2000:], result.exception)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("error:"), result.stderr[-3000:]
    assert f"{full[0]}: no space left" in lines[-1], lines[-1]
    monkeypatch.setattr(Path, "replace", replace)
    again = invoke(*args)
    assert again.exit_code == 0, again.output[-2000:]
