"""CLIPer's cost per image next to SCLIP's (issue 32): one 480 x 640 image, 21 classes, random weights on the real
architectures (OpenAI ViT-B/16; Stable Diffusion 2.1-base's UNet, VAE and text encoder built from its published
configs, typed below), fp32 on this CPU, each preset under its own protocol's VOC20 settings (SCLIP: 336 short side,
224 / 112 windows; CLIPer: 336, whole image or + 336 windows). Times are process CPU seconds (one thread) of
`Segmenter.predict_labels`, the best of `--repeat`; FGC's two parts (the SD pass, the chained refinement) timed alone.

    python benchmarks/cliper_cost.py [--repeat 2] [--threads 1] [--no-fgc]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# stabilityai/stable-diffusion-2-1-base: unet/config.json, vae/config.json, text_encoder/config.json (the fields that
# set the architecture), read from the model card's files
SD21_UNET = dict(sample_size=64, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, attention_head_dim=(5, 10, 20, 20),
                 cross_attention_dim=1024, use_linear_projection=True, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)  # fmt: skip
SD21_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512)  # fmt: skip
SD21_TEXT = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
                 max_position_embeddings=77, hidden_act="gelu", projection_dim=512)  # fmt: skip


def random_sd21():
    """A StableDiffusionPipeline with SD 2.1-base's architecture and random weights (a 4-token tokenizer: the empty
    prompt is all FGC encodes)."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    folder = Path(tempfile.mkdtemp())
    (folder / "vocab.json").write_text(json.dumps({"<|startoftext|>": 49406, "<|endoftext|>": 49407, "!": 0, "a</w>": 1}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="!", model_max_length=77)
    torch.manual_seed(0)
    return diffusers.StableDiffusionPipeline(
        vae=diffusers.AutoencoderKL(**SD21_VAE), text_encoder=CLIPTextModel(CLIPTextConfig(**SD21_TEXT)), tokenizer=tokenizer,
        unet=diffusers.UNet2DConditionModel(**SD21_UNET),
        scheduler=diffusers.PNDMScheduler(skip_prk_steps=True, steps_offset=1, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def cpu_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-fgc", action="store_true", help="skip FGC (no diffusers, or not the memory for SD 2.1-base: about 6 GB)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from clipseg_sparse import load_clip
    from clipseg_sparse.evaluation.protocols import PROTOCOLS
    from clipseg_sparse.methods import cliper
    from clipseg_sparse.segment import Segmenter

    clip = load_clip("ViT-B-16", pretrained=None, device="cpu")
    rng = np.random.default_rng(0)
    image = (np.kron(rng.integers(0, 255, (6, 8, 3)), np.ones((80, 80, 1))) + rng.integers(0, 30, (480, 640, 3))).clip(0, 255).astype(np.uint8)
    classes = [f"class {i}" for i in range(21)]
    rows = []
    for label, protocol, preset in (("sclip", "sclip", "sclip"), ("cliper-nofgc (whole)", "cliper-nofgc", "cliper-nofgc"),
                                    ("cliper-nofgc (+ 336 windows)", "cliper-nofgc-sliding", "cliper-nofgc")):  # fmt: skip
        p = PROTOCOLS.get(protocol)
        seg = Segmenter(clip, classes, p.spec_for("voc20") if preset == "cliper-nofgc" else preset, p.settings("voc20"), templates="single")
        seg.predict_labels(image)  # warm-up (positional embeddings, allocator)
        rows.append((label, cpu_seconds(lambda: seg.predict_labels(image), args.repeat)))
    base = rows[0][1]
    if not args.no_fgc:
        pipe = random_sd21()
        fgc = cliper.Fgc()
        maps = cliper.sd_self_attention(pipe, image, fgc)
        rows.append(("FGC: SD 2.1-base pass (stopped at up_blocks[3].attentions[1])", cpu_seconds(lambda: cliper.sd_self_attention(pipe, image, fgc), args.repeat)))
        seg = torch.rand(20, 21, 28)
        rows.append(("FGC: chained refinement (10 maps of 4096 x 4096, 20 names)", cpu_seconds(lambda: cliper.fgc_refine(seg, maps, 0.1), args.repeat)))
    print(f"| part | CPU s (1 thread) | x sclip |\n|---|---|---|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.2f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
