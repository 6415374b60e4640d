"""Issue 33: the stages after the networks, before and after, side by side in one run: time, peak memory and
the largest difference from the implementation they replace.

Each case holds a copy of the code before issue 33 (`old_*` below, verbatim but for names) and calls the
library's current code on the same random inputs of one image:

- `retrieval`: CorrCLIPv2's retrieval stage, 150 classes, 30 regions on a 336 x 448 network input, 1024-d keys
  from a 24 x 31 raw map (C-RADIO's grid of a 375 x 500 image), 512-d values, a flat bank of 1000 regions,
  k = 20, alpha 0.5. Before: region means as one product of the input-size map with the pixels' one-hot region
  matrix, logits painted by advanced indexing, then 0.5 own + 0.5 support. After: `region_support` (region means
  reduced by region index from the raw map) and `retrieval_fusion` (painted by gather into the fused map).
  The second row gives both the map as the windows forward makes it (H x W x N memory seen as N x H x W, what
  `segment` hands the stage); the row `retrieval_logits` is the painted support alone (what `bank.py` times).
- `pamr`: 10 iterations, dilations 8 and 16, 150 classes at 375 x 500 (`propagation.py`'s image). Before: each
  iteration adds the 16 shifted views of the whole replicate-padded map. After: class bands of 8, two band
  buffers, shifted slices with clamped ends (`stages.pamr`). The second row gives both the map as the windows
  forward makes it (H x W x N memory seen as N x H x W, what `segment` hands PAMR). The row `pamr, C kernel`
  compares today's torch loop (`CLIPSEG_SPARSE_NATIVE=0`) with the C kernel (`runtime/native/pamr.c`).
- `resize`: the N x H x W map after an input-size stage (retrieval, lp:pixel) at the original size, 150 classes
  from 448 x 597 to 480 x 640, read in the label map's bands. Before: the dense resize factors (a CosineMap of
  the whole input-size grid). After: `ResizedMap`, two gathered taps per axis.
- `window features`: CorrCLIPv2's `ext:c_radio_v3_l.image` for the 8 windows (336 px, stride 112) of a 448 x 597
  input, from C-RADIOv3-L's raw 1024 x 28 x 37 map, at 42 x 42. Before: the map resized to the input and
  L2-normalised, each window's crop resized to 42 x 42 and L2-normalised. After: `WholeImageFeatures`, only the
  input-size pixels the grid reads.
- `lp:pixel`: LPOSS+'s pixel propagation, 150 classes on a 336 x 448 network input (13 x 13 square, tau 0.01,
  alpha 0.95). Before: the 25M-edge COO graph, coalesced, `normalized_laplacian`, every class in one CG. After:
  `pixel_laplacian` written out from the stencil (int32 CSR) and the CG in bands of 32 classes. The row
  `lp:pixel graph` is the Laplacian alone.
- `bank build`: one 375 x 500 image's region reductions of `bank build`, 30 regions: the keys (region means of
  C-RADIOv3-L's 1024 x 24 x 31 map resized to the image and L2-normalised per pixel) and the values (region
  means of the 512-d values map, a CosineMap of a 42 x 84 window grid). Before: the 1024 x H x W and 512 x H x W
  maps made band by band and reduced with `index_add` of their transposed columns. After: `resized_region_means`
  from the raw map, `factored_region_means` from the CosineMap's grid (the networks' forwards are not in it).

Times: one thread (`--threads`), both variants built once, then `--rounds` rounds, each running before and
after alternately (interleaved on a shared machine), best of the rounds. Memory: each variant once more in a
fresh process, freed heap returned (`malloc_trim`), the kernel's peak resident set reset
(`/proc/self/clear_refs`), `peak MiB` = VmHWM - VmRSS over the call (what the call allocates).

    python benchmarks/before_after.py [--cases retrieval pamr lp:pixel "bank build" resize "window features"] [--rounds 3] [--threads 1] [--cpu-time]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


# -- the code before issue 33 -----------------------------------------------------------------------------
def old_region_queries(regions: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, inverse = torch.unique(regions.cpu(), return_inverse=True)
    onehot = F.one_hot(inverse.flatten(), len(values)).float()  # h*w x R
    sums = features.flatten(1).float().cpu() @ onehot  # C x R
    return values, F.normalize((sums / onehot.sum(0)).T, dim=-1), inverse.flatten()


def old_retrieval_logits(regions, features, bank, texts, k):
    from clipseg_sparse.segment.bank import search

    _, queries, inverse = old_region_queries(regions, features)
    _, rows = search(bank.index, queries.numpy(), k)
    logits = sum(bank.support(store, rows) @ text.float().cpu().T for store, text in texts.items()) / len(texts)  # R x N
    return logits.T.contiguous()[:, inverse].reshape(-1, *regions.shape).to(features.device)


def old_pamr(cosine: torch.Tensor, guide: torch.Tensor, iterations: int = 10, dilations=(8, 16)) -> torch.Tensor:
    from clipseg_sparse.stages import _shifted, pamr_affinity

    weights = pamr_affinity(guide.to(cosine.device), dilations)
    mask = cosine.float()
    for _ in range(iterations):
        out = torch.zeros_like(mask)
        for w, neighbour in zip(weights, _shifted(mask, dilations)):
            out.addcmul_(neighbour, w)
        mask = out
    return mask


def old_window_features(raw: torch.Tensor, size: tuple[int, int], boxes, grid: tuple[int, int]) -> torch.Tensor:
    full = F.normalize(F.interpolate(raw, size=size, mode="bilinear", align_corners=False), dim=1)
    crops = torch.cat([full[..., y1:y2, x1:x2] for y1, y2, x1, x2 in boxes])
    return F.normalize(F.interpolate(crops, size=grid, mode="bilinear", align_corners=False).flatten(2).transpose(1, 2), dim=-1)[:, None]


def old_pixel_graph(rgb: torch.Tensor, tau: float = 0.01, radius: int = 6) -> torch.Tensor:
    from kornia.color import rgb_to_lab

    _, H, W = rgb.shape
    lab = (rgb_to_lab(rgb.float()) / torch.tensor((100.0, 128.0, 128.0), device=rgb.device).view(3, 1, 1)).reshape(3, -1)
    ys = torch.arange(H, device=rgb.device).view(-1, 1).expand(H, W).flatten()
    xs = torch.arange(W, device=rgb.device).view(1, -1).expand(H, W).flatten()
    rows, cols = [], []
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            if dy == 0 and dx == 0:
                continue
            ok = (ys + dy >= 0) & (ys + dy < H) & (xs + dx >= 0) & (xs + dx < W)
            src = ok.nonzero().flatten()
            rows.append(src)
            cols.append(src + dy * W + dx)
    rows, cols = torch.cat(rows), torch.cat(cols)
    dist = (lab[:, rows] - lab[:, cols]).square().sum(0).sqrt()
    return torch.sparse_coo_tensor(torch.stack((rows, cols)), torch.exp(-dist / tau), (H * W, H * W), check_invariants=False).coalesce()


def old_lp_pixel(cosine: torch.Tensor, rgb: torch.Tensor) -> torch.Tensor:
    from clipseg_sparse.methods.lposs import normalized_laplacian, propagate

    n, H, W = cosine.shape
    laplacian = normalized_laplacian(old_pixel_graph(rgb.to(cosine.device)))
    z = propagate(laplacian, cosine.reshape(n, H * W).T)
    return z.T.reshape(n, H, W).to(cosine.dtype)


def old_key_rows(feature_map: torch.Tensor, size: tuple[int, int]):
    from clipseg_sparse.segment.maps import resize_matrix as _resize_matrix

    f = feature_map[0].float().cpu()
    ly, lx = _resize_matrix(f.shape[1], size[0]), _resize_matrix(f.shape[2], size[1])
    return lambda y0, y1: F.normalize(torch.einsum("bh,chw,xw->cbx", ly[y0:y1], f, lx), dim=0)


def old_region_means(feature_rows, height: int, regions, ids, band: int = 64):
    import numpy as np

    sorted_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    reg = torch.from_numpy(np.asarray(regions, dtype=np.int64))
    sums, counts = None, torch.zeros(len(ids), dtype=torch.float64)
    for y0 in range(0, height, band):
        f = feature_rows(y0, min(y0 + band, height)).cpu().double().flatten(1)  # C x pixels
        r = reg[y0 : min(y0 + band, height)].flatten()
        pos = torch.searchsorted(sorted_ids, r).clamp(max=max(len(ids) - 1, 0))
        keep = sorted_ids[pos] == r if len(ids) else torch.zeros_like(r, dtype=torch.bool)
        part = torch.zeros(len(ids), f.shape[0], dtype=torch.float64).index_add_(0, pos[keep], f[:, keep].T)
        sums = part if sums is None else sums + part
        counts += torch.bincount(pos[keep], minlength=len(ids)).double()
    return (sums / counts.clamp(min=1)[:, None]).float().numpy()


# -- cases: name -> (inputs, {variant: call}) ----------------------------------------------------------------
def retrieval_case(classes: int, tmp: Path) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from bank import synthetic_bank

    from clipseg_sparse.methods.corrclipv2 import retrieval_fusion
    from clipseg_sparse.models.backbones import resized_features
    from clipseg_sparse.segment import bank as banks

    bank = synthetic_bank(tmp / "bank", 1000, 1024, 512, "flat")
    g = torch.Generator().manual_seed(1)
    size = (336, 448)
    reg = torch.randint(-1, 30, (size[0] // 16, size[1] // 16), generator=g).repeat_interleave(16, 0).repeat_interleave(16, 1)
    raw = torch.randn(1, 1024, 24, 31, generator=g)
    full = resized_features(raw, size)[0]  # the input-size map the old code read (made before the stage either way)
    texts = {"synthetic": F.normalize(torch.randn(classes, 512, generator=g), dim=-1)}
    cosine = torch.randn(classes, *size, generator=g)
    strided = cosine.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # H x W x N memory, as the windows forward's map
    return {
        "retrieval stage": {
            "before": lambda: 0.5 * cosine + (1 - 0.5) * old_retrieval_logits(reg, full, bank, texts, 20),
            "after": lambda: retrieval_fusion(cosine, *banks.region_support(reg, raw[0], bank, texts, 20), 0.5),
        },
        "retrieval stage, H x W x N map": {
            "before": lambda: 0.5 * strided + (1 - 0.5) * old_retrieval_logits(reg, full, bank, texts, 20),
            "after": lambda: retrieval_fusion(strided, *banks.region_support(reg, raw[0], bank, texts, 20), 0.5),
        },
        "retrieval_logits": {
            "before": lambda: old_retrieval_logits(reg, full, bank, texts, 20),
            "after": lambda: banks.retrieval_logits(reg, raw[0], bank, texts, 20),
        },
    }


def pamr_case(classes: int, tmp: Path) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from clipseg_sparse.stages import pamr

    g = torch.Generator().manual_seed(0)
    cosine, guide = torch.randn(classes, 375, 500, generator=g) * 0.05 + 0.2, torch.randn(3, 375, 500, generator=g)
    strided = cosine.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # H x W x N memory, as the windows forward's map
    return {
        "pamr": {"before": lambda: old_pamr(cosine, guide), "after": lambda: pamr(cosine, guide)},
        "pamr, H x W x N map": {"before": lambda: old_pamr(strided, guide), "after": lambda: pamr(strided, guide)},
        "pamr, C kernel": {"before": lambda: switched("0", pamr, strided, guide), "after": lambda: switched("1", pamr, strided, guide)},
    }


def switched(native: str, call: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """call(*args) with the C kernels on ("1") or off ("0")."""
    from clipseg_sparse.runtime.native import ENV_SWITCH

    os.environ[ENV_SWITCH] = native
    try:
        return call(*args)
    finally:
        os.environ.pop(ENV_SWITCH)


def resize_case(classes: int, tmp: Path) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from clipseg_sparse.segment.maps import BAND_ELEMENTS, factored, resize_matrix, resized_cosine, row_bands

    g = torch.Generator().manual_seed(0)
    (h, w), (H, W) = (448, 597), (480, 640)
    cosine = torch.randn(classes, h, w, generator=g)
    bands = row_bands(H, classes * W, BAND_ELEMENTS)

    def read(resized) -> torch.Tensor:
        return torch.cat([resized.rows(y0, y1) for y0, y1 in bands], 1)

    return {
        "resize after an input stage": {
            "before": lambda: read(factored(cosine.permute(1, 2, 0).contiguous(), resize_matrix(h, H), resize_matrix(w, W))),
            "after": lambda: read(resized_cosine(cosine, (H, W))),
        }
    }


def window_features_case(classes: int, tmp: Path) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from clipseg_sparse.models.proxies import WholeImageFeatures
    from clipseg_sparse.segment.windows import window_boxes

    raw = torch.randn(1, 1024, 28, 37, generator=torch.Generator().manual_seed(0))
    size, boxes = (448, 597), window_boxes(448, 597, 336, 112)
    return {
        "CorrCLIPv2 window features": {
            "before": lambda: old_window_features(raw, size, boxes, (42, 42)),
            "after": lambda: WholeImageFeatures(raw, size).windows(boxes, (0, 0, 0, 0)).at((42, 42)),
        }
    }


def lp_pixel_case(classes: int, tmp: Path) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from clipseg_sparse.methods.lposs import lp_pixel, normalized_laplacian, pixel_laplacian

    g = torch.Generator().manual_seed(0)
    cosine, rgb = torch.randn(classes, 336, 448, generator=g) * 0.05 + 0.2, torch.rand(3, 336, 448, generator=g)
    return {
        "lp:pixel graph": {"before": lambda: normalized_laplacian(old_pixel_graph(rgb)).values(), "after": lambda: pixel_laplacian(rgb).values()},
        "lp:pixel": {"before": lambda: old_lp_pixel(cosine, rgb), "after": lambda: lp_pixel(cosine, rgb)},
    }


def bank_build_case(classes: int, tmp: Path) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from clipseg_sparse.bench.pipeline import blocky_regions
    from clipseg_sparse.segment import bank as banks
    from clipseg_sparse.segment.maps import factored, resize_matrix

    g = torch.Generator().manual_seed(0)
    H, W = 375, 500
    regions = blocky_regions((H, W))
    ids = list(range(30))
    assert all((regions == i).any() for i in ids)  # every id present: a region's value is its index
    inverse = torch.from_numpy(regions)
    key_map = torch.randn(1, 1024, 24, 31, generator=g)
    values = factored(torch.randn(42, 84, 512, generator=g), resize_matrix(42, H), resize_matrix(84, W))
    return {
        "bank build keys": {
            "before": lambda: torch.from_numpy(old_region_means(old_key_rows(key_map, (H, W)), H, regions, ids)),
            "after": lambda: banks.resized_region_means(key_map[0], inverse, 30).float(),
        },
        "bank build values": {
            "before": lambda: torch.from_numpy(old_region_means(values.rows, H, regions, ids)),
            "after": lambda: banks.factored_region_means(values, inverse, 30).float(),
        },
    }


CASES = {
    "retrieval": retrieval_case, "pamr": pamr_case, "lp:pixel": lp_pixel_case, "bank build": bank_build_case, "resize": resize_case,
    "window features": window_features_case,
}


def status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def build(case: str, classes: int, tmp: Path) -> dict:
    return CASES[case](classes, tmp)


def peak_of(call: Callable[[], torch.Tensor]) -> float:
    """MiB the call allocates above the resident set before it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = status_mib("VmRSS")
    call()
    return status_mib("VmHWM") - before


