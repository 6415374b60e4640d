"""Options and helpers shared by the commands, and the CLI's one error boundary (`user_errors`).

The library owns defaults: an option left unset on the command line is None here and is dropped
before the library is called, so precedence is command line > preset/protocol > library default.
"""

from __future__ import annotations

import errno
import functools
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, NoReturn, Optional, Sequence, TypeVar

import typer

from ..errors import UserError
from ..runtime.progress import err_console

Command = TypeVar("Command", bound=Callable)


def flags_show_no_value_type() -> None:
    """typer (0.2x) prints `<bool>` after every flag in --help, as if it took a value, and users then
    write `--overwrite true` ("true: no such file"). A flag takes no value: show no type for it.

    A patch of typer's option class (help is drawn per option, with no hook): `app.py` applies it once
    when it builds the app; applying it again is a no-op."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "flag_aware", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and self.metavar is None else shown(self, ctx)

    display_type_rich.flag_aware = True
    option.display_type_rich = display_type_rich


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


PAMR_HELP = "PAMR refinement of the cosine maps at the original size (NACLIP's post stage; about (names + 20) x H x W floats of memory)."

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="open_clip model name (ViT-B-16, ViT-L-14, ...) or a model-config JSON.")]
PretrainedOpt = Annotated[
    str, typer.Option("--pretrained", help="open_clip tag (openai), a checkpoint file (.pt/.bin/.safetensors), or 'none' (random weights).")
]
# eval and analyze: unset means the protocol's CLIP (`Protocol.clip_weights`), else the library's ViT-B-16 openai
ProtocolModelOpt = Annotated[
    Optional[str], typer.Option("--model", "-m", help="open_clip model name or a model-config JSON; default: the protocol's CLIP (`ls protocols`), else ViT-B-16.", show_default=False)
]
ProtocolPretrainedOpt = Annotated[
    Optional[str], typer.Option("--pretrained", help="open_clip tag, a checkpoint file, or 'none' (random weights); default: the protocol's, else openai.", show_default=False)
]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where to run; auto picks cuda, then mps, then cpu.")]
# the measurements behind bf16 (speed-ups, agreement with fp32) live in docs/speed.md and benchmarks/README.md
PRECISION_HELP = (
    "bf16: faster on GPUs and on CPUs with AVX512-BF16 or AMX-BF16, opt-in (its agreement with fp32 measured on "
    "random weights only: docs/speed.md); fp16: GPUs and CPUs with AMX-FP16."
)
PrecisionOpt = Annotated[Precision, typer.Option("--precision", help=PRECISION_HELP)]
PresetOpt = Annotated[
    Optional[str], typer.Option("--preset", help="Attention preset: clip, maskclip, sclip, clearclip, naclip, proxyclip, ..., *-entmax (see `ls presets`).")
]
AttnOpt = Annotated[
    Optional[str],
    typer.Option("--attn", help="Attention spec SOURCE/NORMALIZER, optionally followed by /OPTIONs, e.g. qq/entmax:1.5/nores/noffn; overrides --preset."),
]

ProxyWeightsOpt = Annotated[
    str,
    typer.Option("--proxy-weights", help="Weights of the proxy presets' backbones (`ls backbones`): hub, a checkpoint file, none, or auto (none with --pretrained none, else hub); per backbone NAME=W,NAME=W."),
]

RegionsOpt = Annotated[
    Optional[str],
    typer.Option("--regions", help="Region masks for the presets that read them (corrclip, ovstitcher, corrclipv2; `ls regions`): a folder of png/npy/npz named like the images, sam2 (extra .\\[proxy]) or sam3 (extra .\\[sam3]); cached."),
]

PromptsOpt = Annotated[
    Optional[Path],
    typer.Option("--prompts", help='Prompt file: a JSON object of class name -> list of description sentences, averaged with the templates (OV-Stitcher\'s class_biased_template.json), e.g. {"cat": ["a small furry pet."]}.'),
]

BankOpt = Annotated[
    Optional[Path],
    typer.Option("--bank", help="An image bank (`clipseg-sparse bank build`) for retrieval stages (corrclipv2: stage retrieve); results record its content hash."),
]

TemplatesOpt = Annotated[
    str, typer.Option("--templates", help="Prompt templates: openai (80), single, none, or a file with one {}-template per line.")
]


def out_console():
    """The console for tables on stdout. Off a terminal rich cuts lines at 80 columns, which truncates
    cells ("entmax:1…"); redirected output (`cmd > out.txt`) gets wide lines instead, unless COLUMNS is set."""
    import os
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 240)


def fail(message: str, code: int = 2) -> NoReturn:
    """One-line error on stderr and a non-zero exit (2 = bad usage or input)."""
    from rich.markup import escape

    # escaped: a message quoting "[x, y, w, h]" or a path with brackets must not be read as rich markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def note_shown(out: Path | None, shown: bool) -> None:
    """Say that a finished result file was read back instead of computed (eval, fgovd)."""
    if shown:
        err_console.print(f"{out} holds this configuration's finished result: showing it, not recomputing (--overwrite recomputes)", highlight=False, soft_wrap=True)


def user_errors() -> Callable[[Command], Command]:
    """The CLI's one error boundary, put once on every command (under `@app.command`): a `UserError` raised
    anywhere in the command ends as one stderr line and exit 2 (`fail`) instead of a traceback; a full disk
    (ENOSPC, raised by any write) as one line naming the file and exit 1: every command writes atomically
    and resumes, so running it again once there is space loses nothing finished.

    Nothing else is caught: library code raises a `UserError` subclass for every input a user can fix, so a
    plain `ValueError` (or any other builtin) is a bug and surfaces as its traceback."""
    caught = (UserError,)

    def wrap(command: Command) -> Command:
        @functools.wraps(command)
        def run(*args, **kwargs):
            try:
                return command(*args, **kwargs)
            except caught as e:
                fail(str(e))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                fail(f"{e.filename}: no space left on device; free some and run the same command again (it resumes, nothing finished is lost)", code=1)

        run.user_errors = caught  # what `tests/test_errors.py` checks every command has
        return run  # type: ignore[return-value]

    return wrap


def check_out(out: Path | None, folder: bool, option: str = "--out") -> None:
    """Fail early, before any model is loaded, when --out is the wrong kind of path (a file where a folder
    goes, or the reverse) or cannot be written (read-only place, /proc or /sys, a file in the way).

    The one output check: every command that writes (segment, eval, fgovd, analyze, explain, sweep,
    reproduce, report, dna train, dna stats, convert) calls it on each path it will write before any
    work, so no run dies at its first write with a traceback after minutes of work."""
    if out is None:
        return
    if folder and out.exists() and not out.is_dir():
        fail(f"{option} {out}: is a file; this command writes a folder of outputs there")
    if not folder and out.is_dir():
        fail(f"{option} {out}: is a folder; give the result file to write, e.g. {out / 'result.json'}")
    problem = unwritable(out.absolute() if folder else out.absolute().parent)
    if problem:
        fail(f"{option} {out}: {problem}")


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written in `folder` (created if missing), or None: its nearest existing
    ancestor must be a folder this process can create files in (probed with a temporary file)."""
    import tempfile

    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f"cannot write in {existing} ({e.strerror or e})"
    return None


