"""LPOSS / LPOSS+ (`lp:patch`, `lp:pixel`, presets `lposs`, `lposs+`) against transcriptions of the published code.

The references transcribe `vladan-stojnic/LPOSS@2a6eced:segmentation/evaluation/lposs_eval.py` with dense torch
matrices in float64 in place of faiss / cupy: `get_lposs_laplacian` (faiss' exact inner-product kNN as a full
sort, the N x N cdist), `normalize_connection_graph`, cupyx's `cg` (per class, from zero), `get_pixel_connections`
+ `get_lposs_plus_laplacian`, and the window loop of `slide_inference`. A tiny random CLIP (patch 16) and a tiny
DINO-layout ViT (patch 16) installed as `dino_vitb16` stand in for the published models.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kornia.color import rgb_to_lab

from conftest import installed_backbones, window_run
from clipseg_sparse.methods import lposs
from clipseg_sparse.models.backbones import BACKBONES, Backbone

from clipseg_sparse.segment.preprocess import window_boxes
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.windows import iter_window_features
from clipseg_sparse.stages import parse_stage

SETTINGS = InferenceSettings(resolution=0, window=48, stride=16)  # 50 x 70: 2 x 3 windows of 3 x 3 patches


@pytest.fixture(scope="module")
def dino(tiny_clip):
    import timm.models.vision_transformer as vt

    torch.manual_seed(0)
    model = vt.VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True).eval()
    backbone = Backbone(BACKBONES.get("dino_vitb16"), model)
    with installed_backbones(backbone, clips=[tiny_clip]):
        yield backbone


def image(seed=0, size=(50, 70)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


# -- transcriptions of the published code (dense, float64) -------------------------------------------------
def ref_lposs_laplacian(feats, locations, height_width, sigma, pix_dist_pow, k, gamma, alpha, patch_size):
    """`get_lposs_laplacian` with faiss' kNN as a full sort and cupy's csr_matrix as a dense matrix."""
    feats = feats.double()
    idx_window = torch.cat([w * torch.ones(h * ww, dtype=torch.int64) for w, (h, ww) in enumerate(height_width)])
    idx_h = torch.cat([torch.arange(h).view(-1, 1).repeat(1, w).flatten() for h, w in height_width])
    idx_w = torch.cat([torch.arange(w).view(1, -1).repeat(h, 1).flatten() for h, w in height_width])
    loc_h = locations[idx_window, 0] + (patch_size // 2) + idx_h * patch_size
    loc_w = locations[idx_window, 2] + (patch_size // 2) + idx_w * patch_size
    locs = torch.stack((loc_h, loc_w), 1).double()
    dist = ((locs[:, None] - locs[None]) ** 2).sum(-1).sqrt() ** pix_dist_pow
    geometry = torch.exp(-sigma * dist)
    N = feats.shape[0]
    all_sims = feats @ feats.T
    sims, ks = all_sims.sort(dim=1, descending=True)
    sims, ks = sims[:, :k].clone(), ks[:, :k]
    sims[sims < 0] = 0
    sims = sims**gamma * geometry.gather(1, ks)
    W = torch.zeros(N, N, dtype=torch.float64)
    W[torch.arange(N).repeat_interleave(k), ks.flatten()] += sims.flatten()
    W = W + W.T
    return torch.eye(N, dtype=torch.float64) - alpha * ref_normalize_connection_graph(W)


def ref_normalize_connection_graph(G):
    W = G - torch.diag(torch.diagonal(G))
    S = W.sum(1)
    S[S == 0] = 1
    D = 1.0 / torch.sqrt(S)
    return D[:, None] * W * D[None]


def ref_cupy_cg(A, b, tol=1e-6, maxiter=50):
    """cupyx.scipy.sparse.linalg.cg without preconditioner, x0 = 0, one right-hand side."""
    x = torch.zeros_like(b)
    b_norm = b.norm()
    if b_norm == 0:
        return b
    atol = tol * b_norm
    r = b - A @ x
    rho, p = 0, None
    for it in range(maxiter):
        z = r
        rho1, rho = rho, r @ z
        p = z if it == 0 else z + rho / rho1 * p
        q = A @ p
        alpha = rho / (p @ q)
        x = x + alpha * p
        r = r - alpha * q
        if r.norm() <= atol:
            break
    return x


def ref_perform_lp(L, preds, tol=1e-6, maxiter=50):
    return torch.stack([ref_cupy_cg(L, y, tol, maxiter) for y in preds.double().T], dim=1)


def ref_lab(rgb):
    """kornia.color.rgb_to_lab (kornia 0.7.4, the published dependency: linearize, rgb_to_xyz, D65 white
    (0.95047, 1, 1.08883), CIE f), 3 x H x W in [0, 1]."""
    rgb = rgb.double()
    lin = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    m = torch.tensor([[0.412453, 0.357580, 0.180423], [0.212671, 0.715160, 0.072169], [0.019334, 0.119193, 0.950227]], dtype=torch.float64)
    xyz = torch.einsum("ij,jhw->ihw", m, lin) / torch.tensor([0.95047, 1.0, 1.08883], dtype=torch.float64).view(3, 1, 1)
    f = torch.where(xyz > 0.008856, xyz.clamp(min=0.008856) ** (1 / 3), 7.787 * xyz + 4 / 29)
    return torch.stack((116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])))


def ref_pixel_laplacian(rgb, tau, neigh, alpha):
    """`get_pixel_connections` + `get_lposs_plus_laplacian` as a dense matrix."""
    lab = ref_lab(rgb).permute(1, 2, 0) / torch.tensor([100, 128, 128], dtype=torch.float64)
    H, W, _ = lab.shape
    lab = lab.reshape(H * W, -1)
    idx = torch.arange(H * W)
    locs = torch.stack((idx // W, idx % W), 1)
    rows, cols = [], []
    for mov in product(range(-neigh, neigh + 1), range(-neigh, neigh + 1)):
        if mov == (0, 0):
            continue
        new = locs + torch.tensor(mov)
        mask = (new[:, 0] >= 0) & (new[:, 1] >= 0) & (new[:, 0] < H) & (new[:, 1] < W)
        rows.append(torch.where(mask)[0])
        cols.append(new[mask, 0] * W + new[mask, 1])
    rows, cols = torch.cat(rows), torch.cat(cols)
    data = torch.exp(-((lab[rows] - lab[cols]) ** 2).sum(-1).sqrt() / tau)
    G = torch.zeros(H * W, H * W, dtype=torch.float64)
    G[rows, cols] = data
    return torch.eye(H * W, dtype=torch.float64) - alpha * ref_normalize_connection_graph(G)


def ref_slide_average(lp_preds, boxes, grid, size):
    """`slide_inference`'s loop: each window's propagated map resized bilinearly to the window, summed, divided by the count."""
    H, W = size
    h, w = grid
    n = lp_preds.shape[-1]
    preds, count = torch.zeros(1, n, H, W, dtype=torch.float64), torch.zeros(1, 1, H, W, dtype=torch.float64)
    for i, (y1, y2, x1, x2) in enumerate(boxes):
        crop = lp_preds[i * h * w : (i + 1) * h * w].reshape(h, w, n).permute(2, 0, 1)[None]
        preds += F.pad(F.interpolate(crop, size=(y2 - y1, x2 - x1), mode="bilinear", align_corners=False), (x1, W - x2, y1, H - y2))
        count[:, :, y1:y2, x1:x2] += 1
    return (preds / count)[0]


def window_inputs(clip, seg: Segmenter, img: np.ndarray, dino: Backbone):
    """Per-window MaskCLIP patch cosines (nodes x names), DINO values (nodes x C), boxes and the network input."""
    mean, std = torch.tensor(clip.mean).view(1, 3, 1, 1), torch.tensor(clip.std).view(1, 3, 1, 1)
    pixels = (torch.from_numpy(img).permute(2, 0, 1)[None].float() / 255 - mean) / std
    boxes, cos = [], []
    for chunk, feats in iter_window_features(window_run(clip, pixels, seg.spec, window=SETTINGS.window, stride=SETTINGS.stride)):
        boxes += chunk
        cos.append(torch.einsum("bhwd,nd->bhwn", feats, seg.text))
    cos = torch.cat(cos)
    crops = torch.cat([pixels[..., a:b, c:d] for a, b, c, d in boxes]) * std + mean
    imnet = (crops - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    f = dino.features(imnet, want=("qkv",))  # q/k/v checked against the block in test_backbones
    B, heads, M, d = f.v.shape
    values = F.normalize(f.v.permute(0, 2, 1, 3).reshape(B * M, heads * d), dim=-1)  # `extract_feats("v")`, tokens x (heads d)
    return cos, values, boxes, pixels


# -- the graph, the Laplacian and the solver ----------------------------------------------------------------
def test_patch_laplacian_matches_the_published_graph():
    g = torch.Generator().manual_seed(1)
    boxes = [(0, 48, 0, 48), (0, 48, 16, 64), (16, 64, 0, 48)]
    feats = F.normalize(torch.randn(3 * 9, 8, generator=g), dim=-1)
    locations = torch.tensor([[a, b, c, d] for a, b, c, d in boxes], dtype=torch.float64)
    for k, gamma, sigma, alpha in ((7, 3.0, 0.01, 0.95), (27, 1.0, 0.1, 0.5)):
        ref = ref_lposs_laplacian(feats, locations, [(3, 3)] * 3, sigma, 1.0, k, gamma, alpha, 16)
        graph = lposs.patch_graph(feats, lposs.patch_centres(boxes, (3, 3), 16), k, gamma, sigma)
        ours = lposs.normalized_laplacian(graph, alpha).to_dense().double()
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
        assert (ours != 0).sum() < ours.numel() or k == 27  # sparse: only the kNN pairs (and their transposes)


def test_normalized_laplacian_keeps_isolated_nodes():
    w = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]]).to_sparse()
    ours = lposs.normalized_laplacian(w, 0.9).to_dense().double()
    ref = torch.eye(3, dtype=torch.float64) - 0.9 * ref_normalize_connection_graph(w.to_dense().double())
    torch.testing.assert_close(ours, ref)
    assert ours[2, 2] == 1 and ours[2, :2].abs().sum() == 0  # self-loop only: degree 0 -> 1, no edges


def test_conjugate_gradient_solves_and_stops_as_cupy():
    g = torch.Generator().manual_seed(2)
    n = 60
    feats = F.normalize(torch.randn(n, 6, generator=g), dim=-1)
    centres = torch.rand(n, 2, generator=g) * 100
    L = lposs.normalized_laplacian(lposs.patch_graph(feats, centres, k=12), alpha=0.99)
    Y = torch.randn(n, 5, generator=g)
    Y[:, 3] = 0  # a zero column stays zero, as cupy returns b
    dense = L.to_dense().double()
    exact = torch.linalg.solve(dense, Y.double())
    torch.testing.assert_close(lposs.conjugate_gradient(L, Y, tol=1e-10, maxiter=1000).double(), exact, atol=1e-4, rtol=1e-4)
    for tol, maxiter in ((1e-6, 50), (1e-2, 50), (1e-6, 3)):  # early stops per column as the per-class loop
        ours = lposs.conjugate_gradient(L, Y, tol=tol, maxiter=maxiter).double()
        torch.testing.assert_close(ours, ref_perform_lp(dense, Y, tol, maxiter), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(lposs.conjugate_gradient(L, Y, maxiter=3).double(), exact, atol=1e-3)  # 3 steps do not converge


# -- the pixel graph ------------------------------------------------------------------------------------------
def test_lab_matches_known_colours_and_the_transcription():
    rgb = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]]).view(3, 1, 4)
    lab = rgb_to_lab(rgb)[:, 0].T
    torch.testing.assert_close(lab[0], torch.tensor([100.0, 0.0, 0.0]), atol=1e-2, rtol=0)  # white
    torch.testing.assert_close(lab[1], torch.tensor([53.24, 80.09, 67.20]), atol=2e-2, rtol=0)  # sRGB red
    x = torch.rand(3, 7, 9, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(rgb_to_lab(x).double(), ref_lab(x), atol=1e-4, rtol=1e-5)


def todays_pixel_graph(rgb: torch.Tensor, tau: float, radius: int) -> torch.Tensor:
    """The pixel affinity before issue 33, kept as the reference: every (pixel, neighbour) index pair of the
    square as a sparse COO matrix, coalesced (`normalized_laplacian` then made the Laplacian)."""
    _, H, W = rgb.shape
    lab = (rgb_to_lab(rgb.float()) / torch.tensor(lposs.LAB_SCALE).view(3, 1, 1)).reshape(3, -1)
    ys = torch.arange(H).view(-1, 1).expand(H, W).flatten()
    xs = torch.arange(W).view(1, -1).expand(H, W).flatten()
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


@pytest.mark.parametrize("size,radius", [((9, 11), 2), ((20, 31), 6), ((5, 7), 6)])  # the last: narrower than the square
def test_pixel_laplacian_is_todays_graph_made_laplacian(size, radius):
    """Written out from the stencil row by row (issue 33): the same CSR entries, in the same order, as the COO
    graph through `normalized_laplacian`."""
    rgb = torch.rand(3, *size, generator=torch.Generator().manual_seed(4))
    ours = lposs.pixel_laplacian(rgb, 0.1, radius, 0.95, band=3)
    today = lposs.normalized_laplacian(todays_pixel_graph(rgb, 0.1, radius), 0.95)
    assert torch.equal(ours.crow_indices().long(), today.crow_indices()) and torch.equal(ours.col_indices().long(), today.col_indices())
    assert torch.equal(ours.values(), today.values())


def test_pixel_laplacian_reads_kornias_lab():
    """The weights from kornia's own Lab (the published code's), to float32 rounding: OpenCV's white point
    (0.950456, 1.088754) moved Lab b by up to 4.7e-3."""
    rgb = torch.rand(3, 9, 11, generator=torch.Generator().manual_seed(4))
    ours = lposs.pixel_laplacian(rgb, tau=0.1, radius=2, alpha=0.95).to_dense().double()
    lab = (rgb_to_lab(rgb) / torch.tensor([100.0, 128, 128]).view(3, 1, 1)).reshape(3, -1).double()
    rows, cols = (ours - torch.eye(99, dtype=torch.float64)).nonzero().T
    w = torch.zeros(99, 99, dtype=torch.float64)
    w[rows, cols] = torch.exp(-(lab[:, rows] - lab[:, cols]).norm(dim=0) / 0.1)
    hand = torch.eye(99, dtype=torch.float64) - 0.95 * ref_normalize_connection_graph(w)
    assert (ours - hand).abs().max() <= 1e-6


def test_pixel_laplacian_by_hand():
    rgb = torch.rand(3, 9, 11, generator=torch.Generator().manual_seed(4))
    L = lposs.pixel_laplacian(rgb, tau=0.1, radius=2, alpha=0.95).to_dense()
    H, W = 9, 11
    lab = ref_lab(rgb) / torch.tensor([100.0, 128, 128], dtype=torch.float64).view(3, 1, 1)
    w = lambda y, x, dy, dx: torch.exp(-(lab[:, y, x] - lab[:, y + dy, x + dx]).norm() / 0.1)  # noqa: E731
    y, x = 4, 5  # an interior pixel: its 5 x 5 square minus itself
    square = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3) if (dy, dx) != (0, 0)]
    degree = lambda y, x: sum(float(w(y, x, dy, dx)) for dy, dx in square if 0 <= y + dy < H and 0 <= x + dx < W)  # noqa: E731
    for dy, dx in ((-2, -2), (0, 1), (1, 0), (2, 2)):
        hand = -0.95 * float(w(y, x, dy, dx)) / (degree(y, x) * degree(y + dy, x + dx)) ** 0.5
        assert abs(float(L[y * W + x, (y + dy) * W + x + dx]) - hand) < 1e-5
    assert int((L[y * W + x] != 0).sum()) == 25 and L[y * W + x, y * W + x] == 1
    assert int((L[0] != 0).sum()) == 9  # the corner keeps the 3 x 3 - 1 neighbours inside the image, and itself
    assert int((L[y * W + x, (y + 3) * W + x] != 0)) == 0  # beyond the radius
    torch.testing.assert_close(L, L.T)
    ref = ref_pixel_laplacian(rgb, 0.1, 2, 0.95)
    torch.testing.assert_close(L.double(), ref, atol=1e-6, rtol=1e-5)


def test_lp_pixel_in_class_bands_equals_todays_solve():
    """Classes solved in bands over the written-out Laplacian (issue 33) vs today's: the COO graph's Laplacian,
    every class in one solve."""
    g = torch.Generator().manual_seed(2)
    rgb, cosine = torch.rand(3, 24, 30, generator=g), torch.randn(7, 24, 30, generator=g) * 0.05 + 0.2
    today = lposs.propagate(lposs.normalized_laplacian(todays_pixel_graph(rgb, 0.05, 3), 0.9), cosine.reshape(7, -1).T).T.reshape(7, 24, 30)
    ours = lposs.lp_pixel(cosine, rgb, 0.05, 3, 0.9, band=3)
    torch.testing.assert_close(ours, today, atol=1e-5, rtol=0)
    assert (ours - cosine).abs().max() > 1e-2  # it propagates


@pytest.fixture
def stencil_kernel(monkeypatch):
    from clipseg_sparse.runtime import native

    monkeypatch.setenv(native.ENV_SWITCH, "1")
    library = native.kernel("stencil")
    if library is None:
        pytest.skip("no C compiler here: lp:pixel multiplies by torch's CSR product")
    return library


@pytest.mark.parametrize("size,radius,columns", [((24, 30), 3, 8), ((9, 11), 2, 40), ((5, 20), 6, 16), ((31, 14), 6, 32)])
def test_stencil_product_is_the_csr_product(stencil_kernel, size, radius, columns):
    """The C product reads the values and row starts alone (the columns follow from the square in raster order):
    the CSR product to float rounding, at borders, for squares taller than the image, on 1 and 3 threads."""
    g = torch.Generator().manual_seed(sum(size))
    laplacian = lposs.pixel_laplacian(torch.rand(3, *size, generator=g), 0.05, radius, 0.9)
    block = torch.randn(size[0] * size[1], columns, generator=g)
    matrix = lposs.StencilLaplacian(stencil_kernel, laplacian, size, radius)
    expected = laplacian @ block
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            torch.testing.assert_close(matrix @ block, expected, atol=2e-6, rtol=1e-6)
    finally:
        torch.set_num_threads(threads)


def test_lp_pixel_with_the_c_product_equals_the_csr_solve(stencil_kernel, monkeypatch):
    """Bands of 3 classes padded to 8 columns: the same solution as torch's CSR product (each class its own CG)."""
    from clipseg_sparse.runtime import native

    g = torch.Generator().manual_seed(2)
    rgb, cosine = torch.rand(3, 24, 30, generator=g), torch.randn(7, 24, 30, generator=g) * 0.05 + 0.2
    ours = lposs.lp_pixel(cosine, rgb, 0.05, 3, 0.9, band=3)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    torch.testing.assert_close(ours, lposs.lp_pixel(cosine, rgb, 0.05, 3, 0.9, band=3), atol=1e-5, rtol=0)


