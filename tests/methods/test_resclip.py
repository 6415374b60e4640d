"""ResCLIP (`resclip` preset, `feedback` tap, `resclip` protocol) against the published formula, written
out here from yvhangyang/ResCLIP@6b082d9 clip/model.py (forward, create_logit_temp, create_patch_matrix,
check_path, generate_attention_sfr, custom_attn) with plain loops, independently of the engine."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from conftest import window_run
from clipseg_sparse.attention import PRESETS, AttentionSpec
from clipseg_sparse.attention.feedback import first_pass_labels, sfr_map


def _pamr_reference(mask, image, iterations=10, dilations=(8, 16)):
    """NACLIP's / ResCLIP's pamr.py with clamped gathers (as tests/test_stages.py's reference)."""
    _, H, W = image.shape
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")

    def at(t, oy, ox):
        return t[:, (ys + oy).clamp(0, H - 1), (xs + ox).clamp(0, W - 1)]

    grid = [(dy * d, dx * d, (dy, dx) == (0, 0)) for d in dilations for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    sigma = torch.stack([at(image, oy, ox) for oy, ox, _ in grid], dim=1).std(dim=1)
    ring = [(oy, ox) for oy, ox, centre in grid if not centre]
    weights = torch.softmax(torch.stack([(-(image - at(image, oy, ox)).abs() / (1e-8 + 0.1 * sigma)).mean(0) for oy, ox in ring]), 0)
    for _ in range(iterations):
        mask = sum(weights[k] * at(mask, oy, ox) for k, (oy, ox) in enumerate(ring))
    return mask


def _sfr_reference(labels: list[list[int]], sigma: float = 5.0) -> tuple[torch.Tensor, int]:
    """generate_attention_sfr(delete_same_entity=True) pair by pair; returns the map and the number of
    same-label pairs whose path check failed."""
    h, w = len(labels), len(labels[0])
    N = h * w
    lab = [labels[i // w][i % w] for i in range(N)]
    pos = [(i // w, i % w) for i in range(N)]
    cheb = lambda a, b: max(abs(a[0] - b[0]), abs(a[1] - b[1]))  # noqa: E731
    K = max(cheb(a, b) for a in pos for b in pos)
    ts = torch.linspace(0, 1, K + 1)  # float32 steps, as check_path
    m = torch.zeros(N, N, dtype=torch.float64)
    failed = 0
    for i in range(N):
        for j in range(N):
            if lab[i] != lab[j]:
                continue
            steps = cheb(pos[i], pos[j])
            ok = True
            for k in range(steps + 1):  # only the first `steps` points of the K + 1 (the published quirk)
                y = int(torch.round(pos[i][0] * (1 - ts[k]) + pos[j][0] * ts[k]))
                x = int(torch.round(pos[i][1] * (1 - ts[k]) + pos[j][1] * ts[k]))
                ok &= lab[y * w + x] == lab[i]
            m[i, j] = 1.0 if ok else math.exp(-steps / K)
            failed += not ok
    size = min(N, int(6 * sigma + 1))
    size = size if size % 2 else size + 1
    kern = [math.exp(-((k - size // 2) ** 2) / (2 * sigma**2)) for k in range(size)]
    kern = [v / sum(kern) for v in kern]
    out = torch.zeros(N + 1, N + 1, dtype=torch.float64)
    for i in range(N):  # each row blurred along the flattened (raster) index, zero padding
        row = [max(0.0, sum(kern[k] * m[i, c + k - size // 2] for k in range(size) if 0 <= c + k - size // 2 < N)) for c in range(N)]
        out[i + 1, 1:] = torch.tensor(row) / (sum(row) + 1e-8)
    return out.float(), failed


RINGS = [[0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0], [0, 1, 2, 2, 1, 0], [0, 1, 2, 2, 1, 0], [0, 1, 1, 1, 1, 0]]  # 5 x 6, N < 31
SNAKE = [[3, 3, 3, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 3], [3, 3, 3, 3, 3, 1, 3], [3, 1, 1, 2, 3, 1, 3],
         [3, 1, 2, 2, 3, 3, 3], [3, 3, 3, 3, 3, 0, 0]]  # 6 x 7, N > 31  # fmt: skip


@pytest.mark.parametrize("labels", [RINGS, SNAKE])
def test_sfr_map_equals_the_published_loop(labels):
    ref, failed = _sfr_reference(labels)
    ours = sfr_map(torch.tensor(labels), 5.0)
    assert failed > 10  # the line check matters on these grids
    assert torch.allclose(ours, ref, atol=1e-6)
    assert (ours[0] == 0).all() and (ours[:, 0] == 0).all()


def _structured(size, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 3, size[0] // 16, size[1] // 16, generator=g)
    return F.interpolate(base, size=size, mode="bilinear", align_corners=False) + 0.2 * torch.randn(1, 3, *size, generator=g)


def _heads(blk, x):
    """q, k, v per head, H x N x d, of an open_clip block on x (1 x N x C)."""
    u = blk.ln_1(x)[0]
    N, C = u.shape
    H = blk.attn.num_heads
    q, k, v = F.linear(u, blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, dim=-1)
    return [t.reshape(N, H, C // H).transpose(0, 1) for t in (q, k, v)]


def _resclip_reference(clip, pixels, text_patches, thd, rcs, sfr, logit_scale=40.0, sigma=5.0):
    """VisionTransformer.forward with attn_strategy 'resclip', arch 'wo_resi', batch 1. The text is the
    first pass's own features at `text_patches` (so the labels vary); returns (features N x D, text,
    patch labels, fp16 feedback map)."""
    v = clip.visual
    H, W = pixels.shape[-2:]
    x, (h, w) = clip._embed(pixels[..., : H // 16 * 16, : W // 16 * 16])  # the patch convolution drops the rest
    blocks = v.transformer.resblocks
    maps = []
    for blk in blocks[:-1]:
        q, k, _ = _heads(blk, x)
        maps.append(torch.softmax(q @ k.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1))
        x = blk(x)
    attn_rcs = torch.stack([maps[i] for i in range(5, 9)]).mean(0)
    N = h * w
    omega = torch.zeros(N + 1, N + 1)
    for i in range(N):
        for j in range(N):
            omega[i + 1, j + 1] = math.exp(-((i // w - j // w) ** 2 + (i % w - j % w) ** 2) / (2 * sigma**2))

    def last_block(attn_sfr=None):
        blk = blocks[-1]
        q, k, val = _heads(blk, x)
        weights = k @ k.transpose(1, 2) * q.shape[-1] ** -0.5
        if attn_sfr is not None:
            weights = sfr[0] * ((1 - sfr[1]) * weights + sfr[1] * attn_sfr)
        weights = torch.softmax(weights + omega, dim=-1)
        weights = rcs[0] * ((1 - rcs[1]) * weights + rcs[1] * attn_rcs)
        out = blk.attn.out_proj((weights @ val).transpose(0, 1).reshape(N + 1, -1))
        return F.normalize(v.ln_post(out) @ v.proj, dim=-1)[1:]

    first = last_block()
    text = first[text_patches]
    logits = F.interpolate((first @ text.T).T.reshape(1, -1, h, w), size=(H, W), mode="bilinear", align_corners=False)[0]
    probs = torch.softmax(_pamr_reference(logits, pixels[0]) * logit_scale, dim=0)
    pred = probs.argmax(0)
    pred[probs.max(0)[0] < thd] = 0
    labels = []
    for r in range(h):
        row = []
        for c in range(w):
            counts = Counter(pred[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16].flatten().tolist())
            row.append(min(n for n in counts if counts[n] == max(counts.values())))  # torch.mode on CPU: smallest of ties
        labels.append(row)
    attn_sfr = _sfr_reference(labels, sigma)[0]
    attn_sfr = (attn_sfr / attn_sfr.max()).half().float()
    return last_block(attn_sfr), text, labels, attn_sfr


def test_resclip_equals_the_published_forward(vit_b16):
    torch.manual_seed(3)
    pixels = _structured((80, 112), seed=5)
    thd, rcs, sfr = 0.5, (2.0, 0.3), (2.2, 0.7)  # ResCLIP's VOC21 config
    spec = AttentionSpec.parse("resclip/softmax").replace(
        source=("1.4*(0.66*kk&1.54*feedback:0.5)", "0.6*attn@6-9")
    )
    with torch.no_grad():
        ref, text, labels, _ = _resclip_reference(vit_b16, pixels, [0, 11, 20, 33], thd, rcs, sfr)
        context = {"text": text, "logit_scale": 40.0}
        ours = vit_b16.encode_dense(pixels, spec, context=context).reshape(-1, 512)
        # the first pass's labels alone, from the engine's own first-pass features
        first = vit_b16.encode_dense(pixels, "1.4*kk+0.6*attn@6-9/softmax/gauss:5/nores/noffn")[0]
        engine_labels = first_pass_labels(torch.einsum("hwd,td->thw", first, text), pixels[0], 40.0, thd)
        naclip = vit_b16.encode_dense(pixels, "naclip").reshape(-1, 512)
        no_feedback = vit_b16.encode_dense(pixels, "1.4*kk+0.6*attn@6-9/softmax/gauss:5/nores/noffn").reshape(-1, 512)
    flat = sum(labels, [])
    assert len(set(flat)) >= 3 and 0 < flat.count(0) < len(flat)  # labels vary, some below the threshold
    assert engine_labels.tolist() == labels
    assert torch.allclose(ours, ref, atol=2e-5)
    assert (ours - no_feedback).abs().max() > 1e-2 and (ours - naclip).abs().max() > 1e-2


def test_resclip_on_a_whole_image_that_is_not_whole_patches(vit_b16):
    """remainder drop (VOC21 / VOC20 whole images): the network sees 80 x 96, the first pass upsamples to
    and runs PAMR on the whole 80 x 104 image, as the published create_logit_temp does."""
    from clipseg_sparse.segment.windows import dense_cosine

    torch.manual_seed(3)
    pixels = _structured((80, 104), seed=6)
    with torch.no_grad():
        ref, text, labels, _ = _resclip_reference(vit_b16, pixels, [0, 11, 20, 27], 0.5, (2.0, 0.3), (2.2, 0.7))
        spec = _resclip_protocol().spec_for("voc21", "resclip")
        ours = dense_cosine(window_run(vit_b16, pixels, spec, text, window=0, remainder="drop", logit_scale=40.0)).rows(0, 80)
        cut = vit_b16.encode_dense(pixels[..., :96], spec, context={"text": text, "logit_scale": 40.0}).reshape(-1, 512)
    expected = F.interpolate((ref @ text.T).T.reshape(1, -1, 5, 6), size=(80, 104), mode="bilinear", align_corners=False)[0]
    assert len(set(sum(labels, []))) >= 3
    assert torch.allclose(ours, expected, atol=5e-5)
    assert (cut - ref).abs().max() > 1e-3  # PAMR and the upsampling on the cut image would give other labels


def _resclip_protocol():
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    return PROTOCOLS.get("resclip")


def test_resclip_entmax_tends_to_resclip(vit_b16):
    torch.manual_seed(4)
    pixels = _structured((64, 80), seed=6)
    text = F.normalize(torch.randn(6, 512), dim=-1)
    context = {"text": text, "logit_scale": 40.0}
    spec = PRESETS.get("resclip-entmax").spec
    assert spec == PRESETS.get("resclip").spec.replace(normalizer="entmax:1.5")
    with torch.no_grad():
        soft = vit_b16.encode_dense(pixels, "resclip", context=context)
        near = vit_b16.encode_dense(pixels, spec.replace(normalizer="entmax:1.0001"), context=context)
        sparse = vit_b16.encode_dense(pixels, spec, context=context)
    assert (near - soft).abs().max() < 2e-3
    assert (sparse - soft).abs().max() > 1e-2


def test_feedback_needs_text_and_a_threshold(vit_b16):
    pixels = torch.zeros(1, 3, 32, 32)
    with pytest.raises(ValueError, match="text embeddings"):
        vit_b16.encode_dense(pixels, "resclip")
    for bad, fragment in [("kk&feedback/softmax/gauss:5", "THD"), ("kk&feedback:1.5/softmax/gauss:5", "0 <= THD <= 1"),
                          ("kk&feedbak:0.2/softmax", "feedback:THD")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            AttentionSpec.parse(bad)
    text = {"text": F.normalize(torch.randn(2, 512), dim=-1)}
    with pytest.raises(ValueError, match="gauss:SIGMA"):
        vit_b16.encode_dense(pixels, "kk&feedback:0.2/softmax", context=text)
    with pytest.raises(ValueError, match="other terms"):
        vit_b16.encode_dense(pixels, "feedback:0.2/softmax/gauss:5", context=text)


@pytest.mark.parametrize("name", ["resclip", "resclip-entmax"])
def test_resclip_specs_round_trip(name):
    spec = PRESETS.get(name).spec
    assert AttentionSpec.parse(str(spec)) == spec
    assert str(spec).startswith("1.4*(0.63*kk&1.47*feedback:0.25)+0.6*attn@6-9/")


# typed from yvhangyang/ResCLIP@6b082d9 configs/cfg_*.py: temp_thd, attn_rcs_weights, attn_sfr_weights, and settings
RESCLIP_PUBLISHED = {
    "voc21": (0.50, (2.0, 0.3), (2.2, 0.7), dict(resolution=336, window=0, bg_threshold=0.1)),
    "voc20": (0.10, (2.0, 0.6), (2.1, 0.6), dict(resolution=336, window=0, bg_threshold=0.0)),
    "context60": (0.30, (2.0, 0.3), (1.8, 0.7), dict(resolution=336, window=224, stride=112, bg_threshold=0.1)),
    "context59": (0.25, (2.0, 0.4), (1.8, 0.7), dict(resolution=336, window=224, bg_threshold=0.0)),
    "coco-object": (0.11, (2.0, 0.4), (1.8, 0.7), dict(resolution=336, bg_threshold=0.1)),
    "coco-stuff": (0.11, (2.0, 0.4), (1.8, 0.7), dict(resolution=336, window=224)),
    "cityscapes": (0.10, (2.0, 0.2), (2.1, 0.6), dict(resolution=560, window=224, stride=112)),
    "ade20k": (0.25, (2.0, 0.3), (2.1, 0.7), dict(resolution=336, window=224)),
}


@pytest.mark.parametrize("dataset", list(RESCLIP_PUBLISHED))
@pytest.mark.parametrize("preset", ["resclip", "resclip-entmax"])
def test_resclip_protocol_has_each_configs_constants(dataset, preset):
    from clipseg_sparse.evaluation.protocols import PROTOCOLS

    thd, (tau_r, lam_r), (tau_s, lam_s), settings = RESCLIP_PUBLISHED[dataset]
    proto = PROTOCOLS.get("resclip")
    spec = proto.spec_for(dataset, preset)
    assert spec.normalizer == PRESETS.get(preset).spec.normalizer
    (mixed, rcs) = spec.groups
    assert mixed.weight == pytest.approx(tau_r * (1 - lam_r)) and rcs.weight == pytest.approx(tau_r * lam_r)
    assert rcs.terms[0].tap == "attn@6-9"
    kk, fb = mixed.terms
    assert (kk.tap, fb.tap) == ("kk", f"feedback:{thd:g}")
    assert kk.weight == pytest.approx(tau_s * (1 - lam_s)) and fb.weight == pytest.approx(tau_s * lam_s)
    assert (spec.gauss_sigma, spec.residual, spec.ffn) == (5, False, False)
    s = proto.settings(dataset)
    for name, value in {**settings, "logit_scale": 40.0, "pamr": False, "renormalize": True}.items():
        assert getattr(s, name) == pytest.approx(value), name
    assert proto.spec_for(dataset, "naclip") == PRESETS.get("naclip").spec  # other specs run as given


def test_reproduce_grid_crosses_resclip_with_softmax_and_entmax():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("resclip")).grid
    assert list(g.models) == ["ViT-B-16", "ViT-L-14"] and set(g.datasets) == set(DATASETS.names()) and g.protocol == "resclip"
    assert set(g.attention_specs()) == {str(PRESETS.get(p).spec) for p in ("resclip", "resclip-entmax")}
    assert len(g.cells()) == 2 * 8 * 2


def test_ls_shows_resclip():
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    for what, name, paper in [("presets", "resclip", "ResCLIP (Yang et al."), ("presets", "resclip-entmax", "alpha-entmax"),
                              ("protocols", "resclip", "ResCLIP (CVPR 2025)")]:  # fmt: skip
        result = CliRunner().invoke(app, ["ls", what], env={"COLUMNS": "400"})
        assert result.exit_code == 0
        assert any(paper in line and f" {name} " in line for line in result.output.splitlines()), (name, result.output)


def test_eval_runs_each_datasets_constants(vit_b16, tmp_path):
    """evaluate under the resclip protocol runs the dataset's constants and writes them to the result."""
    from fake_benchmarks import make_benchmark

    from clipseg_sparse.evaluation.segmentation import evaluate

    make_benchmark("voc20", tmp_path, n=1, size=(36, 52))
    record = evaluate(vit_b16, "voc20", tmp_path, "resclip-entmax", protocol="resclip", progress=False, templates="none",
                      overrides={"resolution": 48}, cache_dir=tmp_path / "cache")  # fmt: skip
    assert record["config"]["attention"].startswith("0.8*(0.84*kk&1.26*feedback:0.1)+1.2*attn@6-9/entmax:1.5/")


def test_feedback_map_is_divided_by_its_maximum_and_rounded_to_fp16():
    """feedback_scores on a stand-in tower (ln_post and proj the identity): the map the final pass reads is
    the published map of the first pass's labels, over its maximum, in fp16 (`attn_sfr.to(torch.float16)`)."""
    from clipseg_sparse.attention.feedback import feedback_scores

    class Tower(torch.nn.Module):
        ln_post = torch.nn.Identity()
        proj = torch.eye(8)

    g = torch.Generator().manual_seed(2)
    tokens, windows = torch.randn(2, 1 + 4 * 5, 8, generator=g), _structured((64, 80), seed=2).repeat(2, 1, 1, 1)
    text = F.normalize(torch.randn(3, 8, generator=g), dim=-1)
    spec = PRESETS.get("resclip").spec
    out = feedback_scores(Tower(), tokens, (4, 5), windows, spec, {"text": text, "logit_scale": 40.0})
    assert out.shape == (2, 1, 21, 21) and (out.half().float() == out).all()
    for b in range(2):
        feats = F.normalize(tokens[b, 1:], dim=-1)
        labels = first_pass_labels((feats @ text.T).T.reshape(3, 4, 5), windows[b], 40.0, 0.25)
        ref = _sfr_reference(labels.tolist())[0]
        assert not torch.equal((ref / ref.max()).half().float(), ref / ref.max())  # the rounding is visible
        assert torch.allclose(out[b, 0], (ref / ref.max()).half().float(), atol=1e-3, rtol=0)
