"""CASS's cost per image next to NACLIP's (its base: k-k + Gaussian, no residual or FFN), and how much its randomized
SVD's draw moves the features.

Random-init ViT-B/16 and DINO ViT-B/8 (full size), one generated 480 x 640 image, the cass protocol's ADE20K settings
(short side 336, windows 224 / 112: 6 windows), 150 names, one template. Cost: `Segmenter.predict`, best of
`--rounds` after a warm-up, variants interleaved round by round: `naclip`; `cass` without the text adjustment (the
spectral tap in the plain windows); `cass`; and DINO ViT-B/8 alone on the 6 crops. Draws (`--draws`): one 224 window's
features with the window's start seeded 42 against seeds 43..47 and against the exact rank-10 truncation (full
eigendecomposition); the numbers hold for random weights only.

    python benchmarks/cass_cost.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from clipseg_sparse.attention import AttentionSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--names", type=int, default=150)
    ap.add_argument("--no-draws", action="store_true", help="skip the draw-dependence measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from clipseg_sparse import load_clip
    from clipseg_sparse.methods import cass
    from clipseg_sparse.segment import Segmenter

    torch.manual_seed(0)
    clip = load_clip("ViT-B-16", pretrained=None, device="cpu")
    settings = cass.PROTOCOL.settings("ade20k")
    names = ",".join(f"thing {i}" for i in range(args.names))
    image = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    no_adjust = str(AttentionSpec.parse(cass.CASS).replace(extras=()))
    variants = {"naclip": "naclip", "cass, spectral tap only": no_adjust, "cass": "cass"}
    segmenters = {k: Segmenter(clip, names, spec=v, settings=settings, templates="single") for k, v in variants.items()}
    dino = clip.proxies.get(cass.BACKBONE, "cpu")
    crops = torch.randn(6, 3, 224, 224)
    runs = {k: (lambda s=s: s.predict(image)) for k, s in segmenters.items()}
    runs["DINO ViT-B/8 on 6 crops"] = lambda: dino.features(cass.dino_pixels(crops, dino), want=("qkv",))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f()  # warm-up
    for _ in range(args.rounds):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    base = min(times["naclip"])
    print(f"| variant ({args.threads} threads, best of {args.rounds}) | s per image | ratio to naclip |\n|---|---|---|")
    for k, ts in times.items():
        print(f"| {k} | {min(ts):.2f} | {min(ts) / base:.2f} |")
    if not args.no_draws:
        draws(clip)


def draws(clip) -> None:
    """Max |difference| of one window's L2-normalised features (and the share of patches whose nearest of 150 random
    names changes) between the seed-42 draw and other draws / the exact truncation."""
    from clipseg_sparse.methods import cass

    pixels = torch.nn.functional.interpolate(torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(3)), size=(224, 224), mode="bilinear")
    text = torch.nn.functional.normalize(torch.randn(150, clip.embed_dim, generator=torch.Generator().manual_seed(1)), dim=-1)
    spec = str(AttentionSpec.parse(cass.CASS).replace(extras=()))
    ref = clip.encode_dense(pixels, spec, pos_interp="scale").reshape(-1, clip.embed_dim)
    seed, low_rank = cass.SEED, cass.low_rank

    def compare(label: str) -> None:
        f = clip.encode_dense(pixels, spec, pos_interp="scale").reshape(-1, clip.embed_dim)
        flips = ((f @ text.T).argmax(-1) != (ref @ text.T).argmax(-1)).float().mean()
        print(f"| {label} | {(f - ref).abs().max():.2e} | {flips:.1%} |")

    print("| seed-42 draw against | max abs feature difference | patches whose best name changes |\n|---|---|---|")
    try:
        for s in range(43, 48):
            cass.SEED = s
            compare(f"seed {s}")
        cass.SEED = seed

        def exact(a, start, iterations=cass.POWER_ITERATIONS):
            vals, vecs = torch.linalg.eigh(a)
            top = vals.abs().argsort(descending=True)[: start.shape[1]]
            top = top[vals[top].argsort(descending=True)]
            return vecs[:, top], vals[top], vecs[:, top].mH

        cass.low_rank = exact
        compare("exact rank-10 truncation")
    finally:
        cass.SEED, cass.low_rank = seed, low_rank


if __name__ == "__main__":
    main()
