"""External vision backbones (DINO, DINOv2, SAM, SAM2) that lend their features to CLIP's attention.

ProxyCLIP, CorrCLIP and Trident borrow the last block's attention from a second, vision-only model.
Those repositories load it through torch.hub (the DINO repository's own ViT) or SAM's own code; here
the same weights come from timm (Hugging Face Hub tags `timm/...`, cached like CLIP's), and SAM2's
automatic mask generator from the `sam2` package (extra `.[proxy]`). CorrCLIPv2's foundation models
(C-RADIOv3, DINOv3, DINOv2-L with registers) are kind "dense": timm's `forward_intermediates` gives their
last-block feature map, on a window (`ext:NAME`) or once on the whole image (`image_features`, the
published `vfms/factory.py` `extract_dense`). `BACKBONES` (`ls backbones`)
records for each: its timm name, normalisation, patch size, the features it exposes, how the
published code resizes its positional embedding, and how that code loads it.

Where timm computes differently from the published loader on the same weights, `VitBackbone`
follows the published code: DINO's `interpolate_pos_encoding` resizes the 14 x 14 (B/16) or 28 x 28
(B/8) grid with bicubic `scale_factor=(n + 0.1) / sqrt(N)`, not timm's antialiased resize to the exact
size (0.19 apart at 336 px, research/peers-sota.md section 6). DINOv2-with-registers' hub code uses
the antialiased exact-size resize (`interpolate_offset=0`, `interpolate_antialias=True`), as timm does.

"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..registry import Registry
from ..runtime.device import PRECISIONS, resolve_device
from ..runtime.weights import RANDOM_WEIGHTS_SEED, WeightsUnavailableError, _hub_offline, _unreachable_hub, _weights_help, is_checkpoint_path

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FEATURES = ("tokens", "qkv", "attn")  # last normed patch tokens, last-block q/k/v, last-block attention maps
# ViTs also give the penultimate block's output after the final norm (DINO's get_intermediate_layers(n=2)[0]):
# OV-Stitcher re-runs the last block image-wide on it (the `stitched` forward, methods/ovstitcher.py)
VIT_FEATURES = FEATURES + ("penult",)
# SAM also gives the hidden state entering its last block, from which `Backbone.sam_embedding` finishes the pass:
# Trident's `sam` stage reads the last block's q, k, v and leaves its prompt refinement the image embedding to finish
SAM_FEATURES = FEATURES + ("last_input",)
POS_RULES = ("dino", "antialias", "fixed", "timm")
MASK_KINDS = ("sam2-masks", "sam3-masks")  # mask generators: region sources and the sam3 baseline, no features


def resize_matrix(src: int, dst: int) -> torch.Tensor:
    """dst x src weights of 1-D linear resizing (align_corners=False), the per-axis part of bilinear."""
    return F.interpolate(torch.eye(src)[None], size=dst, mode="linear", align_corners=False)[0].T


def resized_features(feature_map: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """B x C x h x w map resized bilinearly (align_corners False) to `size` and L2-normalised per pixel
    (CorrCLIPv2's whole-image features at the network input)."""
    return F.normalize(F.interpolate(feature_map, size=tuple(size), mode="bilinear", align_corners=False), dim=1)


@dataclass(frozen=True)
class BackboneInfo:
    """What a registered backbone is and how the published methods use it.

    timm_name: timm model name with its pretrained tag (`vit_base_patch8_224.dino`); for the mask
    generators (`MASK_KINDS`) the Hugging Face model id of the checkpoint. pos_rule: how positional embeddings
    are resized to the input's grid: "dino" (DINO repository: bicubic, scale_factor (n + 0.1) / sqrt(N)),
    "antialias" (exact size, bicubic with antialias: DINOv2-reg hub and timm), "fixed" (input resized to
    `input_size`, SAM), "timm" (the timm model's own rule at any size: RADIO's cropped position
    embeddings, DINOv3's RoPE). features: which of FEATURES the backbone exposes.
    """

    name: str
    kind: str  # "vit" | "samvit" | "dense" (timm forward_intermediates feature maps) | one of MASK_KINDS
    timm_name: str
    patch_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    features: tuple[str, ...]
    pos_rule: str
    published: str  # how the published methods load it
    input_size: int | None = None  # fixed square input (SAM: 1024)
    # LayerNorm eps of the published model where timm's default differs (timm's samvit keeps torch's 1e-5;
    # segment_anything builds its image encoder with 1e-6); None: timm's (DINO, DINOv2: 1e-6, as published)
    norm_eps: float | None = None
    final_norm: bool = False  # dense: the last feature map passes the model's final norm (DINO get_intermediate_layers)
    dynamic_size: bool = False  # built with timm's dynamic_img_size=True (any input size; NaFlexViT needs no flag)

    def timm_kwargs(self) -> dict:
        """Keyword arguments that make timm build the model as the published code does (and at any input
        size for the dense backbones that need timm's flag)."""
        kwargs = {"norm_layer": partial(torch.nn.LayerNorm, eps=self.norm_eps)} if self.norm_eps is not None else {}
        return {**kwargs, **({"dynamic_img_size": True} if self.dynamic_size else {})}

    def describe(self, help: str) -> dict[str, str]:
        """`ls backbones`: timm tag, patch, features, positional rule and the published loader (which the
        help repeats)."""
        return {
            "kind": self.kind, "timm / hub id": self.timm_name, "patch": str(self.patch_size),
            "features": ", ".join(self.features) or "region masks", "positions": self.pos_rule, "published loader": self.published,
        }


BACKBONES: Registry[BackboneInfo] = Registry("backbone")


def _register(info: BackboneInfo) -> None:
    BACKBONES.register(info.name, info, help=f"{info.timm_name}: {info.published}")


_register(BackboneInfo(
    "dino_vitb8", "vit", "vit_base_patch8_224.dino", 8, IMAGENET_MEAN, IMAGENET_STD, VIT_FEATURES, "dino",
    "torch.hub facebookresearch/dino dino_vitb8 (ProxyCLIP, CorrCLIP)",
))
_register(BackboneInfo(
    "dino_vitb16", "vit", "vit_base_patch16_224.dino", 16, IMAGENET_MEAN, IMAGENET_STD, VIT_FEATURES, "dino",
    "torch.hub facebookresearch/dino dino_vitb16 (Trident)",
))
_register(BackboneInfo(
    "dinov2_vitb14_reg", "vit", "vit_base_patch14_reg4_dinov2.lvd142m", 14, IMAGENET_MEAN, IMAGENET_STD,
    VIT_FEATURES, "antialias", "torch.hub facebookresearch/dinov2 dinov2_vitb14_reg (ProxyCLIP option)",
))
_register(BackboneInfo(
    "sam_vitb", "samvit", "samvit_base_patch16.sa1b", 16, IMAGENET_MEAN, IMAGENET_STD, SAM_FEATURES, "fixed",
    "segment_anything sam_vit_b_01ec64.pth image encoder at 1024 x 1024 (ProxyCLIP option, Trident)",
    input_size=1024, norm_eps=1e-6,
))
_register(BackboneInfo(
    "sam2_hiera_l", "sam2-masks", "facebook/sam2-hiera-large", 16, IMAGENET_MEAN, IMAGENET_STD, (), "fixed",
    "sam2 SAM2AutomaticMaskGenerator, Hiera-L (CorrCLIP region masks)", input_size=1024,
))
_register(BackboneInfo(
    "sam3", "sam3-masks", "facebook/sam3", 14, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), (), "fixed",
    "SAM 3, text-prompted (preset sam3, --regions sam3): transformers Sam3Model on any device (W: hub, a Hub id, a folder, none), or the sam3 package on CUDA (W: package:hub, FILE.pt)", input_size=1008,
))


