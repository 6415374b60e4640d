"""LPOSS and LPOSS+ (Stojnic, Kalantidis, Tolias, CVPR 2025): label propagation over patches and pixels.

Read from `vladan-stojnic/LPOSS@2a6eced` (`segmentation/evaluation/lposs_eval.py`: `get_lposs_laplacian`,
`normalize_connection_graph`, `dfs_search`, `perform_lp`, `get_pixel_connections`,
`get_lposs_plus_laplacian`, `LPOSS_Infrencer.slide_inference`; `models/lposs/lposs.py`;
`models/maskclip/maskclip.py`; `configs/lposs.yaml`, `configs/lposs_plus.yaml`; research/peers-2026.md 2.4).

- `lp:patch[:K[:GAMMA[:ALPHA[:SIGMA]]]]` (windows stage, default lp:patch:400:3:0.95:0.01): one graph over
  the patches of *all* windows of the image: nodes = every window's patches, edges = each node's k nearest
  neighbours by inner product of DINO ViT-B/16 last-block values (heads concatenated, L2-normalised), the
  similarity clipped at 0, raised to GAMMA and multiplied by exp(-SIGMA * d) (d: pixel distance between the
  patch centres on the network input); W + W^T, diagonal removed, D^-1/2 W D^-1/2, L = I - ALPHA Wn; every
  name's column of the patch cosines solved L z = y by conjugate gradient (tol 1e-6 relative to |y|, at most
  50 steps, from zero: cupyx's `cg`). The windows' propagated maps are then upsampled and averaged as usual.
- `lp:pixel[:TAU[:RADIUS[:ALPHA]]]` (post stage at the network input's size, default lp:pixel:0.01:6:0.95):
  LPOSS+'s pixel graph on the window-averaged map: every pixel joined to the (2 RADIUS + 1)^2 - 1 pixels of
  its square neighbourhood with weight exp(-|Lab_i - Lab_j| / TAU), Lab of the network input divided by
  (100, 128, 128); the same normalisation, ALPHA and CG; the result resized bilinearly to the original size.

Both solve with torch sparse matrices (CSR products; no N x N matrix is formed) and a conjugate gradient
that runs the names' columns together (lp:pixel: bands of 32), each stopping at its own step as the published
per-class loop does. The pixel graph is a fixed stencil, so its Laplacian is written out row by row
(`pixel_laplacian`); its product stays a CSR product: on this CPU (one thread, 336 x 448, 150 classes) it was
faster than the stencil's 169 shifted multiply-adds (7x slower) and than banded block matrix products (1.2x
slower), benchmarks/README.md.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..attention.presets import register_preset
from ..attention.terms import parse_number
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..runtime import native
from ..stages import STAGES, Stage

LP_PROXY = "dino_vitb16"  # `vit_arch: vit_base`, `vit_patch_size: 16`, `enc_type_feats: "v"`
PATCH_K, PATCH_GAMMA, LP_ALPHA, PATCH_SIGMA, PATCH_DIST_POW = 400, 3.0, 0.95, 0.01, 1.0
PIXEL_TAU, PIXEL_RADIUS = 0.01, 6  # r: 13, neigh = r // 2
PIXEL_BAND = 32  # classes solved together by lp:pixel (the CSR product is as fast per class from 32 columns on)
CG_TOL, CG_MAXITER = 1e-6, 50
LAB_SCALE = (100.0, 128.0, 128.0)


# -- graphs and the solver ---------------------------------------------------------------------------------
def knn(feats: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest neighbours of every row of feats (N x C) among all rows by inner product, itself
    included: (similarities N x k, indices N x k), best first. faiss's exact search, as the published code
    (`knn_gpu`, METRIC_INNER_PRODUCT): equal similarities keep faiss's neighbour order (torch.topk orders
    ties otherwise, which moved the propagated scores by 9.4e-4)."""
    import faiss

    k = min(k, feats.shape[0])
    x = np.ascontiguousarray(feats.detach().float().cpu().numpy())
    sims, idx = faiss.knn(x, x, k, metric=faiss.METRIC_INNER_PRODUCT)
    return torch.from_numpy(sims).to(feats.device, feats.dtype), torch.from_numpy(idx).to(feats.device)


