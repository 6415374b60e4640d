"""Loading a frozen open_clip ViT and reading dense patch features through an attention spec.

`load_clip` is the one entry point (open_clip's `create_model` underneath): it accepts a pretrained tag,
a local checkpoint or no weights at all, and turns every way of failing to get weights into one
`WeightsUnavailableError` that says what to do. `DenseCLIP.encode_dense` runs the untouched model up to
the last `spec.layers` blocks, then runs those blocks itself from their own weights (no fork of
open_clip's code, nothing patched in place), so one loaded model serves any number of specs.
`DenseCLIP` holds its family's image tower (`tower.Tower`, one file per family in `families/`), so it runs
every family the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..attention import OPTIONS, AttentionSpec, resolve_spec
from ..attention import blocks as attention_blocks
from ..attention.taps import attention_grid
from ..errors import UserValueError
from ..runtime.device import PRECISIONS, check_precision, resolve_device
from ..runtime.fingerprint import file_digest
from ..runtime.weights import (
    is_checkpoint_path,
    RANDOM_WEIGHTS_SEED,
    WeightsUnavailableError,
    _checkpoint_error,
    _hub_offline,
    _unreachable_hub,
    _weights_help,
)
from .proxies import ProxyBackbones
from .text_tower import encode_tokens
from .tower import Tower, model_family, wrap_tower

POS_INTERP_RULES = ("size", "scale")  # see DenseCLIP.positional_embedding
# The library's default CLIP: what runs when neither the command line nor a protocol names one
# (`evaluation.protocols.Protocol.clip_weights` writes that precedence once).
DEFAULT_MODEL, DEFAULT_PRETRAINED = "ViT-B-16", "openai"


def _check_rule(rule: str) -> None:
    if rule not in POS_INTERP_RULES:
        raise UserValueError(f"unknown positional-embedding rule {rule!r}; choose {', '.join(POS_INTERP_RULES)}")


def _is_torchscript_archive(path: Path) -> bool:
    """OpenAI's own releases (ViT-B-16.pt, ...) are TorchScript zips; those models use QuickGELU."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("constants.pkl") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _unsupported(config: dict, name: str = "") -> str | None:
    """Why an open_clip model config cannot be used here (None if it can); see `tower.model_family`."""
    return model_family(name, config).reason


def supported_models() -> list[str]:
    """open_clip names `load_clip` accepts: those of a family that runs (`families/`: open_clip's own
    VisionTransformer, and the timm towers EVA-02, SigLIP / SigLIP 2, PE-Core)."""
    import open_clip

    return [m for m in open_clip.list_models() if _unsupported(open_clip.get_model_config(m), m) is None]


@contextlib.contextmanager
def _no_stray_open_clip_logs():
    """open_clip logs a failed download on the root logger and then raises the same text; with logging
    unconfigured that reaches stderr raw ("ERROR:root:..."). Our own error says it, so drop those records
    unless the application configured logging (root has handlers)."""
    root = logging.getLogger()
    sink = logging.NullHandler() if not root.handlers else None
    if sink is not None:
        root.addHandler(sink)
    try:
        yield
    finally:
        if sink is not None:
            root.removeHandler(sink)


def check_model_name(model_name: str) -> str:
    """The open_clip name of a supported model (a config JSON is registered); UserValueError otherwise.

    Cheap (reads configs only), so grids can be checked before any model is built.
    """
    import open_clip

    name = model_name
    if name.endswith(".json"):  # a custom architecture, e.g. a tiny ViT for tests
        path = Path(name)
        if not path.is_file():
            raise UserValueError(f"{name}: model config file not found")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserValueError(f"{name}: not a JSON model config ({e})") from None
        missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if not isinstance(config, dict) or k not in config]
        if missing:
            raise UserValueError(f"{name}: not an open_clip model config: no {', '.join(repr(k) for k in missing)}")
        open_clip.add_model_config(path)
        name = path.stem
    elif open_clip.get_model_config(name.replace("/", "-")) is None:
        raise UserValueError(f"unknown model {model_name!r}; supported ViTs include: {', '.join(supported_models()[:12])}, ... (`ls models`)")
    name = name.replace("/", "-")
    reason = _unsupported(open_clip.get_model_config(name), name)
    if reason:
        raise UserValueError(f"model {model_name!r} is not supported: {reason}; see `clipseg-sparse ls models`")
    return name


