"""The attention-spec option `dna:PATH`: run a trained DnA adapter's blocks with their negative branch.

`qk/softmax/dna:runs/dna/adapter.safetensors` is DnA as trained; with other edits (`qq+kk/softmax/dna:PATH`, SCLIP) the
adapter's negative branch is added to whatever positive attention the spec computes in those blocks. The
option takes the rest of the spec text (paths contain '/'), so it is written last. Its canonical form
carries the first 12 hex digits of the file's SHA-256 (`dna:PATH@1a2b3c4d5e6f`): result files say which
adapter made a number, a resumed run refuses an adapter that changed, and a spec read back from a result on
a machine without the file still parses.
"""

from __future__ import annotations

import copy
import re
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch.nn as nn

from ..attention.spec import register_option
from ..runtime.fingerprint import file_digest
from .adapter import AdapterError, build_modules, load_adapter

_HASH = re.compile(r"^(?P<path>.+)@(?P<hash>[0-9a-f]{12})$")
_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def split_arg(arg: str) -> tuple[Path, str | None]:
    """`PATH[@HASH]` -> (path, hash or None)."""
    m = _HASH.match(arg)
    return (Path(m["path"]), m["hash"]) if m else (Path(arg), None)


def check_arg(arg: str) -> str:
    """Canonical `PATH@HASH`; AdapterError for an empty argument, a missing file without a recorded hash,
    or a file whose content no longer matches the recorded hash."""
    if not arg:
        raise AdapterError("dna needs an adapter file: dna:PATH")
    path, recorded = split_arg(arg)
    if not path.is_file():
        if recorded is None:
            raise AdapterError(f"{path}: DnA adapter file not found")
        return arg  # read back from a result elsewhere: keep the record as it is
    digest = file_digest(path)
    if recorded is not None and recorded != digest:
        raise AdapterError(f"{path}: DnA adapter changed since it was recorded (sha256 {digest}, recorded {recorded})")
    return f"{path}@{digest}"


def with_attention(block: nn.Module, attn: nn.Module) -> nn.Module:
    """A shallow copy of `block` whose `attn` is `attn`; every other submodule and weight is shared."""
    new = copy.copy(block)
    new._modules = dict(block._modules)
    new._modules["attn"] = attn
    return new


def dna_visual(clip, arg: str) -> SimpleNamespace:
    """What the block runner reads of the image tower (`transformer.resblocks`), with the adapter's blocks
    running DenoisingAttention on `clip`'s own weights (cached per model and adapter content; the model
    itself is not changed). AdapterError when the file is missing, changed, or made for another model."""
    path, recorded = split_arg(arg)
    if not path.is_file():
        raise AdapterError(f"{path}: DnA adapter file not found")
    digest = file_digest(path)
    if recorded is not None and recorded != digest:
        raise AdapterError(f"{path}: DnA adapter changed since it was recorded (sha256 {digest}, recorded {recorded})")
    cache = _BLOCKS.setdefault(clip.visual, {})
    key = (digest, str(clip.device), clip.dtype)  # the new modules follow the weights' device and dtype
    if key not in cache:
        modules = build_modules(load_adapter(path), clip)
        blocks = [with_attention(b, modules[i]) if i in modules else b for i, b in enumerate(clip.visual.transformer.resblocks)]
        cache[key] = SimpleNamespace(transformer=SimpleNamespace(resblocks=nn.ModuleList(blocks), batch_first=True))
    return cache[key]


register_option(
    "dna", check_arg, rest_of_spec=True, tower=dna_visual,
    help="dna:PATH  add a trained DnA adapter's negative branch to its blocks (last option; see `dna train`)",
)
