"""Shared fixtures: small random-init open_clip models (no weights can be downloaded in CI)."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# Never let a test wait on the network for weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).parent / "data"

# Test files mirror the package (tests/<folder>/test_<module>.py) and import shared helpers from each other by
# basename (pytest's default import mode, so basenames are unique): every folder holding tests is importable,
# whichever file is collected first.
for _folder in sorted({path.parent for path in Path(__file__).parent.rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
TINY_CONFIG = str(DATA / "tiny-vit.json")


def free_memory() -> None:
    """Collect cycles and hand freed heap pages back to the system (glibc keeps them otherwise): the models
    a test built leave the process's resident memory when it ends, so the suite's peak stays under 4 GB.

    fastapi keeps the endpoints of every app it saw in module-level lru_caches (fastapi.dependencies.models),
    and a Gradio demo's endpoints hold the demo and its model: those caches are emptied first."""
    routes = sys.modules.get("fastapi.dependencies.models")
    for cached in vars(routes).values() if routes else ():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


@pytest.fixture(scope="module", autouse=True)
def _free_memory_after_module():
    yield
    free_memory()


@pytest.fixture(scope="session")
def tiny_clip():
    """A 3-block, width-96 ViT/16 with a 64x64 native grid of 4x4 patches, random weights."""
    from clipseg_sparse import load_clip

    torch.manual_seed(0)
    return load_clip(TINY_CONFIG, pretrained=None, device="cpu")


@pytest.fixture(scope="session")
def vit_b16():
    from clipseg_sparse import load_clip

    torch.manual_seed(0)
    return load_clip("ViT-B-16", pretrained=None, device="cpu")


@pytest.fixture
def forward_inputs(monkeypatch):
    """A list of (pixels, pos_interp) that every image forward of DenseCLIP then receives (`_embed` is
    where encode_dense, dense_tokens and attention_maps all start)."""
    from clipseg_sparse.models.clip import DenseCLIP

    seen, real = [], DenseCLIP._embed

    def spy(self, pixels, pos_interp="size"):
        seen.append((pixels.clone(), pos_interp))
        return real(self, pixels, pos_interp)

    monkeypatch.setattr(DenseCLIP, "_embed", spy)
    return seen


@contextmanager
def installed_backbones(*backbones, clips=()):
    """Within the block, every external backbone a run loads with random weights ("none": what "auto" gives a
    random CLIP) is the matching one of `backbones` (by name; by name and dtype when several share a name),
    in place of the full-size model; `clips`' own backbone sets are emptied before and after, so no backbone
    loaded outside the block serves inside it or the other way round."""
    import clipseg_sparse.models.proxies as proxies

    real = proxies.load_backbone
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    def load(name, pretrained="hub", device="auto", precision="fp32", **kwargs):
        mine = [b for b in backbones if b.info.name == name]
        if pretrained != "none" or not mine:
            return real(name, pretrained, device=device, precision=precision, **kwargs)
        same = [b for b in mine if next(b.model.parameters()).dtype == dtypes[precision]]
        return (same or mine)[0]

    def forget():
        for clip in clips:
            clip._proxies = None

    forget()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(proxies, "load_backbone", load)
        try:
            yield
        finally:
            forget()


def structured_pixels(n: int, size: tuple[int, int]) -> torch.Tensor:
    """Smooth regions plus noise: patch tokens of a random-init ViT then correlate enough (about 27 % of
    pairs above SC-CLIP's 0.4) for thresholds, aggregation and the outlier repair to matter."""
    return torch.nn.functional.interpolate(torch.randn(n, 3, 4, 4), size=size, mode="bilinear") + 0.3 * torch.randn(n, 3, *size)


def block_and_tokens(clip, grid=(4, 4)):
    """The last block of `clip` and two random token sequences (CLS + grid) for it."""
    blk = clip.visual.transformer.resblocks[-1]
    x = torch.randn(2, 1 + grid[0] * grid[1], clip.visual.transformer.width)
    return blk, x


def window_run(clip, pixels, spec, text=None, regions=None, image_features=None, **settings):
    """The run (`segment.plan.ImageRun`) of CLIP-normalised `pixels` (1 x 3 x H x W) under `spec` and settings
    given as InferenceSettings fields: what `dense_cosine` and `iter_window_features` read."""
    from clipseg_sparse.segment.plan import ImageRun, Plan
    from clipseg_sparse.segment.settings import InferenceSettings

    plan = Plan.of(spec, InferenceSettings(**settings))
    return ImageRun(plan, clip, text, None, pixels, regions, clip.proxies, image_features or {})


def tiny_sam(img_size: int, window_size: int):
    """A 2-block, width-32 timm SAM image encoder (the second block global, relative positions drawn at
    random so they matter), random weights from the current RNG state, in eval mode; SAM's LayerNorm eps
    1e-6, as `sam_vitb` is built."""
    import timm.models.vision_transformer_sam as vs

    from clipseg_sparse.models.backbones import BACKBONES

    model = vs.VisionTransformerSAM(
        img_size=img_size, patch_size=16, embed_dim=32, depth=2, num_heads=2, window_size=window_size, global_attn_indexes=(1,),
        use_rel_pos=True, neck_chans=16, num_classes=0, **BACKBONES.get("sam_vitb").timm_kwargs(),
    ).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.rel_pos_h.normal_()
            blk.attn.rel_pos_w.normal_()
    return model


def tiny_stable_diffusion(folder: Path):
    """A random StableDiffusionPipeline with SD's block layout (4 up blocks, up_blocks[3] with two attentions), 8 channels,
    2 heads: 512 px images give 64 x 64 latents (4096 tokens), as SD 2.1-base's. `folder` holds its tokenizer files;
    CLIPer's FGC runs on it (`methods.cliper.use_diffusion`), its weights drawn from seed 0."""
    import json

    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    (folder / "vocab.json").write_text(json.dumps({"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2, "a</w>": 3}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="!", model_max_length=77)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        text = CLIPTextModel(CLIPTextConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=2))
        vae = diffusers.AutoencoderKL(block_out_channels=(8,) * 4, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                                      latent_channels=4, norm_num_groups=4, layers_per_block=1)
        unet = diffusers.UNet2DConditionModel(sample_size=64, block_out_channels=(8,) * 4, layers_per_block=1, cross_attention_dim=16, attention_head_dim=2,
                                              norm_num_groups=4, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                                              up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
    # Self-attention queries x 30: peaked, as trained SD's. As drawn, every row is near 1/4096, FGC's chained product is
    # constant to 1e-6 and a min-max map of it is float rounding; x 30: row maxima 0.2, no exact zeros.
    with torch.no_grad():
        for name, module in unet.named_modules():
            if name.endswith("attn1"):
                module.to_q.weight.mul_(30)
    scheduler = diffusers.PNDMScheduler(skip_prk_steps=True, steps_offset=1, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    return diffusers.StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler, safety_checker=None,
                                             feature_extractor=None, requires_safety_checker=False)
