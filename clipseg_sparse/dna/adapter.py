"""DnA adapters: the trained negative branch alone, in a safetensors file, and how it meets a loaded CLIP.

File layout: tensors `blocks.<i>.q_neg.weight`, `.q_neg.bias`, `.v_neg.weight`, `.v_neg.bias` (absent for the
shared-value ablation) and `.alpha` for each converted block index i; string metadata `format`
(`clipseg-sparse-dna/1`), `model` (open_clip name), `pretrained` (weights tag or checkpoint file name),
`width`, `heads`, `num_blocks` (blocks of the whole image tower), `blocks` (comma-separated indices),
`sign`, `negative`, `shared_values`, and `training` (JSON of the recipe, informational).
The positive branch is CLIP's own, so an adapter is only meaningful on the model (and weights) it was trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserValueError
from .convert import dna_modules, vision_blocks
from ..attention.contract import positive_attention
from .module import DenoisingAttention

FORMAT = "clipseg-sparse-dna/1"


class AdapterError(UserValueError):
    """An adapter file that is missing, malformed, or made for another model; the message is one line."""


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: tensors by name (CPU) and its metadata."""

    path: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]

    @property
    def blocks(self) -> list[int]:
        return [int(b) for b in self.meta["blocks"].split(",")]

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def weights_name(pretrained: str) -> str:
    """The weights identity written into and compared with adapters: a tag as is, a checkpoint by file name."""
    return Path(pretrained).name if ("/" in pretrained or "\\" in pretrained) else pretrained


def save_adapter(clip, path: str | Path, training: dict | None = None) -> Path:
    """Write the DnA branches of a converted DenseCLIP to `path` (safetensors, atomically)."""
    from safetensors.torch import save_file

    from ..runtime.atomic import atomic_path

    modules = dna_modules(clip)
    if not modules:
        raise AdapterError("the model has no DnA blocks to save (convert_to_dna first)")
    first = next(iter(modules.values()))
    tensors = {
        f"blocks.{i}.{name}": p.detach().float().cpu().contiguous()
        for i, m in modules.items()
        for name, p in m.negative_parameters().items()
    }
    meta = {
        "format": FORMAT,
        "model": clip.model_name,
        "pretrained": weights_name(clip.pretrained),
        "width": str(first.embed_dim),
        "heads": str(first.num_heads),
        "num_blocks": str(len(vision_blocks(clip))),
        "blocks": ",".join(str(i) for i in modules),
        "sign": str(first.sign),
        "negative": first.negative,
        "shared_values": str(first.shared_values).lower(),
        "training": json.dumps(training or {}, sort_keys=True),
    }
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


def load_adapter(path: str | Path) -> Adapter:
    """Read an adapter file; AdapterError (one line) when it is missing or not a DnA adapter."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"{path}: DnA adapter file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # not a safetensors file, truncated
        raise AdapterError(f"{path}: cannot read as a safetensors DnA adapter ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{path}: not a DnA adapter (metadata format {meta.get('format')!r}, expected {FORMAT!r})")
    return Adapter(str(path), tensors, meta)


def check_compatible(adapter: Adapter, clip) -> None:
    """AdapterError naming the first difference between the adapter's base model and `clip`."""
    blocks = vision_blocks(clip)
    attn = positive_attention(blocks[0].attn)
    have = {
        "model": clip.model_name,
        "pretrained": weights_name(clip.pretrained),
        "width": str(attn.embed_dim),
        "heads": str(attn.num_heads),
        "num_blocks": str(len(blocks)),
    }
    for key, value in have.items():
        if adapter.meta.get(key) != value:
            raise AdapterError(
                f"{adapter.path}: DnA adapter was trained for {key} {adapter.meta.get(key)!r} "
                f"({adapter.meta.get('model')}, weights {adapter.meta.get('pretrained')}), but the loaded CLIP has {value!r}"
            )


def build_modules(adapter: Adapter, clip) -> dict[int, DenoisingAttention]:
    """{block index: DenoisingAttention} on `clip`'s own attention (shared, not copied), loaded from the adapter.

    Nothing in `clip` changes; the modules are for running those blocks with DnA (see `apply_adapter` for
    an in-place conversion instead).
    """
    check_compatible(adapter, clip)
    blocks = vision_blocks(clip)
    modules = {}
    for i in adapter.blocks:
        attn = positive_attention(blocks[i].attn)
        m = DenoisingAttention(
            attn.embed_dim, attn.num_heads, positive=attn, sign=int(adapter.meta["sign"]),
            negative=adapter.meta["negative"], shared_values=adapter.meta["shared_values"] == "true",
        )
        state = {k.split(".", 2)[2]: v for k, v in adapter.tensors.items() if k.startswith(f"blocks.{i}.")}
        missing = set(m.negative_parameters()) - set(state)
        if missing:
            raise AdapterError(f"{adapter.path}: block {i} lacks tensor(s) {', '.join(sorted(missing))}")
        with torch.no_grad():
            for name, p in m.negative_parameters().items():
                if state[name].shape != p.shape:
                    raise AdapterError(f"{adapter.path}: blocks.{i}.{name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}")
                p.copy_(state[name])
        modules[i] = m.requires_grad_(False)
    return modules


def apply_adapter(clip, adapter: Adapter | str | Path) -> dict[int, DenoisingAttention]:
    """Convert `clip` in place: each adapter block's attention becomes its DenoisingAttention."""
    adapter = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    modules = build_modules(adapter, clip)
    blocks = vision_blocks(clip)
    for i, m in modules.items():
        blocks[i].attn = m
    return modules
