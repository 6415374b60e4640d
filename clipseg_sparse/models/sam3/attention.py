"""A normalizer inside SAM 3's detector (transformers backend): softmax, entmax:ALPHA or sparsemax in the
attention of chosen `Sam3Attention` modules, with the engine's exact entmax (`attention.normalizers`).

Why: the detector decodes its object queries by cross-attending to every image token; with softmax each
query's row spreads mass over the whole image, as CLIP's last block does. entmax gives the rows exact zeros.

How, without a fork: every `Sam3Attention` asks transformers' attention registry for the function its config
names (`_attn_implementation`, "sdpa" by default). `clipseg_sparse` is registered there once; a targeted
module gets its own config copy naming it and a `_clipseg_normalizer` tag, so the sub-model's shared config,
its mask creation and every other module stay on SDPA. The function computes the scores, adds the module's
float bias (the decoder's box relative-position bias) or masks the padding to -inf, normalises, and returns
the weights too (`record_attention` reads them). A forward hook could not do it: SDPA's softmax is fused.

Sites (`SITES`, every layer of each): `decoder-image`, the object queries and the presence token attending to
the image tokens; `encoder-text`, the fusion encoder's image tokens attending to the prompt tokens; the
others for completeness. `DEFAULT_SITES` are the first two, where an image row meets the text.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterable, Iterator

import torch

from ...attention.normalizers import Normalizer, normalize
from ...errors import UserValueError

ATTN_NAME = "clipseg_sparse"
SITES = {  # short name -> (module path, attribute of each layer)
    "decoder-image": ("detr_decoder.layers", "vision_cross_attn"),
    "encoder-text": ("detr_encoder.layers", "cross_attn"),
    "decoder-text": ("detr_decoder.layers", "text_cross_attn"),
    "mask-text": ("mask_decoder", "prompt_cross_attn"),
    "encoder-self": ("detr_encoder.layers", "self_attn"),
    "decoder-self": ("detr_decoder.layers", "self_attn"),
}
DEFAULT_SITES = ("decoder-image", "encoder-text")


def attention_modules(model: torch.nn.Module, sites: Iterable[str]) -> dict[str, torch.nn.Module]:
    """name -> `Sam3Attention` module of every layer of each site."""
    found = {}
    for site in sites:
        if site not in SITES:
            raise UserValueError(f"unknown SAM 3 attention site {site!r}; choose from {', '.join(SITES)}")
        path, attr = SITES[site]
        owner = model.get_submodule(path)
        layers = enumerate(owner) if isinstance(owner, torch.nn.ModuleList) else [(None, owner)]
        for i, layer in layers:
            found[f"{path}.{attr}" if i is None else f"{path}.{i}.{attr}"] = getattr(layer, attr)
    return found


def sparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as `clipseg_sparse`: a module tagged with a normalizer gets scores,
    bias or mask, the normalizer, A V, and returns (output, weights); any other module goes to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    normalizer = getattr(module, "_clipseg_normalizer", None)
    if normalizer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # True = attend
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:  # an additive bias (the box relative-position bias) or a -inf / dtype-min mask
            scores = scores + attention_mask
    weights = normalize(scores, normalizer).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def set_normalizer(model: torch.nn.Module, normalizer: str | Normalizer | None, sites: Iterable[str] = DEFAULT_SITES) -> list[str]:
    """Give the modules of `sites` the normalizer (None restores SDPA); returns their names."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, sparse_attention_forward)  # a new key: models that do not name it are untouched
    parsed = None if normalizer is None else normalizer if isinstance(normalizer, Normalizer) else Normalizer.parse(normalizer)
    modules = attention_modules(model, sites)
    for module in modules.values():
        if parsed is None:
            if hasattr(module, "_clipseg_config"):
                module.config = module._clipseg_config
                del module._clipseg_config
            module._clipseg_normalizer = None
            continue
        if not hasattr(module, "_clipseg_config"):
            module._clipseg_config = module.config
            module.config = copy.copy(module.config)
            module.config._attn_implementation_internal = ATTN_NAME
        module._clipseg_normalizer = parsed
    return list(modules)


@contextlib.contextmanager
def record_attention(model: torch.nn.Module, sites: Iterable[str] = ("decoder-image",)) -> Iterator[dict[str, list[torch.Tensor]]]:
    """The attention weights [B, heads, queries, keys] of every call of the modules of `sites`, name -> list.
    The modules must run through `clipseg_sparse` (a normalizer set; "softmax" counts): SDPA returns none."""
    modules = attention_modules(model, sites)
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in modules}

    def keep(name: str):
        def hook(module, inputs, output):
            if output[1] is not None:
                rows[name].append(output[1].detach().float())

        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in modules.items()]
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()
