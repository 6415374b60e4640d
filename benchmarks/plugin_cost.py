"""The cost per image of the plug-ins FreeCP and FLOSS next to their base presets (one run, same machine).

Random-init ViT-B/16, fp32, CPU, one generated 375 x 500 image (a VOC-sized photo). FreeCP: `gem` vs `gem+freecp`
under the `freecp` protocol's VOC21 settings (short side 448, 384 / 112 windows: 6 windows; FreeCP's 46 VOC21 names,
the background's 26 stuff words among them; one template). FLOSS: `naclip` vs `naclip/floss:RANKS` under the `floss`
protocol's Context59 settings (short side 336, 224 / 112 windows: 6 windows; 59 names; 80 templates; a generated
rank file). `Segmenter.predict_labels`, best of `--rounds` after a warm-up, base and plug-in interleaved round by
round. Random weights: how many classes FreeCP's purification keeps, and so how many crops it classifies, and how
many FLOSS experts can claim a pixel are not what trained weights give.

    python benchmarks/plugin_cost.py --threads 1 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from clipseg_sparse import Segmenter, load_clip
    from clipseg_sparse.datasets.classnames import class_names_file
    from clipseg_sparse.evaluation.protocols import PROTOCOLS
    from clipseg_sparse.segment.vocabulary import Vocabulary

    torch.manual_seed(0)
    clip = load_clip("ViT-B-16", pretrained=None, device="cpu")
    rgb = np.random.default_rng(0).integers(0, 255, (375, 500, 3)).astype(np.uint8)

    voc = Vocabulary.from_file(class_names_file(dataset="voc21", which="freecp"))
    freecp = PROTOCOLS.get("freecp").settings("voc21")
    context = Vocabulary.from_file(class_names_file(dataset="context59", which="sclip"))
    rows = [{"template_id": t, "entropy": 0.1 * t, "pixel_percentage": 1.0, "rank": t + 1} for t in range(80)]
    ranks = Path(tempfile.mkdtemp()) / "ranks.json"
    ranks.write_text(json.dumps({"classes": {label: {"entropy_ranking": rows[i % 80 :] + rows[: i % 80]} for i, label in enumerate(context.labels)}}))
    floss = PROTOCOLS.get("floss").settings("context59")

    pairs = {
        "FreeCP (VOC21)": [("gem", Segmenter(clip, voc, "gem", freecp.replace(stages=()), templates="single")),
                           ("gem+freecp", Segmenter(clip, voc, "gem+freecp", freecp, templates="single"))],
        "FLOSS (Context59)": [("naclip", Segmenter(clip, context, "naclip", floss, templates="openai")),
                              ("naclip+floss", Segmenter(clip, context, f"naclip/floss:{ranks}", floss, templates="openai"))],
    }  # fmt: skip
    for what, segmenters in pairs.items():
        best = {name: float("inf") for name, _ in segmenters}
        for _, seg in segmenters:
            seg.predict_labels(rgb)  # warm-up: the expert texts, the class descriptions
        for _ in range(args.rounds):
            for name, seg in segmenters:
                start = time.perf_counter()
                seg.predict_labels(rgb)
                best[name] = min(best[name], time.perf_counter() - start)
        base = best[segmenters[0][0]]
        for name, seconds in best.items():
            print(f"{what}: {name} {seconds:.2f} s per image ({seconds / base:.2f} x)", flush=True)


if __name__ == "__main__":
    main()