def _create_open_clip(model_name: str, pretrained: str | None, quick_gelu: bool | None, cache_dir: str | None):
    """(open_clip model, canonical name, weights: checkpoint path | tag | None, QuickGELU used, a checkpoint
    file's content digest or None)."""
    import open_clip

    name = check_model_name(model_name)
    if pretrained is None:
        gelu = bool(quick_gelu)
        # random weights are for tests and demos: seeded, so a resumed run uses the same model
        with _no_stray_open_clip_logs(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_WEIGHTS_SEED)
            return open_clip.create_model(name, pretrained=None, force_quick_gelu=gelu), name, None, gelu, None
    path = Path(pretrained).expanduser()
    if is_checkpoint_path(pretrained):
        if not path.is_file():
            raise WeightsUnavailableError(
                f"{pretrained}: checkpoint file not found (--pretrained takes an existing .pt/.pth/.bin/.safetensors file, an open_clip tag, or none)"
            )
        gelu = _is_torchscript_archive(path) if quick_gelu is None else quick_gelu
        digest = file_digest(path)  # before loading: the content these weights come from
        try:
            with _no_stray_open_clip_logs():
                model = open_clip.create_model(name, pretrained=str(path), force_quick_gelu=gelu)
        except Exception as e:  # wrong architecture, truncated file, ...
            raise WeightsUnavailableError(_checkpoint_error(path, name, e)) from e
        return model, name, str(path), gelu, digest
    cfg = open_clip.get_pretrained_cfg(name, pretrained)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(name)
        raise UserValueError(
            f"unknown pretrained tag {pretrained!r} for {name}; tags: {', '.join(tags) or '(none)'}; "
            f"or give a checkpoint path, or 'none'"
        )
    gelu = cfg.get("quick_gelu", False) if quick_gelu is None else quick_gelu
    unreachable = _unreachable_hub(cfg)
    try:
        with _no_stray_open_clip_logs(), _hub_offline(unreachable is not None):
            model = open_clip.create_model(name, pretrained=pretrained, force_quick_gelu=gelu, cache_dir=cache_dir)
    except Exception as e:
        why = f"{unreachable} is unreachable and the weights are not in the cache. " if unreachable else ""
        raise WeightsUnavailableError(why + _weights_help(name, pretrained)) from e
    return model, name, pretrained, gelu, None


def load_clip(
    model_name: str = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    device: str | torch.device | None = "auto",
    precision: str = "fp32",
    quick_gelu: bool | None = None,
    cache_dir: str | None = None,
    tokenizer: str | None = None,
) -> "DenseCLIP":
    """Load a frozen open_clip ViT for dense prediction.

    model_name: an open_clip name (`ViT-B-16`, `ViT-L-14`, ...) or a path to an open_clip model-config
        JSON file. pretrained: an open_clip tag (default `openai`), a local checkpoint file
        (.pt / .pth / .bin / .safetensors), or None / "none" for random weights.
    quick_gelu: None = what the weights were trained with (the tag's setting; True for OpenAI's own
        TorchScript checkpoints). precision: fp32, fp16 or bf16 (the weights are cast): bf16 runs the trunk's
        matrix products in bf16, on GPUs and on CPUs with AVX512-BF16 or AMX-BF16; the edited block's scores and
        normalizer, ln_post, the projection and everything after stay fp32 (`attention.precision`).
    tokenizer: for models with a Hugging Face tokenizer (SigLIP, MetaCLIP 2), a local directory holding
        its files, instead of the Hub id read from the local cache. Such a tokenizer is loaded at once
        with weights, and on the first text otherwise (random weights run offline, with a byte-level
        stand-in where the Hub tokenizer cannot be had: `models.tokenizers.HubTokenizer`).
    Raises WeightsUnavailableError with instructions when weights (or a Hub tokenizer) cannot be had.
    Every family comes back as a DenseCLIP holding the tower its family wraps (`tower.wrap_tower`).
    """
    if precision not in PRECISIONS:
        raise UserValueError(f"unknown precision {precision!r}; choose {', '.join(PRECISIONS)}")
    if isinstance(pretrained, str) and pretrained.lower() in ("", "none"):
        pretrained = None
    dev = resolve_device(device)
    check_precision(precision, dev)  # before the weights load
    model, name, weights, gelu, digest = _create_open_clip(model_name, pretrained, quick_gelu, cache_dir)
    import open_clip

    model = model.to(device=dev, dtype=PRECISIONS[precision]).eval().requires_grad_(False)
    config = open_clip.get_model_config(name)
    text_tokenizer = open_clip.get_tokenizer(name) if tokenizer is None and "hf_tokenizer_name" not in config["text_cfg"] else None
    if text_tokenizer is None:
        from .tokenizers import HubTokenizer

        text_tokenizer = HubTokenizer(name, config["text_cfg"], tokenizer, cache_dir, random_weights=weights is None)
        if weights is not None:
            text_tokenizer.load()  # fail before any image is read, as missing weights do
    return DenseCLIP(
        model=model,
        tokenizer=text_tokenizer,
        model_name=name,
        pretrained=weights or "none",
        precision=precision,
        quick_gelu=gelu,
        pretrained_sha256=digest,
        tower=wrap_tower(model, name, config),
    )