# CorrCLIPv2's foundation models (zdk258/CorrCLIP@103bc18 CorrCLIPv2/vfms/factory.py): whole-image features
# at the nearest multiple of the patch (RADIO's get_nearest_supported_resolution, NVlabs/RADIO
# radio/radio_model.py; the DINO branch's round(H / patch) * patch), last feature map as NCHW. RADIO: [0, 1]
# input, OpenAI CLIP mean/std inside its input conditioner, the model's final norm replaced by Identity
# (spatial features without norm, as timm's port); DINOv2/v3: ImageNet mean/std, get_intermediate_layers'
# final norm.
_DENSE = "dense"
for _size, _arch in (("b", "base"), ("l", "large"), ("h", "huge")):
    _register(BackboneInfo(
        f"c_radio_v3_{_size}", _DENSE, f"naflexvit_{_arch}_patch16_radio_v3.c_radio", 16, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
        ("tokens",), "timm",
        f"torch.hub NVlabs/RADIO radio_model version='c-radio_v3-{_size}'" + (" (CorrCLIPv2's VFM)" if _size == "l" else ""),
    ))
for _size, _arch in (("s", "small"), ("b", "base"), ("l", "large")):
    _register(BackboneInfo(
        f"dinov3_vit{_size}16", _DENSE, f"vit_{_arch}_patch16_dinov3.lvd1689m", 16, IMAGENET_MEAN, IMAGENET_STD, ("tokens",),
        "timm", f"DINOv3 hub dinov3_vit{_size}16" + (" (CorrCLIPv2 option)" if _size == "l" else ""), final_norm=True,
        dynamic_size=True,
    ))