# -- the stages end to end --------------------------------------------------------------------------------------
def test_lposs_matches_the_published_pipeline(tiny_clip, dino):
    img = image()
    names = "cat,dog,grass,sky"
    seg = Segmenter(tiny_clip, names, spec="maskclip", settings=SETTINGS)
    cos, values, boxes, pixels = window_inputs(tiny_clip, seg, img, dino)
    assert boxes == window_boxes(50, 70, 48, 16) and len(boxes) == 6
    for stage, k in (("lp:patch", 400), ("lp:patch:10:2:0.9:0.05", 10)):
        params = parse_stage(stage).name.split(":")[2:]
        k_, gamma, alpha, sigma = int(params[0]), *map(float, params[1:])
        locations = torch.tensor(boxes, dtype=torch.float64)
        L = ref_lposs_laplacian(values, locations, [(3, 3)] * 6, sigma, 1.0, min(k_, 54), gamma, alpha, 16)
        lp = ref_perform_lp(L, cos.reshape(54, -1))
        ref = ref_slide_average(lp, boxes, (3, 3), (50, 70))
        preset = "lposs" if stage == "lp:patch" else f"maskclip/hook:{stage}"
        ours = Segmenter(tiny_clip, names, spec=preset, settings=SETTINGS).cosine(img).rows(0, 50)
        torch.testing.assert_close(ours.double(), ref, atol=2e-4, rtol=1e-4)
        plain = Segmenter(tiny_clip, names, spec="maskclip", settings=SETTINGS.replace(stages=(stage,))).cosine(img).rows(0, 50)
        torch.testing.assert_close(plain, ours)  # --stage after any preset = the preset's hook
    before = seg.cosine(img).rows(0, 50)
    assert (before.argmax(0) != ours.argmax(0)).any()  # propagation changes labels