def check_preset(preset: str) -> None:
    """Fail unless --preset names a preset, alone or followed by more parts (`sclip/entmax:1.5`)."""
    from ..attention import PRESETS

    name = preset.split("/")[0]
    if name in PRESETS:
        return
    from ..segment.pipelines import PIPELINES, split_pipeline

    if split_pipeline(preset)[0] in PIPELINES:
        fail(f"--preset {preset}: a pipeline, not an attention preset; only `eval` runs it (`ls pipelines`)")
    fail(PRESETS.unknown_message(name))


def resolve_attention(preset: str | None, attn: str | None, default: str = "sclip"):
    """--attn wins over --preset, which wins over the command's default preset."""
    from ..attention import AttentionSpec

    if attn is None and preset is not None:
        check_preset(preset)
    text = attn or preset or default
    spec = AttentionSpec.parse(text)
    note_softmax_aliases(text.split("/"))
    return spec


def note_softmax_aliases(normalizers) -> None:
    """Say so when a normalizer written `entmax:1` runs as softmax (alpha -> 1 is entmax's softmax limit,
    and results record it as softmax), so nobody reads a softmax number as an entmax one."""
    for text in normalizers:
        name, _, arg = str(text).strip().lower().partition(":")
        try:
            alias = name == "entmax" and float(arg) == 1.0
        except ValueError:
            alias = False
        if alias:
            err_console.print(f"note: {text} is softmax (entmax's alpha -> 1 limit); it runs and is recorded as softmax", highlight=False)


def load_model(model: str, pretrained: str, device: Device, precision: Precision):
    """load_clip behind a status line (its errors: `WeightsUnavailableError`, `UserValueError`)."""
    from ..models.clip import load_clip

    with err_console.status(f"loading {model} ({pretrained})"):
        return load_clip(model, pretrained=pretrained, device=device.value, precision=precision.value)


def load_pipeline(pipeline, weights: str, pretrained: str, device: Device, precision: "Precision" = None):
    """A pipeline's model (`--preset sam3`, segment/pipelines.py) behind a status line: its backbone's
    --proxy-weights (auto: hub, or none with --pretrained none); its errors are one line (missing extra,
    weights, device)."""
    from ..models.proxies import ProxyBackbones
    from ..runtime.device import resolve_device

    chosen = ProxyBackbones(weights=weights, clip_weights=pretrained).resolved_weights(pipeline.backbone)
    with err_console.status(f"loading {pipeline.backbone} ({chosen})"):
        return pipeline.load(chosen, str(resolve_device(device.value)), (precision or Precision.fp32).value)


def note(message: str) -> None:
    """A `note:` line on stderr (an input given but unused, a setting read as another)."""
    err_console.print(f"note: {message}", highlight=False, markup=False, soft_wrap=True)  # a spec's [..] is not markup


def open_resources(plans, device: Device, names: Sequence[str] = (), *, attention: bool = False, **inputs):
    """`segment.Resources.open` for a command, before any model loads (regions, bank, prompts, proxy_weights:
    the command's options; names: the images' names a region folder must cover); its notes on stderr."""
    from ..runtime.device import resolve_device
    from ..segment.resources import Resources

    return Resources.open(plans, names=names, device=str(resolve_device(device.value)), note=note, attention=attention, **inputs)


def bind_resources(resources, plan, clip, names: Sequence[str] = (), attention: bool = False):
    """`Resources.bind` behind a status line: the backbones and what the stages load, before any image."""
    with err_console.status("loading proxy backbones"):
        return resources.bind(plan, clip, names, attention)