@dataclass
class DenseCLIP:
    """A frozen CLIP with text embeddings and dense (per-patch) image embeddings.

    `model` is the open_clip model with its weights untouched; specs are applied per call.
    quick_gelu: whether the activation is QuickGELU (it changes every embedding, so results record it).
    pretrained_sha256: the checkpoint file's content digest when `pretrained` is a file (`runtime.fingerprint`),
    taken when it was loaded: a checkpoint rewritten in place no longer matches results made before.
    tower: the image tower as its family wraps it (`tower.Tower`); default: the family of `model_name`'s
    open_clip configuration wraps `model` (`tower.wrap_tower`).
    """

    model: torch.nn.Module
    tokenizer: object
    model_name: str
    pretrained: str
    precision: str = "fp32"
    quick_gelu: bool = False
    # weights of the external backbones its `ext:` taps read (`proxies.ProxyBackbones`: "auto", "hub", "none", a
    # file or NAME=W,...) when the model runs them itself (`proxies`; a run passes its own); None: "auto",
    # which follows this CLIP's own weights: random backbones for a random CLIP)
    proxy_weights: str | None = None
    pretrained_sha256: str | None = None
    tower: Tower | None = field(default=None, repr=False, compare=False)
    _proxies: ProxyBackbones | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tower is None:
            self.tower = wrap_tower(self.model, self.model_name)

    @property
    def proxies(self) -> ProxyBackbones:
        """The external backbones this model's `ext:` taps run when it is called without a run's own
        (`context["backbones"]`, `segment.Resources`): following this CLIP, with `proxy_weights`."""
        if self._proxies is None or self._proxies.weights != (self.proxy_weights or "auto"):
            self._proxies = ProxyBackbones.following(self, self.proxy_weights)
        return self._proxies

    def _context(self, context: Mapping[str, Any] | None) -> dict:
        """The block context of one call: the caller's, with this model's backbones unless it brings its own."""
        return {"backbones": self.proxies, **(context or {})}

    def config(self) -> dict:
        """What identifies this model's numbers in a result file: name, weights, precision, activation,
        a checkpoint file's content digest, and the entmax attention backend selected now (see accel.py;
        AdaSplash is approximate)."""
        from ..runtime.accel import get_attention_backend

        return {
            "model": self.model_name,
            "pretrained": self.pretrained,
            "precision": self.precision,
            "quick_gelu": self.quick_gelu,
            "attention_backend": get_attention_backend(),
            # only for a checkpoint file: results made with a tag or random weights keep their configuration
            **({"pretrained_sha256": self.pretrained_sha256} if self.pretrained_sha256 else {}),
        }

    @property
    def visual(self) -> torch.nn.Module:
        """The image tower as the engine runs it (`tower.Tower.visual`): open_clip's VisionTransformer, or a
        family's adapter with the same `transformer.resblocks`, `ln_post` and `preprocess_cfg`."""
        return self.tower.visual

    @property
    def device(self) -> torch.device:
        return self.tower.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.dtype

    @property
    def patch_size(self) -> int:
        return self.tower.patch_size

    @property
    def embed_dim(self) -> int:
        return self.tower.embed_dim

    @property
    def mean(self) -> tuple[float, float, float]:
        return tuple(self.visual.preprocess_cfg["mean"])

    @property
    def std(self) -> tuple[float, float, float]:
        return tuple(self.visual.preprocess_cfg["std"])

    @property
    def prefix_tokens(self) -> int:
        """Tokens before the patch grid (open_clip ViTs: the CLS token; SigLIP: none)."""
        return self.tower.prefix_tokens

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp())

    @torch.inference_mode()
    def encode_text(
        self, texts: Sequence[str], batch_size: int = 256, advance: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """L2-normalised text embeddings, T x D (fp32), equal to open_clip's `encode_text` (to ~1e-7)
        but computed only up to each batch's longest prompt where that is exact (see text_tower.py).
        advance(n) is called as batches of n prompts finish."""
        if not texts:
            return torch.zeros(0, self.embed_dim)
        tokens = self.tokenizer(list(texts)).to(self.device)
        return F.normalize(encode_tokens(self.model, tokens, batch_size, advance).float(), dim=-1)

    def positional_embedding(self, grid: tuple[int, int], rule: str = "size") -> torch.Tensor | None:
        """Positional embeddings for a patch grid, by the tower's family (open_clip ViTs: (1 + h*w) x C,
        bicubic from the native grid; timm towers: timm's resampling, None without absolute positions).

        rule "size": interpolate to exactly `grid` (source coordinate (i + 0.5) * native / h - 0.5).
        rule "scale": the published repositories' `interpolate_pos_encoding` (SCLIP, NACLIP, ClearCLIP,
        from DINO): `scale_factor=(h + 0.1) / native`, so the source coordinate is
        (i + 0.5) * native / (h + 0.1) - 0.5; and, as there, the native embedding is used unchanged
        whenever the token count matches (so a non-square grid of native-many patches gets it too).
        """
        _check_rule(rule)
        return self.tower.positional_embedding(grid, rule)

    @property
    def depth(self) -> int:
        """Number of transformer blocks of the image tower."""
        return len(self.visual.transformer.resblocks)

    def check_spec(self, spec: AttentionSpec | str | None) -> None:
        """UserValueError, before any image is read, for a spec this model cannot run (`layers:N` past its depth, a
        tap reading a block it does not have; a `dna:PATH` adapter that is missing, changed or made for another model)."""
        spec = resolve_spec(spec)
        reason = self.tower.refuse(spec, self.model_name)  # what its family cannot run (SigLIP: no CLS token)
        if reason:
            raise UserValueError(f"attention spec {spec}: {reason}")
        attention_blocks.check_depth(spec, self.depth)
        self._tower(spec)

    def _embed(self, pixels: torch.Tensor, pos_interp: str = "size") -> tuple[torch.Tensor, tuple[int, int]]:
        """Tokens B x (P + h*w) x C entering the first block (P prefix tokens: the CLS, none for SigLIP), and
        the patch grid (h, w); `pos_interp` as in `positional_embedding`. Every image forward starts here."""
        ps = self.patch_size
        H, W = pixels.shape[-2:]
        if H % ps or W % ps:
            raise ValueError(f"input {H}x{W} is not a multiple of the patch size {ps}")
        _check_rule(pos_interp)
        return self.tower.embed(pixels.to(device=self.device, dtype=self.dtype), pos_interp)

    @torch.inference_mode()
    def encode_dense(
        self,
        pixels: torch.Tensor,
        spec: AttentionSpec | str | None = None,
        token_hooks: Sequence[Callable] = (),
        with_cls: bool = False,
        pos_interp: str = "size",
        context: Mapping[str, Any] | None = None,
        regions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Dense features B x h x w x D, after ln_post and proj, L2-normalised, CLS dropped.

        pixels: B x 3 x H x W CLIP-normalised, H and W multiples of the patch size; h = H / patch.
        spec: AttentionSpec, its text form or a preset name (None = unmodified CLIP).
        token_hooks: token stages (stages.py), each `hook(x, grid) -> x` on the B x (1 + h*w) x C
        hidden states entering the edited blocks, in order, after those the spec names (`hook:`).
        with_cls: also return the CLS embeddings B x D (L2-normalised; in parallel mode the original
        path's, i.e. CLIP's image embedding), for match stages such as CLIP Surgery's feature surgery.
        pos_interp: the positional-embedding rule, "size" or the published repositories' "scale" (see
        `positional_embedding`). context: what a spec's `feedback` term (ResCLIP) reads: `text`, the
        T x D L2-normalised name embeddings, and `logit_scale` (see `attention.feedback`); `raw_features`
        True: the features unnormalised; `image_features` (see `attention.blocks.encode_tokens`).
        regions: B x H x W integer region ids of the pixels (-1 unsegmented), for specs that read region
        maps (CorrCLIP's `region:EPS` support and `mct:BETA` branch).
        """
        return self.dense_forward(pixels, spec, token_hooks, with_cls, pos_interp, context, regions)

    def dense_forward(
        self,
        pixels: torch.Tensor,
        spec: AttentionSpec | str | None = None,
        token_hooks: Sequence[Callable] = (),
        with_cls: bool = False,
        pos_interp: str = "size",
        context: Mapping[str, Any] | None = None,
        regions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`encode_dense` with autograd left as the caller set it (training DnA's branch on dense targets)."""
        spec = resolve_spec(spec)
        x, grid = self._embed(pixels, pos_interp)
        x = attention_blocks.encode_normed(self._tower(spec), x, spec, grid, self._final_norm(), pixels, token_hooks, regions, self._context(context))
        out_grid = attention_grid(spec, tuple(pixels.shape[-2:]), grid)  # an external backbone's (ProxyCLIP)
        n = out_grid[0] * out_grid[1]
        if (context or {}).get("raw_features"):  # unnormalised projections (CorrCLIPv2's bank values)
            feats = (x[:, -n:] @ self.visual.proj).float().reshape(x.shape[0], *out_grid, -1)
            return (feats, self._dense_and_image(x, n)[1]) if with_cls else feats
        if not with_cls:
            return self._features(x[:, -n:]).reshape(x.shape[0], *out_grid, -1)
        feats, image = self._dense_and_image(x, n)
        return feats.reshape(x.shape[0], *out_grid, -1), image

    @torch.inference_mode()
    def dense_tokens(
        self,
        pixels: torch.Tensor,
        spec: AttentionSpec | str | None = None,
        token_hooks: Sequence[Callable] = (),
        pos_interp: str = "size",
        context: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """B x h x w x C patch tokens after the last block, before ln_post (the width of the transformer):
        what Trident splices across windows before its global stage; `project` finishes them. context: as in
        `encode_dense` (a run's backbones)."""
        x, out_grid = self._last_tokens(pixels, spec, token_hooks, pos_interp, context)
        return x[:, -out_grid[0] * out_grid[1] :].reshape(x.shape[0], *out_grid, -1)

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        """ln_post, proj and L2 normalisation (fp32) of ... x C tokens: ... x D features."""
        return self._features(self._final_norm()(tokens))

    def _final_norm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """ln_post as the model runs it (`tower.Tower.final_norm`)."""
        return self.tower.final_norm()

    def _features(self, normed: torch.Tensor) -> torch.Tensor:
        """L2-normalised fp32 features of tokens after ln_post (`tower.Tower.features`)."""
        return self.tower.features(normed)

    def _dense_and_image(self, normed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of the last n tokens (B x n x D) and the L2-normalised image embedding (B x D) of all tokens
        after ln_post (B x N x C): the CLS token's, or a timm tower's pooling head's (`tower.Tower.dense_and_image`)."""
        return self.tower.dense_and_image(normed, n)

    def _last_tokens(self, pixels, spec, token_hooks, pos_interp, context: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """All tokens B x N x C after the edited blocks, and the grid their patch tokens (the last N' = h*w)
        lie on: CLIP's, or an external backbone's (ProxyCLIP)."""
        spec = resolve_spec(spec)
        x, grid = self._embed(pixels, pos_interp)
        x = attention_blocks.encode_tokens(self._tower(spec), x, spec, grid, pixels, token_hooks, context=self._context(context))
        return x, attention_grid(spec, tuple(pixels.shape[-2:]), grid)

    @torch.inference_mode()
    def attention_maps(
        self,
        pixels: torch.Tensor,
        spec: AttentionSpec | str | None = None,
        regions: torch.Tensor | None = None,
        pos_interp: str = "size",
        context: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """B x H x N x N attention of the last edited block; see `clipseg_sparse.attention.attention_maps`.
        pos_interp and context: as in `encode_dense` (`image_features`: the whole-image backbone features'
        crops that CorrCLIPv2's `ext:NAME.image` taps score with)."""
        spec = resolve_spec(spec)
        x, grid = self._embed(pixels, pos_interp)
        return attention_blocks.attention_maps_from_tokens(self._tower(spec), x, spec, grid, pixels, regions, self._context(context)).float()

    def _tower(self, spec: AttentionSpec):
        """What the blocks run from: the image tower, or the view of it a spec option's `tower` hook gives
        (`dna:PATH`: its adapter blocks run DnA on these same weights; nothing is patched in place)."""
        for name, arg in spec.extras:
            tower = OPTIONS.get(name).tower
            if tower is not None:
                return tower(self, arg)
        return self.visual