def one(case: str, row: str, variant: str, classes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        call = build(case, classes, Path(tmp))[row][variant]
        print(json.dumps({"peak_mib": peak_of(call)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--classes", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-time", action="store_true", help="time by process CPU time (a machine loaded by other jobs; one thread)")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # case row variant: peak memory in this process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from clipseg_sparse.runtime.allocator import keep_freed_memory

    if args.one:
        return one(*args.one, args.classes)
    keep_freed_memory()
    print(f"{args.threads} thread(s), {args.classes} classes, best of {args.rounds} interleaved rounds after a warm-up, {'CPU' if args.cpu_time else 'wall'} time")
    print(f"{'case':32s} {'before s':>9s} {'after s':>9s} {'speed-up':>9s} {'before MiB':>11s} {'after MiB':>10s} {'ratio':>6s} {'max |diff|':>11s}")
    for case in args.cases:
        with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
            rows = build(case, args.classes, Path(tmp))
            for row, variants in rows.items():
                outs = {v: call() for v, call in variants.items()}  # warm-up, and the outputs compared
                diff = (outs["before"].float() - outs["after"].float()).abs().max().item()
                del outs
                best = {v: float("inf") for v in variants}
                clock = time.process_time if args.cpu_time else time.perf_counter
                for _ in range(args.rounds):
                    for v, call in variants.items():
                        t0 = clock()
                        call()
                        best[v] = min(best[v], clock() - t0)
                peak = {}
                for v in variants:
                    cmd = [sys.executable, __file__, "--one", case, row, v, "--classes", str(args.classes), "--threads", str(args.threads)]
                    peak[v] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])["peak_mib"]
                print(f"{row:32s} {best['before']:9.3f} {best['after']:9.3f} {best['before'] / best['after']:8.1f}x "
                      f"{peak['before']:11.0f} {peak['after']:10.0f} {peak['after'] / max(peak['before'], 1e-9):6.2f} {diff:11.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
