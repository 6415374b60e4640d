"""CorrCLIP through the engine: region support, mask class tokens, branches after ln_post, map correction.

The tiny random CLIP (3 blocks, patch 16) and a tiny DINO-layout ViT (patch 8, the `proxy` fixture of
test_proxyclip) stand in for ViT-B/16 and DINO ViT-B/8. The tiny model's spatial branch reads blocks 1..2
(the published 6..10 need 12 blocks); everything else is the published arithmetic.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from test_proxyclip import proxy  # noqa: F401  (fixture: tiny CLIP + tiny DINO installed as dino_vitb8)
from typer.testing import CliRunner

from conftest import TINY_CONFIG
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.methods.corrclip import region_vote
from clipseg_sparse.segment.regions import RegionFolder

TINY = "ext:dino_vitb8.qk[cos,scale:4,region:{eps}]/{norm}/cls:0/noffn/in:mean@1-2/mct:0.5"
IMAGENET = (torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))


def dbscan_one(dist: torch.Tensor, eps: float) -> list[int]:
    """sklearn DBSCAN(metric='precomputed', eps, min_samples=1).fit_predict by hand: every point is a core
    point, so clusters are the connected components of d <= eps, numbered in order of first point."""
    n = len(dist)
    label = [-1] * n
    cluster = 0
    for start in range(n):
        if label[start] != -1:
            continue
        label[start], todo = cluster, [start]
        while todo:
            i = todo.pop()
            for j in range(n):
                if label[j] == -1 and float(dist[i, j]) <= eps:
                    label[j] = cluster
                    todo.append(j)
        cluster += 1
    return label


def dino_qk(clip, backbone, pixels):
    """CorrCLIP's dino_feats: DINO's last-block q + k (CLS dropped, heads concatenated), L2-normalised."""
    mean, std = torch.tensor(clip.mean).view(1, 3, 1, 1), torch.tensor(clip.std).view(1, 3, 1, 1)
    f = backbone.features(((pixels * std + mean) - IMAGENET[0]) / IMAGENET[1], want=("qkv",))
    B, H, M, d = f.q.shape
    return F.normalize((f.q + f.k).transpose(1, 2).reshape(B, M, H * d), dim=-1)


def published_corrclip(clip, backbone, pixels, regions, eps, first=1, last=2, alpha=1.0, beta=0.5, tau=4.0, dino_feats=None, pos_interp="size"):
    """zdk258/CorrCLIP@103bc18 VisionTransformer.forward (v1: mask merging on) for one window, plain torch:
    MCTs concatenated in front of the tokens with an explicit attention mask in every block. regions: H x W
    ids with -1 present (the published code takes the window's minimum as unsegmented). CorrCLIPv2
    (CorrCLIPv2/open_clip/transformer.py): dino_feats given (1 x M x C on twice CLIP's grid, the whole
    image's VFM features cropped, resized and normalised by the caller) and eps None (merging commented out).
    Other grids than the tiny CLIP's native 4 x 4 take the engine's positional embedding (`pos_interp`; the
    published DINO-style rule is the engine's "scale", tested in test_model)."""
    v = clip.visual
    _, _, H, W = pixels.shape
    token_size, feat_shape = (H // 16, W // 16), (H // 8, W // 8)
    dino_feats = dino_qk(clip, backbone, pixels) if dino_feats is None else dino_feats
    similarity = torch.einsum("b m c, b n c -> b m n", dino_feats, dino_feats)
    masks = F.interpolate(regions[None, None].float(), size=feat_shape, mode="nearest").int().squeeze(1)
    mask_values = torch.unique(masks[0])
    merges = 0
    if eps is not None and mask_values.shape[0] > 2:  # mask merging
        region_masks = [idx == masks[0] for idx in mask_values]
        dino_feat = dino_feats[0].reshape(*feat_shape, -1)
        instance_feats = F.normalize(torch.stack([dino_feat[m].mean(dim=0) for m in region_masks]), dim=1)[1:]
        instance_sim = instance_feats @ instance_feats.T
        cluster = dbscan_one(instance_sim.max() - instance_sim, eps)
        merges = len(cluster) - len(set(cluster))
        for idx, cluster_v in enumerate(cluster, start=1):
            masks[0][region_masks[idx]] = cluster_v + 10000
    region_masks = [(idx == masks[0]).view(-1) for idx in torch.unique(masks[0])]  # scope
    equal_idx = torch.zeros_like(similarity[0]).bool()
    for mask in region_masks[1:]:
        equal_idx += torch.outer(mask, mask)
    mask = region_masks[0]
    equal_idx += (mask.unsqueeze(0) + mask.unsqueeze(1)) * (similarity[0] > similarity[0].mean())
    similarity[0][~equal_idx] = float("-inf")
    attn_weights = (similarity * tau).softmax(dim=-1)

    masks = F.interpolate(masks.float().unsqueeze(1), size=token_size, mode="nearest").int().squeeze(1)[0]
    region_masks = torch.stack([idx == masks for idx in torch.unique(masks)])
    x = v.conv1(pixels).reshape(1, v.conv1.out_channels, -1).permute(0, 2, 1)
    pos = v.positional_embedding if token_size == (4, 4) else clip.positional_embedding(token_size, pos_interp)  # tiny CLIP: 4 x 4 native
    x = v.ln_pre(torch.cat([v.class_embedding.view(1, 1, -1), x], dim=1) + pos)
    R = len(region_masks)
    x = torch.cat([x[:, :1].repeat(1, R, 1), x], dim=1)
    allowed = torch.zeros(x.shape[1], x.shape[1], dtype=torch.bool)
    allowed[R:, R:] = True
    allowed[:R, R] = True
    allowed[:R, R + 1 :] = region_masks.view(R, -1)
    attn_mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    feats_spatial = []
    for idx, blk in enumerate(v.transformer.resblocks[:-1]):
        x = blk(x, attn_mask=attn_mask)
        if first - 1 <= idx <= last - 1:
            feats_spatial.append(x[:, R:])
    blk = v.transformer.resblocks[-1]
    C = x.shape[-1]
    x_main_spatial = torch.cat([x[:, R:], torch.stack(feats_spatial).mean(0)], dim=0)
    val = F.linear(blk.ln_1(x_main_spatial), blk.attn.in_proj_weight[2 * C :], blk.attn.in_proj_bias[2 * C :])[:, 1:]
    val = val.permute(0, 2, 1).unflatten(2, token_size)
    val = F.interpolate(val, size=feat_shape, mode="bilinear", align_corners=False).flatten(2, 3).transpose(1, 2)
    x_main_spatial = blk.attn.out_proj(torch.bmm(attn_weights.expand(2, -1, -1), val))
    mct = blk(x, attn_mask=attn_mask)[0, :R]
    expand_masks = F.interpolate(region_masks.unsqueeze(1).float(), size=feat_shape, mode="nearest").flatten(1, -1)
    x_semantic = expand_masks.T @ mct
    f = v.ln_post(x_main_spatial[0]) + alpha * v.ln_post(x_main_spatial[1]) + beta * v.ln_post(x_semantic)
    return F.normalize(f @ v.proj, dim=-1).reshape(1, *feat_shape, -1), merges


def region_map(rng, H, W, n=6) -> torch.Tensor:
    """Blocky ids 0..n-1 on 8 x 8-pixel cells with unsegmented (-1) cells; every id and -1 present."""
    cells = rng.integers(-1, n, (H // 8) * (W // 8))
    cells[: n + 1] = np.arange(-1, n)
    cells = rng.permutation(cells).reshape(H // 8, W // 8)
    return torch.from_numpy(np.kron(cells, np.ones((8, 8), dtype=np.int64)))


@pytest.fixture(scope="module")
def window(proxy):  # noqa: F811
    torch.manual_seed(7)
    pixels = torch.randn(1, 3, 64, 64) * 0.5 + torch.linspace(-1, 1, 64).view(1, 1, 1, 64)  # smooth + noise
    return pixels, region_map(np.random.default_rng(0), 64, 64)


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_corrclip_equals_the_published_forward(proxy, window, eps):  # noqa: F811
    clip, backbone = proxy
    pixels, regions = window
    got = clip.encode_dense(pixels, TINY.format(eps=eps, norm="softmax"), regions=regions[None])
    with torch.no_grad():
        expected, merges = published_corrclip(clip, backbone, pixels, regions, eps)
    assert got.shape == (1, 8, 8, clip.embed_dim)
    assert (merges > 0) == (eps > 0)  # eps 0.5 merges some of the 6 regions, not all
    assert merges < 5
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    # teeth: without the semantic branch, or with the other merge distance, the features move
    assert (clip.encode_dense(pixels, TINY.format(eps=eps, norm="softmax").replace("/mct:0.5", "/mct:0"), regions=regions[None]) - got).abs().max() > 1e-2
    assert (clip.encode_dense(pixels, TINY.format(eps=0.5 - eps, norm="softmax"), regions=regions[None]) - got).abs().max() > 1e-3


def test_windows_with_different_region_counts_batch_like_single_windows(proxy, window):  # noqa: F811
    clip, _ = proxy
    pixels, regions = window
    other = torch.where(regions >= 3, 1, regions)  # fewer regions: the batch pads its MCTs
    spec = TINY.format(eps=0.5, norm="softmax")
    batched = clip.encode_dense(torch.cat([pixels, pixels.flip(-1)]), spec, regions=torch.stack([regions, other]))
    torch.testing.assert_close(batched[:1], clip.encode_dense(pixels, spec, regions=regions[None]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(batched[1:], clip.encode_dense(pixels.flip(-1), spec, regions=other[None]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm", ["softmax", "entmax:1.5", "sparsemax"])
def test_attention_stays_inside_the_scope(proxy, window, norm):  # noqa: F811
    """eps 0 merges nothing here, so the scope is the nearest-resized map itself, checked by a plain loop."""
    clip, backbone = proxy
    pixels, regions = window
    maps = clip.attention_maps(pixels, TINY.format(eps=0, norm=norm), regions=regions[None])[0, 0]
    ids = regions[::8, ::8].flatten().tolist()  # nearest 64 -> 8 takes pixel 8 i
    feats = dino_qk(clip, backbone, pixels)[0]
    cos = feats @ feats.T
    mean = float(cos.mean())
    outside = 0.0
    for i in range(64):
        for j in range(64):
            ok = (ids[i] == ids[j] and ids[i] >= 0) or ((ids[i] < 0 or ids[j] < 0) and float(cos[i, j]) > mean)
            if not ok:
                outside += float(maps[i, j])
    assert outside == 0.0
    torch.testing.assert_close(maps.sum(-1), torch.ones(64))
    assert (maps > 0).float().mean() < 0.5  # the scope removes most pairs


def test_entmax_to_one_equals_corrclip(proxy, window):  # noqa: F811
    clip, _ = proxy
    pixels, regions = window
    soft = clip.encode_dense(pixels, TINY.format(eps=0.5, norm="softmax"), regions=regions[None])
    near = clip.encode_dense(pixels, TINY.format(eps=0.5, norm="entmax:1.0005"), regions=regions[None])
    torch.testing.assert_close(near, soft, atol=2e-3, rtol=0)
    sparse = clip.encode_dense(pixels, TINY.format(eps=0.5, norm="entmax:1.5"), regions=regions[None])
    assert (sparse - soft).abs().max() > 1e-3
    assert str(__import__("clipseg_sparse.attention", fromlist=["PRESETS"]).PRESETS.get("corrclip-entmax").spec).startswith(
        "ext:dino_vitb8.qk[cos,scale:4,region:0.2]/entmax:1.5/"
    )


def test_region_vote_equals_a_plain_loop():
    rng = np.random.default_rng(3)
    labels = torch.from_numpy(rng.integers(0, 4, (20, 30)))
    regions = torch.from_numpy(rng.integers(-1, 6, (20, 30)))
    got = region_vote(labels, regions)
    expected = labels.clone()
    for r in range(6):
        cells = [(y, x) for y in range(20) for x in range(30) if regions[y, x] == r]
        counts = Counter(int(labels[y, x]) for y, x in cells)
        top = max(counts.values())
        winner = min(k for k, c in counts.items() if c == top)  # ties: the smaller label (torch.mode)
        for y, x in cells:
            expected[y, x] = winner
    assert torch.equal(got, expected) and not torch.equal(got, labels)


def test_segmenter_votes_on_the_original_regions_and_records_the_source(proxy, tmp_path):  # noqa: F811
    clip, _ = proxy
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    np.save(tmp_path / "a.npy", region_map(rng, 64, 96).numpy().astype(np.int32))
    source = RegionFolder(tmp_path)
    settings = InferenceSettings(resolution=0, window=64, stride=32)
    plain = Segmenter(clip, "cat,dog,sky", spec=TINY.format(eps=0.2, norm="entmax:1.5"), settings=settings, templates="single", regions=source)
    voted = Segmenter(clip, "cat,dog,sky", spec=plain.spec, settings=settings.replace(stages=("regionvote",)), templates="single", regions=source)
    before = plain.predict(rgb, "a.jpg").labels
    after = voted.predict_labels(rgb, "a.jpg")
    regions = np.load(tmp_path / "a.npy")
    assert np.array_equal(after, region_vote(torch.from_numpy(before), torch.from_numpy(regions).long()).numpy())
    assert not np.array_equal(after, before)
    assert voted.config()["regions"] == f"folder:{tmp_path}" and voted.config()["stages"] == ["regionvote"]
    with pytest.raises(ValueError, match="needs region masks"):
        Segmenter(clip, "cat,dog", spec="corrclip", templates="single")
    with pytest.raises(ValueError, match="stage regionvote needs region masks"):
        Segmenter(clip, "cat,dog", spec="sclip", settings=settings.replace(stages=("regionvote",)), templates="single")


def _segment(tmp_path, *extra):
    from clipseg_sparse.cli.app import app

    return CliRunner().invoke(app, [
        "segment", str(tmp_path / "img"), "--classes", "cat,dog", "--model", TINY_CONFIG, "--pretrained", "none",
        "--device", "cpu", "--templates", "single", "--resolution", "0", "--window", "64", "--stride", "32",
        "--out", str(tmp_path / "out"), *extra,
    ], env={"COLUMNS": "300"})  # fmt: skip


def test_segment_cli_regions(proxy, tmp_path):  # noqa: F811
    (tmp_path / "img").mkdir()
    (tmp_path / "masks").mkdir()
    rng = np.random.default_rng(5)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{name}.png")
    Image.fromarray((region_map(rng, 64, 80).numpy() + 1).astype(np.uint8)).save(tmp_path / "masks" / "a.png")
    spec = ["--attn", TINY.format(eps=0.2, norm="softmax")]
    for extra, message in (
        ([], "needs region masks for each image: give --regions FOLDER"),
        (["--regions", str(tmp_path / "masks")], "no region masks for 1 image(s) in"),
        (["--regions", str(tmp_path / "nowhere")], "nowhere: region-mask folder not found"),
    ):
        res = _segment(tmp_path, *spec, *extra)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    np.save(tmp_path / "masks" / "b.npy", region_map(rng, 64, 80).numpy().astype(np.int32))
    res = _segment(tmp_path, *spec, "--regions", str(tmp_path / "masks"))
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "out" / "a.json").read_text())
    assert f"folder:{tmp_path / 'masks'}" in json.dumps(record) and "mct:0.5" in json.dumps(record)


@pytest.mark.skipif(__import__("importlib").util.find_spec("sam2") is not None, reason="sam2 is installed here")
def test_sam2_regions_without_the_extra_stop_the_cli(proxy, tmp_path):  # noqa: F811
    (tmp_path / "img").mkdir()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "img" / "a.png")
    res = _segment(tmp_path, "--preset", "corrclip", "--regions", "sam2")
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and ".[proxy]" in lines[0] and "--regions sam2" in lines[0]


def test_ls_lists_the_presets_and_protocol():
    from clipseg_sparse.cli.app import app

    presets = CliRunner().invoke(app, ["ls", "presets"], env={"COLUMNS": "300"}).output
    protocols = CliRunner().invoke(app, ["ls", "protocols"], env={"COLUMNS": "300"}).output
    for name in ("corrclip ", "corrclip-entmax", "corrclip-l14 ", "corrclip-l14-entmax"):
        assert name in presets
    assert "corrclip" in protocols and "stages=regionvote" in protocols


def test_eval_corrclip_protocol_reads_regions_by_sample_id(proxy, tmp_path):  # noqa: F811
    from fake_benchmarks import make_benchmark

    from clipseg_sparse.cli.app import app
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.run import SweepPaths

    make_benchmark("voc21", tmp_path / "voc", n=2, size=(48, 64))
    samples = DATASETS.get("voc21").samples(tmp_path / "voc")
    (tmp_path / "masks" / "voc21").mkdir(parents=True)
    rng = np.random.default_rng(6)
    np.save(tmp_path / "masks" / "voc21" / f"{samples[0].id}.npy", region_map(rng, 48, 64).numpy().astype(np.int32))
    args = ["eval", "--dataset", "voc21", "--root", str(tmp_path / "voc"), "--protocol", "corrclip", "--attn", TINY.format(eps=0.2, norm="softmax"),
            "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", "64",
            "--window", "64", "--stride", "32", "--out", str(tmp_path / "voc.json")]  # fmt: skip
    for extra, message in (([], "needs region masks"), (["--regions", str(tmp_path / "masks" / "voc21")], f"e.g. {samples[1].id}")):
        res = CliRunner().invoke(app, args + extra, env={"COLUMNS": "300"})
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output
    np.save(tmp_path / "masks" / "voc21" / f"{samples[1].id}.npy", region_map(rng, 48, 64).numpy().astype(np.int32))
    res = CliRunner().invoke(app, args + ["--regions", str(tmp_path / "masks" / "voc21")], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "voc.json").read_text())["config"]
    assert config["stages"] == ["regionvote"] and config["regions"] == f"folder:{tmp_path / 'masks' / 'voc21'}"
    # a sweep's --regions DIR reads DIR/<dataset>/
    assert SweepPaths(out=tmp_path, regions={"*": tmp_path / "masks"}).region_source("voc21").source() == f"folder:{tmp_path / 'masks' / 'voc21'}"
    assert SweepPaths(out=tmp_path).region_source("voc21") is None


@pytest.mark.parametrize("spec", ["sclip", "naclip-entmax", "proxyclip", "qq+kk/softmax/cls:0.3/in:sum@1-2"])
def test_specs_without_regions_keep_their_features(proxy, spec):  # noqa: F811
    """encode_dense now applies ln_post to all tokens (branches of mct); without mct it must give exactly
    the features of the former rule, ln_post of the patch tokens of encode_tokens' output."""
    from clipseg_sparse.attention import encode_tokens, resolve_spec

    clip, _ = proxy
    torch.manual_seed(8)
    pixels = torch.randn(2, 3, 64, 48)
    x, grid = clip._embed(pixels)
    tokens = encode_tokens(clip.visual, x, resolve_spec(spec), grid, pixels, context={"backbones": clip.proxies})
    former = F.normalize((clip.visual.ln_post(tokens[:, 1:]) @ clip.visual.proj).float(), dim=-1)
    got = clip.encode_dense(pixels, spec)
    assert torch.equal(got.flatten(1, 2), former)
