"""Hugging Face tokenizers of open_clip text towers (SigLIP / SigLIP 2, MetaCLIP 2), offline-first.

open_clip's `get_tokenizer` builds an `HFTokenizer` from the Hub id in the model config, which downloads on
first use. Here the tokenizer is read from the local Hugging Face cache (or from a local directory the user
gives), the Hub is probed first so an offline machine fails in seconds, and every failure is the same one
line as missing weights (`runtime.weights.WeightsUnavailableError`). `transformers` is an optional extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..runtime.weights import WeightsUnavailableError, _hub_offline, _unreachable_hub, require_extra


def _tokenizer_help(model_name: str, source: str) -> str:
    return (
        f"could not obtain the Hugging Face tokenizer {source!r} of {model_name}. It is downloaded from the "
        f"Hugging Face Hub on first use and then read from its cache ($HF_HOME, default ~/.cache/huggingface). "
        f"Offline, either pass a local directory holding its files (tokenizer=/path/to/dir, "
        f"e.g. a `huggingface-cli download {source}` copy), copy the cache from a machine that has it, or set "
        f"HF_HUB_OFFLINE=1 to fail fast."
    )


class HubTokenizer:
    """open_clip's `HFTokenizer` for model `model_name` (its `text_cfg`), loaded on first call.

    path: a local directory with the tokenizer files, instead of the config's Hub id from the cache.
    Called like open_clip's tokenizers: texts -> B x context_length token ids.
    """

    def __init__(self, model_name: str, text_cfg: dict, path: str | None = None, cache_dir: str | None = None):
        self.model_name = model_name
        self.text_cfg = dict(text_cfg)
        self.path = path
        self.cache_dir = cache_dir
        self._tokenizer: Any = None

    @property
    def source(self) -> str:
        return self.path or self.text_cfg.get("hf_tokenizer_name", "")

    def load(self) -> Any:
        """The open_clip HFTokenizer; WeightsUnavailableError (one line) when it cannot be had."""
        if self._tokenizer is not None:
            return self._tokenizer
        if self.path is not None and not Path(self.path).expanduser().is_dir():
            raise WeightsUnavailableError(f"{self.path}: tokenizer directory not found (tokenizer= takes a local directory with the tokenizer files)")
        require_extra("transformers", f"{self.model_name}'s Hugging Face tokenizer", extra="families")
        from open_clip.tokenizer import HFTokenizer

        source = str(Path(self.path).expanduser()) if self.path else self.source
        unreachable = None if self.path else _unreachable_hub({"hf_hub": source})
        kwargs = dict(self.text_cfg.get("tokenizer_kwargs", {}))
        try:
            with _hub_offline(unreachable is not None):
                self._tokenizer = HFTokenizer(
                    source,
                    context_length=self.text_cfg.get("context_length", 77),
                    cache_dir=self.cache_dir,
                    tokenizer_mode=self.text_cfg.get("tokenizer_mode"),
                    **kwargs,
                )
        except Exception as e:
            why = f"{unreachable} is unreachable and the tokenizer is not in the cache. " if unreachable else ""
            raise WeightsUnavailableError(why + _tokenizer_help(self.model_name, source)) from e
        return self._tokenizer

    def __call__(self, texts: str | Sequence[str], context_length: int | None = None):
        return self.load()(texts, context_length) if context_length else self.load()(texts)