def patch_centres(boxes: Sequence[tuple[int, int, int, int]], grid: tuple[int, int], patch: int) -> torch.Tensor:
    """N x 2 (y, x) pixel centres of every window's patches on the network input, windows in order and
    patches row-major: y1 + patch // 2 + i * patch (LPOSS's `loc_h`, `loc_w`)."""
    h, w = grid
    i = torch.arange(h).view(-1, 1).expand(h, w).flatten()
    j = torch.arange(w).view(1, -1).expand(h, w).flatten()
    return torch.cat([torch.stack((y1 + patch // 2 + i * patch, x1 + patch // 2 + j * patch), 1) for y1, _, x1, _ in boxes]).float()


def patch_graph(
    feats: torch.Tensor, centres: torch.Tensor, k: int = PATCH_K, gamma: float = PATCH_GAMMA,
    sigma: float = PATCH_SIGMA, dist_pow: float = PATCH_DIST_POW,
) -> torch.Tensor:
    """LPOSS's symmetric kNN affinity W + W^T (sparse COO, coalesced, N x N) of L2-normalised features
    (N x C) and patch centres (N x 2): w_ij = max(f_i . f_j, 0)^gamma exp(-sigma |c_i - c_j|^dist_pow) for
    the k nearest j of each i (i itself among them; the Laplacian drops the diagonal)."""
    n = feats.shape[0]
    sims, idx = knn(feats, k)
    dist = (centres[:, None, :] - centres[idx]).norm(dim=-1) ** dist_pow  # the published N x N cdist, gathered
    values = sims.clamp_min(0) ** gamma * torch.exp(-sigma * dist.to(sims.dtype))
    rows = torch.arange(n, device=feats.device).repeat_interleave(idx.shape[1])
    w = torch.sparse_coo_tensor(torch.stack((rows, idx.flatten())), values.flatten(), (n, n), check_invariants=False)
    return (w + w.t()).coalesce()


def normalized_laplacian(w: torch.Tensor, alpha: float = LP_ALPHA) -> torch.Tensor:
    """`normalize_connection_graph` then `eye - alpha Wn` on a sparse N x N affinity: the diagonal removed,
    Wn = D^-1/2 W D^-1/2 with D the row sums (rows summing to 0 taken as 1), L = I - alpha Wn, as a sparse
    CSR matrix (the solver's products)."""
    w = w.coalesce()
    (r, c), v = w.indices(), w.values()
    off = r != c
    r, c, v = r[off], c[off], v[off]
    n = w.shape[0]
    degree = torch.zeros(n, dtype=v.dtype, device=v.device).index_add_(0, r, v)
    degree[degree == 0] = 1
    d = degree.rsqrt()
    eye = torch.arange(n, device=v.device)
    indices = torch.cat([torch.stack((r, c)), torch.stack((eye, eye))], dim=1)
    values = torch.cat([-alpha * d[r] * v * d[c], torch.ones(n, dtype=v.dtype, device=v.device)])
    with warnings.catch_warnings():  # "sparse CSR support is in beta": products of CSR by dense are what is used
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_coo_tensor(indices, values, (n, n), check_invariants=False).coalesce().to_sparse_csr()


def conjugate_gradient(a: torch.Tensor, b: torch.Tensor, tol: float = CG_TOL, maxiter: int = CG_MAXITER) -> torch.Tensor:
    """Solve A X = B (A: N x N symmetric positive definite, sparse, dense or any `A @ X`; B: N x M) column by column as
    cupyx.scipy.sparse.linalg.cg(A, b, tol=tol, maxiter=maxiter) does, all columns in one product per step:
    from x = 0, stop a column after the step its residual norm is <= tol |b| (a zero column stays zero).

    The vectors are updated in place through one work buffer (the same products and sums per entry): fresh
    N x M temporaries cost more than the arithmetic (a 267,000 x 32 product into a new tensor 30 ms, into the
    buffer 4 ms). The residual norm is the square root of the next step's r.r (cupy's nrm2 and dot, one pass)."""
    b = b.float()
    x = torch.zeros_like(b)
    r = b.clone()
    work = torch.empty_like(b)
    atol = tol * b.norm(dim=0)
    active = atol > 0
    p = torch.zeros_like(b)
    rho_old = torch.ones(b.shape[1], dtype=b.dtype, device=b.device)
    rho = torch.mul(r, r, out=work).sum(0)
    for step in range(maxiter):
        if not bool(active.any()):
            break
        beta = torch.zeros_like(rho) if step == 0 else rho / torch.where(active, rho_old, torch.ones_like(rho_old))
        p.mul_(beta).add_(r)  # r + beta p
        q = a @ p
        alpha = torch.where(active, rho / torch.where(active, torch.mul(p, q, out=work).sum(0), torch.ones_like(rho)), torch.zeros_like(rho))
        x.add_(torch.mul(p, alpha, out=work))
        r.sub_(torch.mul(q, alpha, out=work))
        rho_old, rho = rho, torch.mul(r, r, out=work).sum(0)
        active &= ~(rho.sqrt() <= atol)
    return x


def propagate(laplacian: torch.Tensor, y: torch.Tensor, tol: float = CG_TOL, maxiter: int = CG_MAXITER) -> torch.Tensor:
    """`perform_lp`: every column of y (N x names) solved against the Laplacian, fp32."""
    return conjugate_gradient(laplacian, y, tol, maxiter)


# -- lp:patch --------------------------------------------------------------------------------------------
def proxy_values(crops: torch.Tensor, backbone, clip_mean: Sequence[float], clip_std: Sequence[float]) -> torch.Tensor:
    """B x h x w x C L2-normalised last-block values of the backbone (heads concatenated, CLS dropped) on
    crops (B x 3 x H x W) normalised with CLIP's mean and std: `extract_feats(type_feats="v")`, normalised
    over channels."""
    x = backbone.from_clip_pixels(crops.float(), clip_mean, clip_std)
    out = backbone.features(x, want=("qkv",))
    B, heads, _, d = out.v.shape
    gh, gw = out.grid
    return F.normalize(out.v.transpose(1, 2).reshape(B, gh, gw, heads * d).float(), dim=-1)


def window_crops(pixels: torch.Tensor, boxes: Sequence[tuple[int, int, int, int]], patch: int) -> torch.Tensor:
    """The windows of pixels (1 x 3 x H x W) zero-padded at the bottom and right to whole patches (LPOSS's
    `make_input_divisible`): B x 3 x h' x w'."""
    y1, y2, x1, x2 = boxes[0]
    crops = torch.cat([pixels[..., a:b, c:d] for a, b, c, d in boxes])
    return F.pad(crops, (0, -(x2 - x1) % patch, 0, -(y2 - y1) % patch))


def lp_patch(
    cosine: torch.Tensor, boxes: Sequence[tuple[int, int, int, int]], patch: int, feats: torch.Tensor,
    k: int = PATCH_K, gamma: float = PATCH_GAMMA, alpha: float = LP_ALPHA, sigma: float = PATCH_SIGMA,
) -> torch.Tensor:
    """LPOSS's joint propagation of B x h x w x N patch cosines over the kNN graph of all B windows'
    patches (feats: B x h' x w' x C L2-normalised proxy features of the windows, DINO ViT-B/16 values in the
    preset, resized bilinearly to CLIP's grid when their grid differs). Returns B x h x w x N."""
    B, h, w, n = cosine.shape
    if feats.shape[1:3] != (h, w):
        feats = F.normalize(F.interpolate(feats.permute(0, 3, 1, 2), size=(h, w), mode="bilinear", align_corners=False).permute(0, 2, 3, 1), dim=-1)
    feats = feats.to(cosine.device).reshape(B * h * w, -1)
    graph = patch_graph(feats, patch_centres(boxes, (h, w), patch).to(cosine.device), k, gamma, sigma)
    z = propagate(normalized_laplacian(graph, alpha), cosine.reshape(B * h * w, n))
    return z.view(B, h, w, n).to(cosine.dtype)


def _floats(name: str, args: str, defaults: Sequence[float], usage: str) -> list[float]:
    parts = args.split(":") if args else []
    if len(parts) > len(defaults):
        raise UserValueError(f"bad stage '{name}:{args}': {usage}")
    try:
        return [parse_number(p, name) for p in parts] + list(defaults[len(parts) :])
    except ValueError:
        raise UserValueError(f"bad stage '{name}:{args}': {usage}") from None


def _patch_stage(args: str) -> Stage:
    usage = "expected lp:patch[:K[:GAMMA[:ALPHA[:SIGMA]]]], K >= 1, GAMMA > 0, 0 < ALPHA < 1, SIGMA >= 0, e.g. lp:patch:400:3:0.95:0.01"
    k, gamma, alpha, sigma = _floats("lp:patch", args, (PATCH_K, PATCH_GAMMA, LP_ALPHA, PATCH_SIGMA), usage)
    if k != int(k) or k < 1 or gamma <= 0 or not 0 < alpha < 1 or sigma < 0:
        raise UserValueError(f"bad stage 'lp:patch:{args}': {usage}")
    name = f"lp:patch:{int(k)}:{gamma:g}:{alpha:g}:{sigma:g}"

    def run(cosine, boxes, image):
        backbone = image.backbone(LP_PROXY)
        feats = proxy_values(window_crops(image.pixels, boxes, backbone.info.patch_size), backbone, image.clip.mean, image.clip.std)
        return lp_patch(cosine, boxes, image.patch, feats, int(k), gamma, alpha, sigma)

    return Stage("windows", name, run, backbones=(LP_PROXY,))


# -- lp:pixel --------------------------------------------------------------------------------------------
def _neighbour_weights(lab: torch.Tensor, dy: int, dx: int, tau: float) -> torch.Tensor:
    """H x W weights exp(-|Lab_p - Lab_(p + (dy, dx))| / tau) of the 3 x H x W Lab image's pixels to their
    (dy, dx) neighbour, 0 where the neighbour is outside the image."""
    _, H, W = lab.shape
    out = torch.zeros(H, W, dtype=lab.dtype, device=lab.device)
    a, b, c, e = max(0, -dy), min(H, H - dy), max(0, -dx), min(W, W - dx)
    if a < b and c < e:
        dist = (lab[:, a:b, c:e] - lab[:, a + dy : b + dy, c + dx : e + dx]).square().sum(0).sqrt()
        out[a:b, c:e] = torch.exp(-dist / tau)
    return out


def _neighbour_rows(x: torch.Tensor, dy: int, dx: int, y0: int, y1: int) -> torch.Tensor:
    """(y1 - y0) x W: x (H x W) at each pixel's (dy, dx) neighbour for rows y0..y1, 0 outside the image."""
    H, W = x.shape
    out = torch.zeros(y1 - y0, W, dtype=x.dtype, device=x.device)
    a, b, c, e = max(y0, -dy), min(y1, H - dy), max(0, -dx), min(W, W - dx)
    if a < b and c < e:
        out[a - y0 : b - y0, c:e] = x[a + dy : b + dy, c + dx : e + dx]
    return out


def pixel_laplacian(rgb: torch.Tensor, tau: float = PIXEL_TAU, radius: int = PIXEL_RADIUS, alpha: float = LP_ALPHA, band: int = 16) -> torch.Tensor:
    """LPOSS+'s pixel Laplacian I - alpha D^-1/2 W D^-1/2 (`get_pixel_connections` + `get_lposs_plus_laplacian`) of a
    3 x H x W RGB image in [0, 1], as a CSR matrix over the N = H x W pixels row-major (int32 indices): each pixel
    joined to every other pixel of its (2 radius + 1)^2 square inside the image, w = exp(-|Lab_i - Lab_j| / tau), Lab
    divided by (100, 128, 128); D the row sums (0 taken as 1).

    Why not a sparse COO graph then `normalized_laplacian`: the neighbourhood is a fixed stencil, so the degrees are
    168 shifted sums and each row's entries come out in column order, `band` image rows at a time: no 25M-edge
    index pairs to sort and coalesce (2.8 GB at 336 x 448). The same numbers, summed in the same order; the
    weights are held (K x H x W) because exp of far colours (results near float32's underflow) is slow."""
    from kornia.color import rgb_to_lab  # the published code's own Lab (D65 white 0.95047, 1, 1.08883)

    _, H, W = rgb.shape
    dev = rgb.device
    lab = rgb_to_lab(rgb.float()) / torch.tensor(LAB_SCALE, device=dev).view(3, 1, 1)
    # every row's columns i + dy W + dx in increasing order (the raster order of the square when W > 2 radius)
    grid = sorted(((dy, dx) for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1)), key=lambda o: o[0] * W + o[1])
    centre = grid.index((0, 0))
    weights = torch.zeros(len(grid), H, W, device=dev)  # the centre's stays 0; exp of far colours is slow, so once
    degree = torch.zeros(H, W, device=dev)
    for k, (dy, dx) in enumerate(grid):
        if k != centre:
            weights[k] = _neighbour_weights(lab, dy, dx, tau)
            degree += weights[k]
    degree[degree == 0] = 1
    d = degree.rsqrt()
    dys, dxs = (torch.tensor(v, device=dev) for v in zip(*grid))
    ys, xs = torch.arange(H, device=dev), torch.arange(W, device=dev)
    inside_y = (ys[:, None] + dys >= 0) & (ys[:, None] + dys < H)  # H x K: the neighbour's row is in the image
    inside_x = (xs[:, None] + dxs >= 0) & (xs[:, None] + dxs < W)
    counts = (inside_y[:, None] & inside_x[None]).sum(-1).flatten()
    crow = torch.zeros(H * W + 1, dtype=torch.int64, device=dev)
    crow[1:] = counts.cumsum(0)
    values = torch.empty(int(crow[-1]), device=dev)
    cols = torch.empty(int(crow[-1]), dtype=torch.int32, device=dev)
    offsets = (dys * W + dxs).to(torch.int32)
    row_pattern = inside_x.flatten().nonzero().flatten()  # a row whose whole square is inside in y: its entries
    for y0 in range(0, H, band):
        y1 = min(y0 + band, H)
        scaled = -alpha * d[y0:y1]
        entries = torch.empty(y1 - y0, W, len(grid), device=dev)
        for k, (dy, dx) in enumerate(grid):
            entries[..., k] = 1.0 if k == centre else scaled * weights[k, y0:y1] * _neighbour_rows(d, dy, dx, y0, y1)
        pixel = torch.arange(y0 * W, y1 * W, dtype=torch.int32, device=dev).view(y1 - y0, W, 1)
        start, stop = int(crow[y0 * W]), int(crow[y1 * W])
        if bool(inside_y[y0:y1].all()):
            values[start:stop] = entries.view(y1 - y0, -1).index_select(1, row_pattern).flatten()
            cols[start:stop] = (pixel + offsets).view(y1 - y0, -1).index_select(1, row_pattern).flatten()
        else:
            inside = inside_y[y0:y1, None] & inside_x[None]  # rows x W x K
            values[start:stop] = entries[inside]
            cols[start:stop] = (pixel + offsets)[inside]
    with warnings.catch_warnings():  # "sparse CSR support is in beta": products of CSR by dense are what is used
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow.to(torch.int32), cols, values, (H * W, H * W))


class StencilLaplacian:
    """`pixel_laplacian`'s matrix times a dense block by the C kernel (`runtime/native/stencil.c`): the entries of
    a row are its pixel's square in raster order, so the values and row starts are all it reads, and each row's
    sums stay in registers 32 columns at a time (a 32-column product at 336 x 448: 0.05 s, torch's CSR product
    0.13 s). Rows are summed in the CSR's order; the sparse library's own order differs in the last bits (1e-6
    per product). Image rows are spread over torch's threads. Columns: a multiple of 8."""

    def __init__(self, library, laplacian: torch.Tensor, size: tuple[int, int], radius: int) -> None:
        self.library, self.size, self.radius = library, size, radius
        self.values = laplacian.values().float().contiguous()
        self.crow = laplacian.crow_indices().to(torch.int64).contiguous()

    def __matmul__(self, p: torch.Tensor) -> torch.Tensor:
        (H, W), p = self.size, p.contiguous()
        q = torch.empty_like(p)
        crow = ctypes.cast(self.crow.data_ptr(), ctypes.POINTER(ctypes.c_longlong))
        args = (native.float_pointer(self.values), crow, native.float_pointer(p), native.float_pointer(q), H, W, self.radius, p.shape[1])
        native.over_threads(lambda y0, y1: self.library.square_stencil_product(*args, y0, y1), H)
        return q


def lp_pixel(
    cosine: torch.Tensor, rgb: torch.Tensor, tau: float = PIXEL_TAU, radius: int = PIXEL_RADIUS, alpha: float = LP_ALPHA, band: int = PIXEL_BAND
) -> torch.Tensor:
    """LPOSS+: N x H x W scores propagated over the pixel graph of the 3 x H x W RGB image in [0, 1]. Each
    class is its own CG (its own steps and stop), so they are solved `band` classes at a time: the solver's
    N x H x W work vectors shrink to bands (the result the same). On CPU the CG's products run in C
    (`StencilLaplacian`, where the row order is the raster order: W > 2 radius), bands padded to whole
    8-column blocks with zero columns (a zero column stays zero), else as torch's CSR product."""
    n, H, W = cosine.shape
    laplacian = pixel_laplacian(rgb.to(cosine.device), tau, radius, alpha)
    library = native.kernel("stencil") if cosine.device.type == "cpu" and W > 2 * radius else None
    matrix = StencilLaplacian(library, laplacian, (H, W), radius) if library is not None else laplacian
    flat = cosine.reshape(n, H * W)
    out = torch.empty(n, H * W, dtype=torch.float32, device=cosine.device)
    for start in range(0, n, band):
        y = flat[start : start + band].T.float()
        if library is not None:
            y = F.pad(y, (0, -y.shape[1] % 8)).contiguous()
        out[start : start + band] = propagate(matrix, y)[:, : min(band, n - start)].T
    return out.view(n, H, W).to(cosine.dtype)


def _pixel_stage(args: str) -> Stage:
    usage = "expected lp:pixel[:TAU[:RADIUS[:ALPHA]]], TAU > 0, RADIUS >= 1, 0 < ALPHA < 1, e.g. lp:pixel:0.01:6:0.95"
    tau, radius, alpha = _floats("lp:pixel", args, (PIXEL_TAU, PIXEL_RADIUS, LP_ALPHA), usage)
    if tau <= 0 or radius != int(radius) or radius < 1 or not 0 < alpha < 1:
        raise UserValueError(f"bad stage 'lp:pixel:{args}': {usage}")
    name = f"lp:pixel:{tau:g}:{int(radius)}:{alpha:g}"
    return Stage("input", name, lambda cosine, rgb, run: lp_pixel(cosine, rgb, tau, int(radius), alpha))


def _lp_stage(args: str) -> Stage:
    """`lp:patch[...]` or `lp:pixel[...]`."""
    graph, _, rest = args.partition(":")
    if graph == "patch":
        return _patch_stage(rest)
    if graph == "pixel":
        return _pixel_stage(rest)
    raise UserValueError(f"bad stage 'lp:{args}': expected lp:patch[:K[:GAMMA[:ALPHA[:SIGMA]]]] or lp:pixel[:TAU[:RADIUS[:ALPHA]]]")


STAGES.register(
    "lp",
    _lp_stage,
    help="windows: LPOSS label propagation: lp:patch[:K:GAMMA:ALPHA:SIGMA] (kNN graph of DINO ViT-B/16 values over all "
    "windows' patches, default 400:3:0.95:0.01, windows stage) or lp:pixel[:TAU:RADIUS:ALPHA] (LPOSS+'s Lab pixel graph "
    "at the network input's size, default 0.01:6:0.95, post stage); conjugate gradient per name on sparse graphs",
)

# -- presets (their protocols `lposs`, `lposs+`: below) -------------------------------------------------------------------------------
LPOSS_NOTES = (
    "copied: MaskCLIP features (the value path with residual and FFN kept, ln_post, proj: `id/softmax`) and their "
    "patch cosines per 224-px window (stride 112) at short side 448; DINO ViT-B/16 last-block values of each window "
    "(heads concatenated, L2-normalised) as the graph features; one graph over all windows' patches: exact k = 400 "
    "inner-product neighbours, self included, negatives to 0, ^3, x exp(-0.01 d) with d the pixel distance of the "
    "patch centres (y1 + 8 + 16 i); W + W^T; diagonal removed, D^-1/2 W D^-1/2 with zero degrees taken as 1; "
    "L = I - 0.95 Wn; per name, conjugate gradient from 0 with tol 1e-6 relative to |y| and at most 50 steps "
    "(cupyx); the propagated window maps resized to their windows and averaged; LPOSS+: the window-averaged map at "
    "the network input's size, pixel graph of (2 x 6 + 1)^2 - 1 neighbours with exp(-|Lab_i - Lab_j| / 0.01), Lab "
    "(kornia's) divided by (100, 128, 128), same Laplacian and CG, then resized bilinearly to the original size; "
    "fixed: the k neighbours are found exactly on any device (faiss GPU is exact too), distances only for the "
    "kNN pairs (the code forms the N x N cdist), all names' columns solved in one product per step (each stops at "
    "its own step, as the per-class loop); not copied: the paper's CLIP is open_clip ViT-B-16 laion2b_s34b_b88k "
    "(--model ViT-B-16 --pretrained laion2b_s34b_b88k), its TCL class files with several background names "
    "reduced by max, fp32 on CPU (the code runs cupy on GPU)"
)
register_preset(
    "lposs",
    "id/softmax/hook:lp:patch",
    "LPOSS (Stojnic et al., CVPR 2025): MaskCLIP patch cosines propagated jointly over all windows on a kNN graph of "
    "DINO ViT-B/16 value features (k 400, gamma 3, spatial decay 0.01, alpha 0.95, conjugate gradient per class)",
    LPOSS_NOTES,
)
register_preset(
    "lposs+",
    "id/softmax/hook:lp:patch/hook:lp:pixel",
    "LPOSS+ (Stojnic et al., CVPR 2025): lposs, then propagation over a Lab pixel graph at the network input's size "
    "(13 x 13 neighbourhood, tau 0.01, alpha 0.95)",
    LPOSS_NOTES,
)


# TCL's dataset configs, short side 448, 224 / 112 windows; no probability threshold (background comes from class
# names there)
def _protocol(name: str) -> Protocol:
    return PROTOCOLS.register(
        name,
        Protocol(
            name=name,
            attention=name,
            class_names="plain",
            source="vladan-stojnic/LPOSS@2a6eced configs/lposs*.yaml, segmentation/configs/_base_/datasets/*.py",
            # mmcv Resize on the uint8 image; logit scale 1: the published code takes the softmax of the propagated
            # scores unscaled (it returns labels only, which no scale changes; this sets what `result.probs` holds)
            defaults=dict(resolution=448, window=224, stride=112, resize="opencv", logit_scale=1.0),
        ),
        help=f"{name.upper()} (CVPR 2025): short side 448, 224-px windows, stride 112, logit scale 1 (the published "
        "softmax is unscaled), no probability threshold",
    )


PROTOCOL = _protocol("lposs")
PROTOCOL_PLUS = _protocol("lposs+")

# LPOSS+ as PEARL's Table 1 reprints it (the LPOSS repository prints no table). Not measured here.
register_published(
    PROTOCOL_PLUS,
    {"voc21": 61.1, "context60": 34.6, "coco-object": 33.4, "voc20": 78.8, "context59": 37.8, "coco-stuff": 25.9,
     "cityscapes": 37.3, "ade20k": 21.8},
    "PGSmall/PEARL@c26062b assets/results.png (LPOSS+ row)",
    printed_average=41.3,
)  # fmt: skip
