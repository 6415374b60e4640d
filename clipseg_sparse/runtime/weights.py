"""Getting weights: checkpoint files, the Hugging Face Hub (with a fast offline probe), optional extras.

Every way of failing to get weights ends in one `WeightsUnavailableError` whose one line says what to do;
CLIP (`models.clip`) and the proxy backbones (`models.backbones`) share these helpers.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import UserError


RANDOM_WEIGHTS_SEED = 0


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def is_checkpoint_path(pretrained: str) -> bool:
    """Whether a `--pretrained` value names a checkpoint file (by its suffix, or a path separator), not a tag."""
    return Path(pretrained).expanduser().suffix in CHECKPOINT_SUFFIXES or os.sep in pretrained


class WeightsUnavailableError(UserError, RuntimeError):
    """CLIP weights could not be found locally nor downloaded."""


def _weights_help(model_name: str, pretrained: str, option: str = "--pretrained") -> str:
    """The one-line advice when Hub weights cannot be had (also used for proxy backbones)."""
    return (
        f"could not obtain weights {pretrained!r} for {model_name}. Model weights are downloaded from the "
        f"Hugging Face Hub on first use and then read from its cache ($HF_HOME, default ~/.cache/huggingface). "
        f"Offline, either pass a local checkpoint ({option} /path/to/model.pt|.bin|.safetensors), copy "
        f"the cache from a machine that has it, or set HF_HUB_OFFLINE=1 to fail fast. "
        f"Use {option} none for random weights (testing only)."
    )


def _checkpoint_error(path: Path, model_name: str, error: Exception) -> str:
    """Why a local checkpoint did not load, in our words. A file that is not a checkpoint at all gets no
    echo of torch's unpickler advice (which suggests unsafe loading with weights_only=False)."""
    with path.open("rb") as f:
        head = f.read(16)
    is_zip, is_pickle = head.startswith(b"PK\x03\x04"), head[:1] == b"\x80"
    is_safetensors = len(head) >= 9 and head[8:9] == b"{"  # 8-byte header length, then the JSON header
    if not (is_zip or is_pickle or is_safetensors):
        return f"{path}: not a weights file (neither a PyTorch checkpoint nor safetensors); give an open_clip checkpoint of {model_name}"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "weights_only" in str(error):
        return f"{path}: not a plain weights file (it holds objects other than tensors, which are not loaded for safety); give a state dict of {model_name}"
    return f"{path}: cannot load as {model_name} weights: {first}"


HUB_PROBE_TIMEOUT_S = 3.0


def _offline_mode_set() -> bool:
    """Whether the user set huggingface_hub's offline mode (HF_HUB_OFFLINE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _unreachable_hub(cfg: dict) -> str | None:
    """The host serving a pretrained tag when it cannot be reached now, else None.

    Offline, huggingface_hub retries for about a minute before failing; one TCP connection with a short
    timeout (name lookup included) tells the same in seconds. Skipped, returning None, when offline mode
    is already set or a proxy is configured (the proxy, not the host, would have to be reached).
    """
    import socket
    import threading
    from urllib.parse import urlparse

    if _offline_mode_set():
        return None
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co") if cfg.get("hf_hub") or not cfg.get("url") else cfg["url"]
    parsed = urlparse(url)
    host, port = parsed.hostname or "huggingface.co", parsed.port or (80 if parsed.scheme == "http" else 443)
    reached: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            reached.append(True)
        except OSError:
            pass

    worker = threading.Thread(target=probe, daemon=True)  # a hanging name lookup is abandoned, not waited for
    worker.start()
    worker.join(HUB_PROBE_TIMEOUT_S + 0.5)
    return None if reached else host


def hub_unavailable(repo: str) -> str | None:
    """Why a download from the Hub repository `repo` cannot happen now (offline mode set, or the probe of
    `_unreachable_hub` failed), else None; at most a few seconds, nothing downloaded."""
    if _offline_mode_set():
        return "HF_HUB_OFFLINE is set"
    host = _unreachable_hub({"hf_hub": repo})
    return f"{host} is unreachable" if host else None


@contextlib.contextmanager
def _hub_offline(offline: bool):
    """huggingface_hub's offline mode for the block (it reads the flag per request): cached weights still
    load, and a download fails at once instead of after its retries."""
    if not offline:
        yield
        return
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


class MissingExtraError(UserError, ImportError):
    """An optional dependency (proxy presets, Hugging Face tokenizers) is not installed."""


def require_extra(module: str, what: str, extra: str = "proxy"):
    """Import an optional dependency, or raise MissingExtraError with the one-line install hint naming
    the extra that holds it (proxy: SAM2 / segment-anything; families: transformers for HF tokenizers)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{what} needs the Python package {module!r}, which is not installed: pip install -e \".[{extra}]\" "
            f"(or pip install 'clipseg-sparse[{extra}]')"
        ) from None
