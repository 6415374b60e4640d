"""Hugging Face tokenizers of open_clip text towers (SigLIP / SigLIP 2, MetaCLIP 2), offline-first.

open_clip's `get_tokenizer` builds an `HFTokenizer` from the Hub id in the model config, which downloads on
first use. Here the tokenizer is read from the local Hugging Face cache (or from a local directory the user
gives), the Hub is probed first so an offline machine fails in seconds, and every failure is the same one
line as missing weights (`runtime.weights.WeightsUnavailableError`). `transformers` is an optional extra.
A tower with random weights needs no real tokenizer: offline it runs with a byte-level stand-in
(`write_byte_tokenizer`), with a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..runtime.progress import err_console
from ..runtime.weights import WeightsUnavailableError, _hub_offline, _unreachable_hub, require_extra


def _tokenizer_help(model_name: str, source: str) -> str:
    return (
        f"could not obtain the Hugging Face tokenizer {source!r} of {model_name}. It is downloaded from the "
        f"Hugging Face Hub on first use and then read from its cache ($HF_HOME, default ~/.cache/huggingface). "
        f"Offline, either pass a local directory holding its files (tokenizer=/path/to/dir, "
        f"e.g. a `huggingface-cli download {source}` copy), copy the cache from a machine that has it, or set "
        f"HF_HUB_OFFLINE=1 to fail fast. With random weights (--pretrained none) no real tokenizer is needed: "
        f"a byte-level stand-in is used (`clipseg_sparse.models.tokenizers.write_byte_tokenizer` writes one to pass as tokenizer=DIR)."
    )


def write_byte_tokenizer(folder: str | Path) -> Path:
    """A Hugging Face tokenizer directory that needs no download: byte-level BPE without merges, ids 0 <pad>,
    1 <eos>, then one per byte (258 in all, within every text tower's vocabulary). A stand-in where the ids
    do not matter: a tower with random weights (tests, smoke runs offline; `load_clip(tokenizer=DIR)`)."""
    require_extra("transformers", "a Hugging Face tokenizer", extra="families")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(str(folder))
    return Path(folder)


class HubTokenizer:
    """open_clip's `HFTokenizer` for model `model_name` (its `text_cfg`), loaded on first call.

    path: a local directory with the tokenizer files, instead of the config's Hub id from the cache.
    random_weights: the tower's weights are random, so where the Hub tokenizer cannot be had a byte-level
    stand-in serves (its ids are not the real tokenizer's; a note says so).
    Called like open_clip's tokenizers: texts -> B x context_length token ids.
    """

    def __init__(self, model_name: str, text_cfg: dict, path: str | None = None, cache_dir: str | None = None, random_weights: bool = False):
        self.model_name = model_name
        self.text_cfg = dict(text_cfg)
        self.path = path
        self.cache_dir = cache_dir
        self.random_weights = random_weights
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
        source = str(Path(self.path).expanduser()) if self.path else self.source
        unreachable = None if self.path else _unreachable_hub({"hf_hub": source})
        try:
            with _hub_offline(unreachable is not None):
                self._tokenizer = self._open(source)
        except Exception as e:
            if not self.random_weights or self.path:
                why = f"{unreachable} is unreachable and the tokenizer is not in the cache. " if unreachable else ""
                raise WeightsUnavailableError(why + _tokenizer_help(self.model_name, source)) from e
            import tempfile

            err_console.print(f"note: {self.model_name} has random weights and its tokenizer {source!r} cannot be had here: "
                              "it runs with a byte-level stand-in (`models.tokenizers.write_byte_tokenizer`; other token ids)",
                              highlight=False, markup=False, soft_wrap=True)  # fmt: skip
            with tempfile.TemporaryDirectory() as folder:
                self._tokenizer = self._open(str(write_byte_tokenizer(folder)))
        return self._tokenizer

    def _open(self, source: str) -> Any:
        from open_clip.tokenizer import HFTokenizer

        return HFTokenizer(
            source,
            context_length=self.text_cfg.get("context_length", 77),
            cache_dir=self.cache_dir,
            tokenizer_mode=self.text_cfg.get("tokenizer_mode"),
            **self.text_cfg.get("tokenizer_kwargs", {}),
        )

    def __call__(self, texts: str | Sequence[str], context_length: int | None = None):
        return self.load()(texts, context_length) if context_length else self.load()(texts)
