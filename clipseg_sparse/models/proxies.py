"""The engine's `ext:NAME` score tap: attention scores from an external backbone's features.

`ext:dino_vitb8` runs the registered backbone (`ls backbones`) on the same crop CLIP sees (CLIP's
normalisation undone, the backbone's applied: ProxyCLIP's `norm(unnorm(img))`) and gives its last
normed patch tokens as features on its own patch grid, shared by all heads; `ext:dino_vitb8.qk` gives
q + k of its last block (CorrCLIP); `ext:dino_vitb8.out` the output of its last block re-run over the
whole image's stitched grid (OV-Stitcher, only with the `stitch:M` option: the `stitched` forward, `methods/ovstitcher.py`); `ext:NAME.image`
reads a dense backbone's features computed once on the whole image (`Backbone.image_features`, CorrCLIPv2: at
the network input's size, L2-normalised), cropped like the window, resized bilinearly to twice CLIP's patch grid
and L2-normalised again (a grid of the published `feat_shape`, not the backbone's patch grid). The term's metric, shift/scale and support then apply as for any
tap. When that grid differs from CLIP's (DINO B/8: 42 x 42 for a 336 crop vs 21 x 21), CLIP's values
are bilinearly resized to it and the block's output lives on it (`grid` of the tap), as in ProxyCLIP.

Backbones are loaded once per run and device and held by that run's `ProxyBackbones` (`segment.Resources`;
a DenseCLIP called alone holds its own, `DenseCLIP.proxies`), with the weights it was given (default: the
Hub tag, or random weights when the CLIP model itself has none); `ProxyBackbones.use` installs one you
loaded yourself. The taps reach them through the block context (`BlockContext.extra["backbones"]`).
ProxyCLIP's presets, which use this tap, are in `methods/proxyclip.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.nn.functional as F

from ..attention.taps import TAPS, Tap
from ..errors import UserValueError
from ..runtime.fingerprint import file_digest
from ..stages import Needs
from ..runtime.weights import hub_unavailable
from .backbones import BACKBONES, MASK_KINDS, Backbone, hub_repo, hub_weights_cached, load_backbone, resize_matrix

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
EXT_FEATURES = {"": "tokens", "qk": "qkv", "out": "penult", "image": "tokens"}
#: `ext:NAME.image` lives on this many cells per CLIP patch side (CorrCLIPv2's feat_shape = 2 x CLIP's grid)
IMAGE_GRID_SCALE = 2


@dataclass
class ProxyBackbones:
    """The external backbones one run uses (`ext:` taps, stages), loaded once per name and device and held
    here, not process-wide: two runs with other weights in one process each use their own. weights: "auto"
    (random when the CLIP weights are none, else "hub"), "hub", "none" or a checkpoint file (used for every
    backbone), or per backbone `NAME=W,NAME=W` (Trident: a DINO and a SAM checkpoint; backbones not named:
    "auto"). The backbones see CLIP's crops, so they follow its normalisation and precision."""

    weights: str = "auto"
    clip_weights: str = "openai"
    precision: str = "fp32"
    clip_mean: tuple[float, float, float] = OPENAI_MEAN
    clip_std: tuple[float, float, float] = OPENAI_STD
    _loaded: dict = field(default_factory=dict, repr=False)
    _held: dict = field(default_factory=dict, repr=False)

    @classmethod
    def following(cls, clip, weights: str | None = None) -> "ProxyBackbones":
        """Backbones for a DenseCLIP: its normalisation, precision and weights (for "auto")."""
        return cls(weights or "auto", clip.pretrained, clip.precision, tuple(clip.mean), tuple(clip.std))

    def resolved_weights(self, name: str | None = None) -> str:
        """The weights `name` loads with ("hub", "none" or a file)."""
        weights = self.weights
        if "=" in weights:
            per = dict(item.split("=", 1) for item in weights.split(",") if item)
            unknown = sorted(set(per) - set(BACKBONES.names()))
            if unknown:
                raise UserValueError(f"--proxy-weights: unknown backbone {unknown[0]!r} (see `ls backbones`)")
            weights = per.get(name, "auto")
        if weights == "auto":
            return "none" if self.clip_weights == "none" else "hub"
        return weights

    def get(self, name: str, device: torch.device | str) -> Backbone:
        """Backbone `name` on `device`, loaded on first use."""
        key = (name, str(torch.device(device)))
        if key not in self._loaded:
            self._loaded[key] = load_backbone(name, self.resolved_weights(name), device=device, precision=self.precision)
        return self._loaded[key]

    def use(self, backbone: Backbone, device: str | torch.device = "cpu") -> None:
        """Use this loaded backbone for `ext:{backbone.info.name}` on `device` (one built with other weights,
        or a small model in tests)."""
        self._loaded[(backbone.info.name, str(torch.device(device)))] = backbone

    def share(self, other: "ProxyBackbones") -> None:
        """Use `other`'s loaded backbones where this set would load the same ones (weights and precision):
        a bank's second CLIP reads DINO through its own normalisation but does not load it again."""
        if self.precision != other.precision:
            return
        for (name, device), backbone in other._loaded.items():
            if self.resolved_weights(name) == other.resolved_weights(name):
                self._loaded.setdefault((name, device), backbone)

    def held(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """What a stage loads itself (SAM's predictor), made once per key and held with these backbones."""
        if key not in self._held:
            self._held[key] = make()
        return self._held[key]

    def config(self, names: Sequence[str]) -> dict:
        """Backbone name -> timm tag, weights and precision, for result files (nothing is loaded)."""
        out = {}
        for name in names:
            loaded = [b for (n, _), b in self._loaded.items() if n == name]
            weights = loaded[0].weights if loaded else self.resolved_weights(name)
            tag = BACKBONES.get(name).timm_name
            out[name] = {"timm": tag, "weights": tag if weights == "hub" else weights, "precision": self.precision}
            if weights not in ("hub", "none") and Path(weights).is_file():  # a checkpoint: its content, too
                out[name]["sha256"] = file_digest(weights)
        return out

    def record(self, names: Sequence[str]) -> dict:
        """`{"proxy_backbones": {...}}` for these backbone names (result files), else {}."""
        return {"proxy_backbones": self.config(names)} if names else {}


def missing_weights(names: Sequence[str], clip) -> dict[str, str]:
    """Backbone -> why its weights cannot be had now, for those of `names` that cannot, with the weights
    `clip` would give them (`clip.proxy_weights`, default "auto"): a checkpoint file that does not exist, or
    Hub weights not in the Hugging Face cache while the Hub cannot be reached. Looks at files only (one
    reachability probe when some weights are not cached): nothing is loaded or downloaded. Random weights
    (with a random CLIP, as in tests) are always there."""
    chosen = ProxyBackbones(weights=clip.proxy_weights or "auto", clip_weights=clip.pretrained)
    missing, uncached = {}, []
    for name in names:
        weights = chosen.resolved_weights(name)
        if weights == "hub" and not hub_weights_cached(BACKBONES.get(name)):
            uncached.append(name)
        elif weights not in ("hub", "none") and not Path(weights).expanduser().is_file():
            missing[name] = f"{name}'s checkpoint file {weights} is not found"
    offline = hub_unavailable(hub_repo(BACKBONES.get(uncached[0]))) if uncached else None
    if offline:
        for name in uncached:
            missing[name] = f"{name}'s weights ({hub_repo(BACKBONES.get(name))}) are not in the Hugging Face cache and {offline}"
    return missing


def split_ext(arg: str) -> tuple[str, str]:
    """`dino_vitb8.qk` -> ("dino_vitb8", "qk"); UserValueError for an unknown backbone or feature."""
    name, _, feature = arg.partition(".")
    info = BACKBONES.get(name)
    if info.kind in MASK_KINDS:
        raise UserValueError(f"ext:{arg}: {name} makes region masks, not features")
    if feature not in EXT_FEATURES:
        raise UserValueError(f"ext:{arg}: unknown feature {feature!r}; use ext:NAME (last normed tokens), ext:NAME.qk, ext:NAME.out (with stitch:M) or ext:NAME.image")
    if feature == "qk" and "qkv" not in info.features:
        raise UserValueError(f"ext:{arg}: {name} exposes no last-block q/k; use ext:{name} or ext:{name}.image")
    if feature == "image" and info.kind != "dense":
        raise UserValueError(f"ext:{arg}: {name} gives no whole-image feature map; .image needs a dense backbone (`ls backbones`)")
    return name, feature


def proxy_grid(arg: str, pixels: tuple[int, int], clip_grid: tuple[int, int] | None = None) -> tuple[int, int]:
    """The backbone's patch grid for a crop of `pixels` (H, W); for `.image`, IMAGE_GRID_SCALE x CLIP's grid."""
    name, feature = split_ext(arg)
    info = BACKBONES.get(name)
    if feature == "image":
        if clip_grid is None:
            raise ValueError(f"ext:{arg}: the grid of whole-image features follows CLIP's patch grid (none given)")
        return clip_grid[0] * IMAGE_GRID_SCALE, clip_grid[1] * IMAGE_GRID_SCALE
    if info.input_size:
        return (info.input_size // info.patch_size,) * 2
    return pixels[0] // info.patch_size, pixels[1] // info.patch_size


def ext_features(pixels: torch.Tensor, arg: str, backbones: ProxyBackbones) -> torch.Tensor:
    """B x 1 x M x C features of `ext:arg` for CLIP-normalised pixels (B x 3 x H x W)."""
    name, feature = split_ext(arg)
    if feature == "out":
        raise UserValueError(f"ext:{arg}: the proxy's last block re-run over the stitched image exists only in the stitched forward "
                             f"(a spec with stitch:M, run by Segmenter); this call encodes windows alone")
    backbone = backbones.get(name, pixels.device)
    x = backbone.from_clip_pixels(pixels.float(), backbones.clip_mean, backbones.clip_std)
    out = backbone.features(x, want=(EXT_FEATURES[feature],))
    if feature == "qk":
        B, H, M, d = out.q.shape
        f = (out.q + out.k).transpose(1, 2).reshape(B, M, H * d)
    else:
        f = out.tokens
    return f[:, None].to(pixels.dtype)


@dataclass(frozen=True)
class WholeImageFeatures:
    """A dense backbone's whole-image features as CorrCLIPv2 reads them (`ext:NAME.image`): the raw patch-grid map
    (`Backbone.image_feature_map`, 1 x C x h x w) resized bilinearly to the network input's `size` and
    L2-normalised per pixel (`resized_features`), each window's crop of that (replicate-padded) resized
    bilinearly to the tap's grid and L2-normalised again. Held as the raw map: a window computes only the
    input-size pixels its grid's bilinear taps read (84 x 84 of a 336 x 336 window for a 42 x 42 grid), so
    neither the C x H x W map at the input size (C-RADIOv3-L at 448 x 597: 1.1 GB) nor its crops are made."""

    raw: torch.Tensor
    size: tuple[int, int]

    def windows(self, boxes: Sequence[tuple[int, int, int, int]], pad: tuple[int, int, int, int]) -> "WindowFeatures":
        """The windows' crops (y1, y2, x1, x2 boxes of the input), padded (left, right, top, bottom) as
        the windows forward pads them: replicating the border, negative amounts cutting (remainder `drop`)."""
        return WindowFeatures(self, tuple(boxes), pad)


@dataclass(frozen=True)
class WindowFeatures:
    """A batch of windows' crops of `WholeImageFeatures`, resized to a grid on demand (`at`)."""

    source: WholeImageFeatures
    boxes: tuple[tuple[int, int, int, int], ...]
    pad: tuple[int, int, int, int]

    def at(self, grid: tuple[int, int]) -> torch.Tensor:
        """B x 1 x M x C (M = grid cells): each crop resized bilinearly (align_corners False) to `grid` and
        L2-normalised, from the input-size pixels it reads alone (the same products within float rounding)."""
        raw = self.source.raw[0].float()  # C x h x w
        (h, w), (H, W) = raw.shape[1:], self.source.size
        left, right, top, bottom = self.pad
        out = []
        for y1, y2, x1, x2 in self.boxes:
            rows, ly = _window_taps(y1, y2, top, bottom, grid[0], H)
            cols, lx = _window_taps(x1, x2, left, right, grid[1], W)
            ry, rx = (resize_matrix(n, full)[need].to(raw) for n, full, need in ((h, H, rows), (w, W, cols)))
            pixels = F.normalize(torch.matmul(torch.matmul(ry, raw), rx.T), dim=0)  # C x rows x cols of the input-size map
            cells = torch.matmul(torch.matmul(ly.to(raw), pixels), lx.to(raw).T)  # C x grid
            out.append(F.normalize(cells.flatten(1).T, dim=-1))
        return torch.stack(out)[:, None]


def window_image_features(crops: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """B x 1 x M x C: crops of whole-image features given as a tensor (B x C x h x w, e.g. to `attention_maps`'s
    context) resized bilinearly (align_corners False) to `grid` and L2-normalised (CorrCLIPv2's forward_feature)."""
    f = F.interpolate(crops.float(), size=tuple(grid), mode="bilinear", align_corners=False)
    return F.normalize(f.flatten(2).transpose(1, 2), dim=-1)[:, None]


def _window_taps(start: int, stop: int, before: int, after: int, cells: int, full: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Along one axis of a window [start, stop) of an input of length `full`, padded by `before` / `after`
    (replicate; negative: cut): (the input indices the crop's resize to `cells` reads, cells x len(indices)
    weights). Replicated positions read the border index, so their weights add up on it."""
    low, high = start + max(-before, 0), stop - max(-after, 0)
    length = stop - start + before + after
    source = (start - before + torch.arange(length)).clamp(low, high - 1)
    weights = torch.zeros(cells, full).index_add_(1, source, resize_matrix(length, cells))
    need = (weights != 0).any(0).nonzero()[:, 0]
    return need, weights[:, need]


def _ext_tap(ctx, arg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The tap's features, computed once per batch of windows (kept in ctx.extra: the extra inputs of the
    block and CorrCLIP's region merging read the same backbone run)."""
    key = ("ext", arg)
    if key not in ctx.extra:
        name, feature = split_ext(arg)
        if feature == "image":
            if ("image", name) not in ctx.extra:
                raise ValueError(f"ext:{arg} reads whole-image features: run it through Segmenter (it computes them once per image)")
            grid = proxy_grid(arg, tuple(ctx.pixels.shape[-2:]), ctx.grid)
            feats = ctx.extra[("image", name)]
            feats = feats.at(grid) if isinstance(feats, WindowFeatures) else window_image_features(feats, grid)
            ctx.extra[key] = feats.to(ctx.pixels.dtype)
        else:
            if "backbones" not in ctx.extra:
                raise ValueError(f"ext:{arg} runs a backbone: give the block context the run's backbones (context={{'backbones': ...}}; DenseCLIP passes its own)")
            ctx.extra[key] = ext_features(ctx.pixels, arg, ctx.extra["backbones"])
    return (ctx.extra[key],) * 2


def _ext_needs(arg: str) -> Needs:
    name, feature = split_ext(arg)
    return Needs(backbones=(name,), image_features=(name,) if feature == "image" else ())


TAPS.register(
    "ext",
    Tap(features=_ext_tap, check=lambda arg: split_ext(arg) and None, grid=proxy_grid, needs=_ext_needs),
    help="ext:NAME[.qk|.image] (an external backbone's last tokens, last-block q+k, or whole-image features on 2x CLIP's grid; `ls backbones`)",
)