_register(BackboneInfo(
    "dinov2_vitl14_reg", _DENSE, "vit_large_patch14_reg4_dinov2.lvd142m", 14, IMAGENET_MEAN, IMAGENET_STD, ("tokens",),
    "timm", "torch.hub facebookresearch/dinov2 dinov2_vitl14_reg (CorrCLIPv2 option)", final_norm=True, dynamic_size=True,
))


def create_backbone_model(info: BackboneInfo, pretrained: str | None, cache_dir: str | None = None) -> tuple[torch.nn.Module, str]:
    """(timm model, weights id). pretrained: "hub" (the registered tag, Hub cache), a local checkpoint
    file (the published release, e.g. dino_vitbase8_pretrain.pth or sam_vit_b_01ec64.pth: timm converts
    it), or None for seeded random weights. Raises WeightsUnavailableError (one line) when unobtainable."""
    import timm


    arch = info.timm_name.split(".")[0]
    if pretrained is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_WEIGHTS_SEED)
            return timm.create_model(info.timm_name, pretrained=False, num_classes=0, **info.timm_kwargs()), "none"
    path = Path(pretrained).expanduser()
    if is_checkpoint_path(pretrained):
        if not path.is_file():
            raise WeightsUnavailableError(f"{pretrained}: backbone checkpoint file not found (give an existing .pth/.bin/.safetensors file, 'hub' or 'none')")
        try:
            model = timm.create_model(info.timm_name, pretrained=True, num_classes=0, pretrained_cfg_overlay={"file": str(path)}, **info.timm_kwargs())
        except Exception as e:  # wrong architecture, truncated file, ...
            raise WeightsUnavailableError(f"{pretrained}: cannot load as {arch} weights: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        return model, str(path)
    if pretrained != "hub":
        raise UserValueError(f"backbone weights must be 'hub', a checkpoint file or 'none' (got {pretrained!r})")
    path = _hub_checkpoint(info, pretrained, cache_dir)  # before building the model: fails fast offline
    return timm.create_model(info.timm_name, pretrained=True, num_classes=0, pretrained_cfg_overlay={"file": path}, **info.timm_kwargs()), info.timm_name


HUB_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the names timm's Hub repositories use, tried in order


def hub_repo(info: BackboneInfo) -> str:
    """The Hugging Face Hub repository of the registered timm tag (timm's registry: nothing is downloaded)."""
    import timm

    repo = timm.models.get_pretrained_cfg(info.timm_name).hf_hub_id.rstrip("/")
    return f"timm/{info.timm_name}" if repo == "timm" else repo


def hub_weights_cached(info: BackboneInfo) -> bool:
    """Whether the registered tag's weights file is in the Hugging Face cache, so `load_backbone(..., "hub")`
    loads it offline; looks at the cache only (no download, no model built)."""
    from huggingface_hub import try_to_load_from_cache

    repo = hub_repo(info)
    return any(isinstance(try_to_load_from_cache(repo, f), str) for f in HUB_WEIGHT_FILES)


def _hub_checkpoint(info: BackboneInfo, pretrained: str, cache_dir: str | None) -> str:
    """Local path of the registered tag's weights file: the Hugging Face Hub cache, downloaded on first use."""
    from huggingface_hub import hf_hub_download

    repo = hub_repo(info)
    error: Exception | None = None
    unreachable = _unreachable_hub({"hf_hub": repo})  # CLIP's fast offline probe: seconds, not a minute of retries
    for filename in HUB_WEIGHT_FILES:
        try:
            with _hub_offline(unreachable is not None):
                return hf_hub_download(repo, filename, cache_dir=cache_dir)
        except Exception as e:  # offline, not cached, or this file name absent
            error = error or e
    why = f"{unreachable} is unreachable and the weights are not in the cache. " if unreachable else ""
    raise WeightsUnavailableError(why + _weights_help(f"backbone {info.name} ({info.timm_name})", pretrained, "--proxy-weights")) from error


# -- positional embeddings ---------------------------------------------------------------------------
def dino_pos_embed(pos: torch.Tensor, pixels: tuple[int, int], patch: int) -> torch.Tensor:
    """DINO's `interpolate_pos_encoding`: pos 1 x (1 + N) x C (CLS first, sqrt(N) x sqrt(N) grid) for an
    input of `pixels` (H, W). Kept as published: native size only when N matches and H == W; otherwise
    bicubic with scale_factor ((H/p + 0.1) / sqrt(N), (W/p + 0.1) / sqrt(N)) (align_corners False), which
    maps coordinates with that scale, not with out/in."""
    n_pos = pos.shape[1] - 1
    H, W = pixels
    gh, gw = H // patch, W // patch
    if gh * gw == n_pos and H == W:
        return pos
    n = int(math.sqrt(n_pos))
    grid = pos[:, 1:].reshape(1, n, n, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((gh + 0.1) / math.sqrt(n_pos), (gw + 0.1) / math.sqrt(n_pos)), mode="bicubic")
    if tuple(grid.shape[-2:]) != (gh, gw):
        raise ValueError(f"DINO position interpolation gave a {tuple(grid.shape[-2:])} grid for {gh}x{gw} patches")
    return torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, gh * gw, -1)], dim=1)