def test_lposs_plus_matches_the_published_pipeline(tiny_clip, dino):
    img = image(5, (40, 56))
    settings = InferenceSettings(resolution=48, window=48, stride=16)  # the network input 48 x 67, then back to 40 x 56
    names = "cat,dog,grass"
    seg = Segmenter(tiny_clip, names, spec="lposs", settings=settings)
    net = seg.cosine(image(5, (40, 56)))
    ours = Segmenter(tiny_clip, names, spec="lposs+", settings=settings.replace(stages=("lp:pixel:0.05:2:0.9",))).cosine(img).rows(0, 40)
    # reference: the lposs map at the network input's size, the published pixel propagation there, then resized
    at_input = Segmenter(tiny_clip, names, spec="lposs", settings=settings)
    from clipseg_sparse.segment.windows import dense_cosine

    run = at_input.image_run(img)
    pixels, size = run.pixels, run.size
    preds = dense_cosine(run).rows(0, size[0])
    rgb = (pixels[0] * torch.tensor(tiny_clip.std).view(3, 1, 1) + torch.tensor(tiny_clip.mean).view(3, 1, 1))
    L = ref_pixel_laplacian(rgb, 0.05, 2, 0.9)
    lp = ref_perform_lp(L, preds.reshape(preds.shape[0], -1).T).T.reshape(preds.shape)
    ref = F.interpolate(lp[None], size=(40, 56), mode="bilinear", align_corners=False)[0]
    torch.testing.assert_close(ours.double(), ref, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(net.rows(0, 40), ours, atol=1e-3)


def test_stage_texts_and_errors(tiny_clip):
    assert parse_stage("lp:patch").name == "lp:patch:400:3:0.95:0.01"
    assert parse_stage("lp:pixel").name == "lp:pixel:0.01:6:0.95"
    assert parse_stage("lp:patch:100").name == "lp:patch:100:3:0.95:0.01"
    assert parse_stage("lp:patch").kind == "windows" and parse_stage("lp:pixel").kind == "input"
    for bad in ("lp", "lp:edges", "lp:patch:0", "lp:patch:4.5", "lp:patch:10:1:1", "lp:pixel:0", "lp:pixel:0.1:0", "lp:patch:a"):
        with pytest.raises(ValueError, match="lp"):
            parse_stage(bad)
    from clipseg_sparse.attention import PRESETS

    assert str(PRESETS.get("lposs+").spec) == "id/softmax/hook:lp:patch:400:3:0.95:0.01/hook:lp:pixel:0.01:6:0.95"
    assert "dino_vitb16" in Segmenter(tiny_clip, "a,b", spec="lposs", settings=SETTINGS).plan.backbones
    with pytest.raises(ValueError, match="global stage"):
        Segmenter(tiny_clip, "a,b", spec="ext:dino_vitb16[cos]/softmax/cls:0/noffn/hook:sam", settings=SETTINGS.replace(stages=("lp:patch",)))


def test_protocols():
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    for name in ("lposs", "lposs+"):
        s = PROTOCOLS.get(name).settings("voc21")
        assert (s.resolution, s.window, s.stride, s.bg_threshold) == (448, 224, 112, 0.0)
        assert s.logit_scale == 1.0  # `lposs_eval.py`: softmax(preds) with no scale
        assert PROTOCOLS.get(name).spec_for("voc21") == PROTOCOLS.get(name).spec_for("ade20k")


def test_knn_keeps_faiss_neighbour_order_on_ties():
    """`knn_gpu` of the published graph: equal similarities (duplicate features) in faiss's order."""
    import faiss

    g = torch.Generator().manual_seed(0)
    base = F.normalize(torch.randn(6, 8, generator=g), dim=1)
    feats = base[torch.randint(0, 6, (300,), generator=g)]
    sims, idx = lposs.knn(feats, 20)
    ref_sims, ref_idx = faiss.knn(feats.numpy(), feats.numpy(), 20, metric=faiss.METRIC_INNER_PRODUCT)
    assert np.array_equal(idx.numpy(), ref_idx) and np.array_equal(sims.numpy(), ref_sims)
    assert idx.shape == (300, 20) and lposs.knn(feats[:5], 20)[1].shape == (5, 5)
