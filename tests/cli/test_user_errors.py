"""The CLI boundary catches only `UserError` (issue 30 item 5): every bad input that reaches attention/, segment/,
models/, stages or explain still ends as one `error:` line and exit 2, because those folders raise UserErrors
for what a user can fix; and every registered stage, spec option and tap refuses a bad argument with one."""

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.errors import UserError
from conftest import TINY_CONFIG


def _cli_cases(tmp: Path, image: Path) -> dict[str, tuple[list, str, bool]]:
    """case -> (CLI arguments, a fragment of its one error line, whether the model loads before the error);
    `tmp` holds the image, `empty.txt` and `list.json` (written by the test)."""
    tiny = ["--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--device", "cpu"]

    def segment(*extra, classes="a,b"):
        return ["segment", image, "--classes", classes, "--out", tmp / "out", *tiny, *extra]

    return {
        "attention: normalizer alpha": (segment("--attn", "qq/entmax:3"), "alpha must be in (1, 2]", False),
        "attention: unknown source": (segment("--attn", "zz/softmax"), "unknown attention source 'zz'", False),
        "attention: unknown tap": (segment("--attn", "zz@3/softmax"), "unknown tap 'zz@3'", False),
        "attention: term modifier": (segment("--attn", "qq[topk:0]/softmax"), "topk needs an integer >= 1", False),
        "attention: option value": (segment("--attn", "qq/softmax/gauss:abc"), "bad option 'gauss:abc'", False),
        "attention: registered option": (segment("--attn", "qq/softmax/stitch:0"), "stitch:0", False),
        "attention: tap argument": (segment("--attn", "x@0/softmax"), "x@L needs a block number", False),
        "attention: block input": (segment("--attn", "qq/softmax/in:sum@3-1"), "need 1 <= A <= B", False),
        "attention: feedback without gauss": (segment("--attn", "kk+feedback:0.3/softmax"), "add gauss:SIGMA", True),
        "stages: stage argument": (segment("--attn", "qq/softmax/hook:pamr:x"), "bad stage 'pamr:x'", False),
        "stages: no-argument stage": (segment("--attn", "qq/softmax/hook:surgery:1"), "surgery takes no arguments", False),
        "stages: unknown hook": (segment("--attn", "qq/softmax/hook:nope"), "unknown hook 'nope'", False),
        "segment: settings value": (segment("--stride", "500"), "stride must be in (0, window]", False),
        "segment: templates": (segment("--templates", "nosuch"), "templates 'nosuch'", False),
        "segment: empty class-names file": (["segment", image, "--classes-file", tmp / "empty.txt", "--out", tmp / "out", *tiny],
                                            f"{tmp / 'empty.txt'}: class-names file is empty", False),
        "segment: duplicate class": (segment(classes="a,a"), "duplicate class name", False),
        "segment: prompt file": (segment("--prompts", tmp / "list.json"), f"{tmp / 'list.json'}: a prompt file is a JSON object", False),
        "segment: preset needing regions": (segment("--preset", "corrclip"), "needs region masks", False),
        "models: unknown model": (["segment", image, "--classes", "a", "--out", tmp / "out", "--model", "no-such-model"], "unknown model 'no-such-model'", False),
        "models: unknown tag": (["segment", image, "--classes", "a", "--out", tmp / "out", "--pretrained", "nosuchtag"], "unknown pretrained tag 'nosuchtag'", False),
        "models: unsupported family": (["segment", image, "--classes", "a", "--out", tmp / "out", "--model", "RN50", "--pretrained", "none"], "is not supported", False),
        "models: ext feature": (segment("--attn", "ext:dino_vitb16.bogus/softmax/cls:0"), "unknown feature 'bogus'", False),
        "models: ext mask backbone": (segment("--attn", "ext:sam2_hiera_l/softmax/cls:0"), "makes region masks, not features", False),
        "models: spec deeper than the model": (segment("--attn", "qq/softmax/layers:99"), "the model has 3", True),
        "models: backbone weights": (segment("--preset", "proxyclip", "--proxy-weights", "bogus"), "backbone weights must be", True),
        "analysis: point outside the image": (["explain", image, "--point", "99,99", "--classes", "a,b", "--out", tmp / "e.png", *tiny], "outside the 32 x 32 image", True),
    }


CLI_CASES = sorted(_cli_cases(Path("/t"), Path("/t/x.png")))


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_input_through_the_cli_is_one_line_and_exit_2(case, tmp_path, monkeypatch):
    """With the boundary catching only UserError, each of these library errors reaches the user as one
    `error:` line naming the problem, exit 2, no traceback; before the model loads where it can be
    checked then, the whole of stderr is that line."""
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    # open_clip's random-weights warning goes to the root logger, whose handler may hold an earlier call's closed stderr
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    image = tmp_path / "in" / "x.png"
    image.parent.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(image)
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    args, fragment, after_model = _cli_cases(tmp_path, image)[case]
    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:] and fragment in lines[-1], result.stderr
    if not after_model:
        assert len(lines) == 1, result.stderr


def _refusals():
    """(registry, name, check) of every registered stage, spec option and tap: what each does with a bad argument."""
    import clipseg_sparse.methods  # noqa: F401 - the methods' stages and options register on import
    from clipseg_sparse.attention.spec import OPTIONS
    from clipseg_sparse.attention.taps import TAPS
    from clipseg_sparse.stages import STAGES

    out = [("stage", n, lambda n=n: STAGES.get(n)("bogus:x")) for n in STAGES.names()]
    out += [("option", n, lambda n=n: OPTIONS.get(n).check("bogus")) for n in OPTIONS.names()]
    out += [("tap", n, lambda n=n: TAPS.get(n).check("bogus")) for n in TAPS.names() if TAPS.get(n).check]
    return {f"{kind} {name}": check for kind, name, check in out}


REFUSALS = _refusals()


def test_the_refusals_cover_every_registry():
    kinds = {case.partition(" ")[0] for case in REFUSALS}
    assert kinds == {"stage", "option", "tap"} and len(REFUSALS) >= 20, sorted(REFUSALS)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_every_registered_stage_option_and_tap_refuses_a_bad_argument_as_a_user_error(case):
    """A stage, spec option or tap registered later (in its method's file) must refuse a bad argument with a
    UserError too, or the CLI would show the user's typo as a traceback."""
    with pytest.raises(UserError):
        REFUSALS[case]()