def antialias_pos_embed(pos: torch.Tensor, grid: tuple[int, int], prefix: int) -> torch.Tensor:
    """timm's / DINOv2-reg's resize: exact grid size, bicubic with antialias; `prefix` leading tokens kept."""
    from timm.layers import resample_abs_pos_embed

    return resample_abs_pos_embed(pos, new_size=list(grid), num_prefix_tokens=prefix)


# -- features ----------------------------------------------------------------------------------------
@dataclass
class BackboneFeatures:
    """Patch-token features of one forward pass; h x w = the backbone's patch grid.

    tokens: B x h*w x C, the last block's output after the final norm (DINO's get_intermediate_layers)
    or SAM's neck output (256-d). penult: B x h*w x C, the penultimate block's output after the final
    norm (ViTs). q, k, v: B x heads x h*w x d of the last block (patch tokens only).
    attn: B x heads x h*w x h*w, the last block's attention over patch tokens (softmax including the
    prefix tokens' columns, which are then dropped), or None when not requested. last_input: B x h x w x C,
    the hidden state entering SAM's last block (`Backbone.sam_embedding` finishes the pass from it).
    """

    grid: tuple[int, int]
    tokens: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    penult: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    last_input: torch.Tensor | None = None


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, N, C = x.shape
    return x.view(B, N, heads, C // heads).transpose(1, 2)


# SAM windows encoded per pass: timm's SAM ViT materialises each global block's 4096 x 4096 scores per head with
# their relative-position bias (about 2.4 GB a window for ViT-B at 1024 px, fp32), so ProxyCLIP's batch of 16
# windows needed over 14 GB and was killed out of memory on a 24 GB machine; one at a time costs no time on CPU.
SAM_WINDOWS = 1


class Backbone:
    """A frozen backbone and its registry entry. `features(pixels)` takes images normalised with
    `info.mean`/`info.std` (see `from_clip_pixels`)."""

    def __init__(self, info: BackboneInfo, model: torch.nn.Module, weights: str = "none", precision: str = "fp32") -> None:
        self.info = info
        self.model = model.eval().requires_grad_(False)
        self.weights = weights
        self.precision = precision

    def config(self) -> dict:
        """What identifies this backbone in a result file."""
        return {"backbone": self.info.name, "timm": self.info.timm_name, "weights": self.weights, "precision": self.precision}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def from_clip_pixels(self, pixels: torch.Tensor, clip_mean: Sequence[float], clip_std: Sequence[float]) -> torch.Tensor:
        """Re-normalise CLIP-normalised B x 3 x H x W pixels to this backbone's mean/std (ProxyCLIP's
        `norm(unnorm(img))`); SAM inputs are also resized bilinearly to input_size x input_size."""
        view = lambda t: torch.tensor(t, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)  # noqa: E731
        x = (pixels * view(clip_std) + view(clip_mean) - view(self.info.mean)) / view(self.info.std)
        if self.info.input_size:
            x = F.interpolate(x, size=(self.info.input_size,) * 2, mode="bilinear", align_corners=False)
        return x

    @torch.inference_mode()
    def features(self, pixels: torch.Tensor, want: Sequence[str] = ("tokens",)) -> BackboneFeatures:
        """Run the backbone once; `want` is a subset of FEATURES ("qkv" gives q, k and v)."""
        unknown = set(want) - set(self.info.features)
        if unknown:
            raise ValueError(f"backbone {self.info.name} does not expose {', '.join(sorted(unknown))}; it has {', '.join(self.info.features)}")
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        if self.info.kind == "samvit":  # one window at a time (SAM_WINDOWS)
            parts = [self._sam_features(chunk, want) for chunk in pixels.split(SAM_WINDOWS)]
            return BackboneFeatures(parts[0].grid, **{f: torch.cat([getattr(p, f) for p in parts]) if getattr(parts[0], f) is not None else None
                                                      for f in ("tokens", "q", "k", "v", "penult", "attn", "last_input")})  # fmt: skip
        if self.info.kind == _DENSE:
            feats = self.feature_map(pixels)
            out = BackboneFeatures(tuple(feats.shape[-2:]))
            out.tokens = feats.flatten(2).transpose(1, 2)
            return out
        return self._vit_features(pixels, want)

    def feature_map(self, pixels: torch.Tensor) -> torch.Tensor:
        """B x C x h x w last feature map of a dense backbone (timm `forward_intermediates`) for normalised
        pixels, cut to whole patches (h = H // patch)."""
        p = self.info.patch_size
        H, W = pixels.shape[-2:]
        pixels = pixels[..., : H // p * p, : W // p * p].to(device=self.device, dtype=self.dtype)
        return self.model.forward_intermediates(pixels, indices=1, norm=self.info.final_norm, output_fmt="NCHW", intermediates_only=True)[-1]

    def supported_size(self, height: int, width: int) -> tuple[int, int]:
        """The input size the published whole-image extraction resizes an image to: each side rounded to the
        nearest multiple of the patch, at least one patch (Python's round, as published)."""
        p = self.info.patch_size
        return max(int(round(height / p) * p), p), max(int(round(width / p) * p), p)

    @torch.inference_mode()
    def image_features(self, rgb: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """CorrCLIPv2's whole-image features: `image_feature_map` resized bilinearly (align_corners False)
        to `size` (the network input) and L2-normalised per pixel: 1 x C x h x w fp32."""
        return resized_features(self.image_feature_map(rgb), size)

    @torch.inference_mode()
    def image_feature_map(self, rgb: torch.Tensor) -> torch.Tensor:
        """The published `extract_dense`: `rgb` (H x W x 3 uint8, the original image) in [0, 1], resized
        bilinearly to `supported_size`, normalised, run once: 1 x C x h x w fp32 on the patch grid."""
        if self.info.kind != _DENSE:
            raise ValueError(f"backbone {self.info.name} gives no whole-image feature map; use a dense backbone (`ls backbones`)")
        x = torch.as_tensor(rgb).permute(2, 0, 1)[None].float().div(255.0)
        target = self.supported_size(*x.shape[-2:])
        if target != tuple(x.shape[-2:]):
            x = F.interpolate(x, size=target, mode="bilinear", align_corners=False)
        view = lambda t: torch.tensor(t).view(1, 3, 1, 1)  # noqa: E731
        return self.feature_map((x - view(self.info.mean)) / view(self.info.std)).float()

    def _vit_features(self, pixels: torch.Tensor, want: Sequence[str]) -> BackboneFeatures:
        m = self.model
        p = self.info.patch_size
        B, _, H, W = pixels.shape
        grid = (H // p, W // p)
        x = m.patch_embed.norm(m.patch_embed.proj(pixels[..., : grid[0] * p, : grid[1] * p]).flatten(2).transpose(1, 2))
        prefix = [t.expand(B, -1, -1) for t in (m.cls_token, m.reg_token) if t is not None]
        if m.no_embed_class:  # DINOv2-reg in timm: the CLS position is folded into cls_token
            x = torch.cat(prefix + [x + antialias_pos_embed(m.pos_embed, grid, 0)], dim=1)
        else:
            x = torch.cat(prefix + [x], dim=1)
            pos = dino_pos_embed(m.pos_embed, (H, W), p) if self.info.pos_rule == "dino" else antialias_pos_embed(m.pos_embed, grid, len(prefix))
            x = x + pos
        x = m.norm_pre(m.pos_drop(x))
        for blk in m.blocks[:-1]:
            x = blk(x)
        last = m.blocks[-1]
        out = BackboneFeatures(grid)
        n_prefix = x.shape[1] - grid[0] * grid[1]
        if "penult" in want:
            out.penult = m.norm(x)[:, n_prefix:]
        if "qkv" in want or "attn" in want:
            a = last.attn
            qkv = a.qkv(last.norm1(x)).view(B, x.shape[1], 3, a.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = a.q_norm(qkv[0]), a.k_norm(qkv[1]), qkv[2]
            if "attn" in want:
                out.attn = ((q * a.scale) @ k.transpose(-2, -1)).softmax(-1)[:, :, n_prefix:, n_prefix:]
            if "qkv" in want:
                out.q, out.k, out.v = q[:, :, n_prefix:], k[:, :, n_prefix:], v[:, :, n_prefix:]
        if "tokens" in want:
            out.tokens = m.norm(last(x))[:, n_prefix:]
        return out

    def _sam_features(self, pixels: torch.Tensor, want: Sequence[str]) -> BackboneFeatures:
        from timm.layers import resample_abs_pos_embed_nhwc

        m = self.model
        x = m.patch_embed(pixels)
        if m.pos_embed is not None:
            x = x + resample_abs_pos_embed_nhwc(m.pos_embed, x.shape[1:3])
        x = m.norm_pre(m.pos_drop(x))
        for blk in m.blocks[:-1]:
            x = blk(x)
        last = m.blocks[-1]
        B, gh, gw, C = x.shape
        out = BackboneFeatures((gh, gw))
        if "qkv" in want or "attn" in want:  # SAM's last block attends globally (window_size 0)
            a = last.attn
            qkv = a.qkv(last.norm1(x).reshape(B, gh * gw, C)).view(B, gh * gw, 3, a.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            if "attn" in want:
                out.attn = sam_scores(a, q, k, (gh, gw)).softmax(-1)
            if "qkv" in want:
                out.q, out.k, out.v = q, k, v
        if "last_input" in want:
            out.last_input = x
        if "tokens" in want:
            out.tokens = self.sam_embedding(x).flatten(2).transpose(1, 2)
        return out

    @torch.inference_mode()
    def sam_embedding(self, last_input: torch.Tensor) -> torch.Tensor:
        """SAM's image embedding (its neck's output, B x 256 x h x w: what segment_anything's image encoder
        returns) from the hidden state entering its last block (`features(..., want=("last_input",))`)."""
        return self.model.neck(self.model.blocks[-1](last_input).permute(0, 3, 1, 2))


def sam_scores(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """SAM's attention logits before the softmax, B x H' x N x N for q, k B x H' x N x d (any subset of
    heads, so callers can go one head at a time): (q * scale) k^T plus the decomposed relative-position
    bias of a global-attention block (`attn`, a timm SAM Attention) on the grid."""
    from timm.models.vision_transformer_sam import get_decomposed_rel_pos_bias

    scores = (q * attn.scale) @ k.transpose(-2, -1)
    if attn.use_rel_pos:
        bias = get_decomposed_rel_pos_bias(q.flatten(0, 1), attn.rel_pos_h, attn.rel_pos_w, grid, grid)
        scores = scores + bias.view_as(scores)
    return scores


def load_backbone(
    name: str,
    pretrained: str | None = "hub",
    device: str | torch.device | None = "auto",
    precision: str = "fp32",
    cache_dir: str | None = None,
) -> Backbone:
    """Load a registered backbone (`ls backbones`). pretrained: "hub" (the registered timm tag from the
    Hugging Face Hub, then its cache), a local checkpoint file, or None / "none" for random weights.
    Raises WeightsUnavailableError (one line) when the weights cannot be had."""

    info = BACKBONES.get(name)
    if info.kind in MASK_KINDS:
        raise UserValueError(f"{name} is a mask generator, not a feature backbone; use it through segment.regions (or models.sam3)")
    if precision not in PRECISIONS:
        raise UserValueError(f"unknown precision {precision!r}; choose {', '.join(PRECISIONS)}")
    if isinstance(pretrained, str) and pretrained.lower() in ("", "none"):
        pretrained = None
    model, weights = create_backbone_model(info, pretrained, cache_dir)
    model = model.to(device=resolve_device(device), dtype=PRECISIONS[precision])
    return Backbone(info, model, weights, precision)
