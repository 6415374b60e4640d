"""Image banks and the retrieval stage (CorrCLIPv2): building, FAISS search, retrieval vs brute force,
resuming, refusal of other models, and corrclipv2 end to end against the published forward_slide.

Tiny random models: the 3-block CLIP of conftest (values), a second tiny CLIP of another width (the DFN
store), a tiny NaFlexViT as C-RADIOv3-L (keys), a tiny DINO as dino_vitb8 (the values' CorrCLIP body).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from conftest import installed_backbones
from test_corrclipv2 import Given, published_forward_slide, published_postprocess, query_idx_of
from test_dense_backbones import tiny_radio
from test_proxyclip import proxy  # noqa: F401  (fixture: tiny CLIP + tiny DINO installed as dino_vitb8)

from clipseg_sparse import load_clip
from clipseg_sparse.attention import resolve_spec
from clipseg_sparse.segment import bank as banks
from clipseg_sparse.segment.bank import BankError, ImageBank, ValueModel, build_bank, build_index, retrieval_logits, search
from clipseg_sparse.segment.plan import Plan
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.vocabulary import Vocabulary

ROOT = Path(__file__).resolve().parents[2]
VALUES = "ext:dino_vitb8.qk[cos,scale:4,region]/softmax/cls:0/noffn/in:mean@1-2/mct:0.5"
VALUE_SETTINGS = InferenceSettings(resolution=64, window=48, stride=32)
TINY_V2 = "ext:c_radio_v3_l.image[cos,scale:4,region]/softmax/cls:0/noffn/in:mean@1-2/mct:0.5/hook:retrieve:3:0.5"
NAMES = [["cat", "kitten"], ["grass"], ["sky"], ["road"]]


@pytest.fixture()
def models(proxy, tmp_path_factory):  # noqa: F811
    """(main tiny CLIP, aux tiny CLIP, tiny RADIO installed as c_radio_v3_l)."""
    clip = proxy[0]
    config = tmp_path_factory.mktemp("aux") / "tiny-aux.json"
    spec = json.loads((ROOT / "tests/data/tiny-vit.json").read_text())
    config.write_text(json.dumps({**spec, "embed_dim": 48}))
    torch.manual_seed(5)
    aux = load_clip(str(config), pretrained=None, device="cpu")
    radio = tiny_radio()
    with installed_backbones(radio, clips=[clip, aux]):
        yield clip, aux, radio


def write_images(folder: Path, n: int, seed: int = 0) -> tuple[list[tuple[Path, str]], dict[str, np.ndarray]]:
    """n smooth random RGB images (sizes vary) and their blocky region maps (-1 unsegmented)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    jobs, regions = [], {}
    for i in range(n):
        H, W = [(60, 80), (72, 56), (64, 64)][i % 3]
        base = rng.integers(0, 256, (H // 8 + 2, W // 8 + 2, 3)).astype(np.float32)
        rgb = F.interpolate(torch.from_numpy(base).permute(2, 0, 1)[None], (H, W), mode="bilinear", align_corners=False)[0]
        rgb = rgb.permute(1, 2, 0).clamp(0, 255).round().to(torch.uint8).numpy()
        name = f"img{i:02d}.png"
        Image.fromarray(rgb).save(folder / name)
        cells = rng.integers(-1, 4, (H // 8 + 1, W // 8 + 1))
        regions[name] = np.kron(cells, np.ones((8, 8), dtype=np.int64))[:H, :W]
        jobs.append((folder / name, name))
    return jobs, regions


class ByName:
    """A region source from a dict; `fail_at` raises at that image (a build killed there)."""

    def __init__(self, regions: dict[str, np.ndarray], fail_at: str | None = None) -> None:
        self.regions, self.fail_at = regions, fail_at

    def __call__(self, rgb, name):
        if name == self.fail_at:
            raise KeyboardInterrupt("killed")
        return self.regions[name]


def build(out, jobs, regions, clips, radio, index="flat", fail_at=None):
    values = [ValueModel(c, resolve_spec(VALUES), VALUE_SETTINGS) for c in clips]
    record = clips[0].proxies.config(["c_radio_v3_l"])["c_radio_v3_l"]
    return build_bank(jobs, out, values, radio, record, ByName(regions, fail_at), "test", index)


def brute_force_keys(radio, rgb, regions) -> tuple[np.ndarray, np.ndarray]:
    """(ids, keys): region means of the key features resized to the image with F.interpolate (not bands)."""
    f = F.normalize(F.interpolate(radio.image_feature_map(torch.from_numpy(rgb)), rgb.shape[:2], mode="bilinear", align_corners=False), dim=1)[0]
    ids = np.unique(regions)
    ids = ids[ids >= 0]
    return ids, np.stack([f[:, torch.from_numpy(regions == i)].mean(1).numpy() for i in ids])


def test_bank_rows_are_the_region_means(models, tmp_path):
    clip, aux, radio = models
    jobs, regions = write_images(tmp_path / "images", 3)
    manifest = build(tmp_path / "bank", jobs, regions, [clip, aux], radio)
    bank = ImageBank.open(tmp_path / "bank")
    assert isinstance(bank.keys, np.memmap) and all(isinstance(v, np.memmap) for v in bank.values.values())
    rows = np.load(tmp_path / "bank" / banks.ROWS)
    assert manifest["rows"] == len(rows) == bank.keys.shape[0] == bank.values["tiny-vit:none"].shape[0]
    assert [s["clip"] for s in manifest["values"]] == ["tiny-vit:none", "tiny-aux:none"]
    for i, (path, name) in enumerate(jobs):
        rgb = np.array(Image.open(path))
        ids, keys = brute_force_keys(radio, rgb, regions[name])
        mine = rows[:, 0] == i
        assert np.array_equal(rows[mine, 1], ids)
        np.testing.assert_allclose(bank.keys[mine].astype(np.float32), keys, atol=2e-3)  # float16 store
        # values: L2 of the region mean of the unnormalised dense features at the image's size
        fmap = ValueModel(clip, resolve_spec(VALUES), VALUE_SETTINGS).feature_map(rgb, regions[name]).rows(0, rgb.shape[0])
        expected = F.normalize(torch.stack([fmap[:, torch.from_numpy(regions[name] == r)].mean(1) for r in ids]), dim=-1).numpy()
        np.testing.assert_allclose(bank.values["tiny-vit:none"][mine].astype(np.float32), expected, atol=2e-3)
    assert not np.allclose(np.linalg.norm(fmap.flatten(1).numpy(), axis=0), 1.0)  # raw features, not unit vectors


def test_flat_search_equals_brute_force():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((500, 32)).astype(np.float16)
    queries = F.normalize(torch.randn(17, 32), dim=-1).numpy()
    scores, rows = search(build_index(keys, "flat"), queries, 20)
    k = keys.astype(np.float32)
    ip = queries @ (k / (np.linalg.norm(k, axis=1, keepdims=True) + 1e-12)).T
    expected = np.argsort(-ip, axis=1, kind="stable")[:, :20]
    assert np.array_equal(rows, expected)
    np.testing.assert_allclose(scores, np.take_along_axis(ip, expected, 1), atol=1e-5)
    _, few = search(build_index(keys[:5], "flat"), queries, 20)
    assert (few[:, 5:] == -1).all() and (few[:, :5] >= 0).all()


def test_ivfpq_recall_on_clustered_keys(capsys):
    """The published IVF-PQ (nlist 8 sqrt(N), m 32, 8 bits, nprobe min(256, nlist)) against exact search."""
    rng = np.random.default_rng(1)
    centres = rng.standard_normal((40, 64))
    keys = (centres[rng.integers(0, 40, 4000)] + 0.3 * rng.standard_normal((4000, 64))).astype(np.float16)
    queries = F.normalize(torch.from_numpy(keys[:200].astype(np.float32) + 0.1 * rng.standard_normal((200, 64)).astype(np.float32)), dim=-1).numpy()
    index = build_index(keys, "ivfpq")
    inner = banks._faiss().downcast_index(index.index)
    assert type(inner).__name__ == "IndexIVFPQ" and inner.nlist == int(8 * np.sqrt(4000)) and inner.pq.M == 32 and inner.pq.nbits == 8
    _, approx = search(index, queries, 20)
    _, exact = search(build_index(keys, "flat"), queries, 20)
    recall = np.mean([len(set(a) & set(e)) / 20 for a, e in zip(approx, exact)])
    with capsys.disabled():
        print(f"\nIVF-PQ recall@20 on 4000 clustered 64-d keys (nprobe {inner.nprobe} of {inner.nlist}): {recall:.3f}")
    assert recall > 0.5  # far above chance (20 / 4000)
    with pytest.raises(BankError, match="at least"):
        build_index(keys[:100], "ivfpq")


def numpy_support(bank: ImageBank, regions: np.ndarray, feats: np.ndarray, texts: dict[str, np.ndarray], k: int) -> np.ndarray:
    """Brute force: per region value (unsegmented too) q = L2(mean feature), the k largest inner products
    with the L2-normalised keys, support = L2(mean of the stored values), logits averaged over stores."""
    keys = np.asarray(bank.keys, dtype=np.float64)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True) + 1e-12
    out = np.zeros((len(next(iter(texts.values()))), *regions.shape))
    for v in np.unique(regions):
        m = regions == v
        q = feats[:, m].mean(1)
        q /= np.linalg.norm(q)
        top = np.argsort(-(keys @ q), kind="stable")[:k]
        logits = 0
        for store, text in texts.items():
            s = np.asarray(bank.values[store][top], dtype=np.float64).mean(0)
            logits = logits + text @ (s / np.linalg.norm(s))
        out[:, m] = (logits / len(texts))[:, None]
    return out


def test_retrieval_logits_equal_brute_force(models, tmp_path):
    clip, aux, radio = models
    jobs, regions = write_images(tmp_path / "images", 4)
    build(tmp_path / "bank", jobs, regions, [clip, aux], radio)
    bank = ImageBank.open(tmp_path / "bank")
    query_jobs, query_regions = write_images(tmp_path / "query", 1, seed=9)
    rgb = np.array(Image.open(query_jobs[0][0]))
    reg = torch.from_numpy(query_regions[query_jobs[0][1]])
    feats = radio.image_features(torch.from_numpy(rgb), rgb.shape[:2])[0]
    texts = {"tiny-vit:none": F.normalize(torch.randn(5, 64), dim=-1), "tiny-aux:none": F.normalize(torch.randn(5, 48), dim=-1)}
    got = retrieval_logits(reg, feats, bank, texts, k=3)
    expected = numpy_support(bank, reg.numpy(), feats.numpy(), {s: t.numpy().astype(np.float64) for s, t in texts.items()}, 3)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)
    one = retrieval_logits(reg, feats, bank, {"tiny-vit:none": texts["tiny-vit:none"]}, k=3)
    assert not torch.allclose(one, got)  # the second store changes the logits


def todays_retrieval_logits(regions: torch.Tensor, features: torch.Tensor, bank: ImageBank, texts: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """The retrieval before issue 33, kept as the reference: region means of the input-size map as one product
    with the pixels' one-hot region matrix, support logits painted by advanced indexing."""
    values, inverse = torch.unique(regions, return_inverse=True)
    onehot = F.one_hot(inverse.flatten(), len(values)).float()
    queries = F.normalize(((features.flatten(1).float() @ onehot) / onehot.sum(0)).T, dim=-1)
    _, rows = search(bank.index, queries.numpy(), k)
    logits = sum(bank.support(store, rows) @ text.float().T for store, text in texts.items()) / len(texts)
    return logits.T.contiguous()[:, inverse.flatten()].reshape(-1, *regions.shape)


@pytest.mark.parametrize("size", [(60, 80), (24, 20), (16, 16), (37, 51)])  # up, down, the map's own size, odd
def test_resized_region_means_equal_the_means_of_the_resized_map(size):
    torch.manual_seed(0)
    feats = torch.randn(96, 16, 16, dtype=torch.float64)
    regions = torch.randint(-1, 5, size)
    full = F.normalize(F.interpolate(feats[None], size=size, mode="bilinear", align_corners=False), dim=1)[0]
    expected = torch.stack([full[:, regions == r].mean(1) for r in range(5)])
    got = banks.resized_region_means(feats.float(), regions, 5)
    torch.testing.assert_close(got, expected, atol=1e-7, rtol=0)  # measured: 1e-8 (float32 map in, float64 sums)
    same = banks.resized_region_means(full.float(), regions, 5)  # an already resized, normalised map: its own means
    torch.testing.assert_close(same, expected, atol=1e-7, rtol=0)


def test_factored_region_means_equal_the_means_of_the_map_rows():
    """A CosineMap's region means from its small grid (issue 33) = the means of its rows at full size."""
    from clipseg_sparse.segment.maps import factored, resize_matrix

    g = torch.Generator().manual_seed(1)
    grid = torch.randn(7, 9, 12, generator=g)  # R x K x N
    H, W = 45, 61
    cmap = factored(grid, resize_matrix(7, H), resize_matrix(9, W))
    regions = torch.randint(-1, 6, (H, W), generator=g)
    full = cmap.rows(0, H).double()
    expected = torch.stack([full[:, regions == r].mean(1) for r in range(6)])
    torch.testing.assert_close(banks.factored_region_means(cmap, regions, 6, band=4), expected, atol=1e-6, rtol=0)  # float32 rows vs float64 sums


@pytest.mark.parametrize("high", [40, 10**12])  # a table over the id range; a sort where the range is wide
def test_region_index_equals_unique(high):
    regions = torch.randint(-3, 40, (30, 20)) * (high // 40)
    values, inverse = banks.region_index(regions)
    expected_values, expected_inverse = torch.unique(regions, return_inverse=True)
    assert torch.equal(values, expected_values) and torch.equal(inverse, expected_inverse)


def test_retrieval_equals_todays_one_hot_retrieval(models, tmp_path):
    """Region means reduced by region index from the raw key map, support painted by gather, fused band by band:
    the same logits as the one-hot arithmetic on the input-size map (issue 33), the fusion bit for bit."""
    clip, aux, radio = models
    jobs, regions = write_images(tmp_path / "images", 4)
    build(tmp_path / "bank", jobs, regions, [clip, aux], radio)
    bank = ImageBank.open(tmp_path / "bank")
    query_jobs, query_regions = write_images(tmp_path / "query", 1, seed=9)
    rgb = torch.from_numpy(np.array(Image.open(query_jobs[0][0])))
    size = (96, 112)
    reg = F.interpolate(torch.from_numpy(query_regions[query_jobs[0][1]])[None, None].float(), size=size, mode="nearest")[0, 0].long()
    texts = {"tiny-vit:none": F.normalize(torch.randn(5, 64), dim=-1), "tiny-aux:none": F.normalize(torch.randn(5, 48), dim=-1)}
    expected = todays_retrieval_logits(reg, radio.image_features(rgb, size)[0], bank, texts, k=3)
    raw = radio.image_feature_map(rgb)[0]
    assert raw.shape[-2:] != size  # the queries come from the patch-grid map, not the input-size one
    support, inverse = banks.region_support(reg, raw, bank, texts, k=3)
    torch.testing.assert_close(banks.paint(support, inverse), expected, atol=1e-6, rtol=0)  # measured: 0 (same neighbours)
    torch.testing.assert_close(retrieval_logits(reg, raw, bank, texts, k=3), expected, atol=1e-6, rtol=0)
    from clipseg_sparse.methods.corrclipv2 import retrieval_fusion

    cosine = torch.randn(5, *size)
    expected_fused = 0.3 * cosine + 0.7 * banks.paint(support, inverse)
    torch.testing.assert_close(retrieval_fusion(cosine, support, inverse, 0.3, band=7), expected_fused, atol=0, rtol=0)  # bands that split rows
    strided = cosine.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # H x W x N memory, as the windows forward's map
    fused = retrieval_fusion(strided, support, inverse, 0.3, band=7)
    torch.testing.assert_close(fused, expected_fused, atol=0, rtol=0)
    assert fused.stride() == strided.stride()


def test_corrclipv2_with_a_bank_equals_the_published_forward_slide(models, tmp_path):
    clip, aux, radio = models
    jobs, regions = write_images(tmp_path / "images", 4)
    build(tmp_path / "bank", jobs, regions, [clip, aux], radio)
    bank = ImageBank.open(tmp_path / "bank")
    from test_corrclipv2 import image_and_regions

    rgb, reg = image_and_regions(seed=3)
    settings = InferenceSettings(resolution=112, window=112, stride=56, stages=("regionvote",), bg_threshold=0.15)
    seg = Segmenter(clip, Vocabulary.from_names(NAMES), spec=TINY_V2, settings=settings, regions=Given(reg), bank=bank, bank_clips=[aux])
    assert set(seg.store_texts) == {"tiny-vit:none", "tiny-aux:none"} and seg.store_texts["tiny-aux:none"].shape[1] == 48
    pixels = seg.pixels(rgb)
    scaled = F.interpolate(torch.from_numpy(reg)[None, None].float(), size=pixels.shape[-2:], mode="nearest")[0, 0].long().numpy()
    feats = radio.image_features(torch.from_numpy(rgb), tuple(pixels.shape[-2:]))[0].numpy()
    support = numpy_support(bank, scaled, feats, {s: t.numpy().astype(np.float64) for s, t in seg.store_texts.items()}, 3)
    expected = published_forward_slide(seg, radio, rgb, reg, seg.text, support=torch.from_numpy(support).float())
    cos = seg.cosine(rgb, reg).rows(0, rgb.shape[0])
    torch.testing.assert_close(cos, expected, atol=5e-5, rtol=1e-4)
    probs, labels = published_postprocess(expected, query_idx_of(NAMES), reg, prob_thd=0.15)
    result = seg.predict(rgb, "q.png")
    assert np.array_equal(result.labels, labels.numpy())
    assert result.settings["bank"] == {"hash": bank.content_hash, "keys": "c_radio_v3_l", "values": ["tiny-vit:none", "tiny-aux:none"]}
    assert "retrieve:3:0.5" in result.settings["attention"]


STITCHED = "ext:dino_vitb8.out[cos,scale:4,region:0.2]/softmax/cls:0/noffn/in:mean@1-2/mct:0.5/stitch:56"  # ovstitcher, blocks 1..2


def test_stitched_spec_with_retrieval_equals_the_stitched_map_fused_with_the_support(models, proxy, tmp_path):  # noqa: F811
    """OV-Stitcher's spec + hook:retrieve: the stitched features' cosine with the text (published forward,
    tests/methods/test_ovstitcher.py) resized bilinearly to the network input, fused there 0.5 / 0.5 with the bank's
    support (brute force), then bilinear to the original size. The stage in the settings runs the same."""
    from test_corrclipv2 import image_and_regions
    from test_ovstitcher import published_ovstitcher

    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 3)
    build(tmp_path / "bank", jobs, regions, [clip], radio)
    bank = ImageBank.open(tmp_path / "bank")
    rgb, reg = image_and_regions(seed=3)
    settings = InferenceSettings(resolution=112, window=112, stride=56, pos_interp="scale")
    seg = Segmenter(clip, Vocabulary.from_names(NAMES), spec=STITCHED + "/hook:retrieve:3:0.5", settings=settings, regions=Given(reg), bank=bank)
    pixels = seg.pixels(rgb)
    size = tuple(pixels.shape[-2:])
    scaled = F.interpolate(torch.from_numpy(reg)[None, None].float(), size=size, mode="nearest")[0, 0].long()
    with torch.no_grad():
        feats, grid = published_ovstitcher(clip, proxy[1], pixels, scaled, 112, 56, first=1, last=2)
    own = F.interpolate((F.normalize(feats, dim=-1) @ seg.text.T).T.reshape(1, -1, *grid), size=size, mode="bilinear")[0]
    keys = radio.image_features(torch.from_numpy(rgb), size)[0].numpy()
    support = torch.from_numpy(numpy_support(bank, scaled.numpy(), keys, {"tiny-vit:none": seg.text.numpy().astype(np.float64)}, 3)).float()
    expected = F.interpolate((0.5 * own + 0.5 * support)[None], size=rgb.shape[:2], mode="bilinear")[0]
    cos = seg.cosine(rgb, reg).rows(0, rgb.shape[0])
    torch.testing.assert_close(cos, expected, atol=1e-5, rtol=1e-4)  # measured: 5e-8
    assert (support - own).abs().max() > 0.05  # the support moves the map far beyond the tolerance
    in_settings = InferenceSettings(resolution=112, window=112, stride=56, pos_interp="scale", stages=("retrieve:3:0.5",))
    staged = Segmenter(clip, Vocabulary.from_names(NAMES), spec=STITCHED, settings=in_settings, regions=Given(reg), bank=bank)
    torch.testing.assert_close(staged.cosine(rgb, reg).rows(0, rgb.shape[0]), cos, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"stitch:M needs no hook but retrieval ones \(got hook:lof"):
        Segmenter(clip, Vocabulary.from_names(NAMES), spec=STITCHED + "/hook:lof", settings=settings, regions=Given(reg), bank=bank)


def test_a_bank_of_other_models_is_refused_by_name(models, tmp_path):
    clip, aux, radio = models
    jobs, regions = write_images(tmp_path / "images", 2)
    build(tmp_path / "bank", jobs, regions, [aux], radio)
    bank = ImageBank.open(tmp_path / "bank")
    with pytest.raises(BankError, match=r"built with tiny-aux:none, not tiny-vit:none"):
        Segmenter(clip, Vocabulary.from_names(NAMES), spec=TINY_V2, regions=Given(regions["img00.png"]), bank=bank)
    bank.manifest["keys"]["weights"] = "some.pth"
    with pytest.raises(BankError, match="c_radio_v3_l weights 'some.pth'"):
        Segmenter(aux, Vocabulary.from_names(NAMES), spec=TINY_V2, regions=Given(regions["img00.png"]), bank=bank)
    with pytest.raises(ValueError, match="needs an image bank"):
        Segmenter(clip, Vocabulary.from_names(NAMES), spec=TINY_V2, regions=Given(regions["img00.png"]))
    with pytest.raises(BankError, match="other settings"):  # no silent overwrite of a finished bank
        build(tmp_path / "bank", jobs, regions, [clip], radio)


def test_killed_then_resumed_equals_uninterrupted(models, tmp_path):
    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 4)
    whole = build(tmp_path / "whole", jobs, regions, [clip], radio)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "resumed", jobs, regions, [clip], radio, fail_at="img02.png")
    assert sorted(p.name for p in (tmp_path / "resumed" / banks.PARTS).glob("*.npz")) == ["00000000.npz", "00000001.npz"]
    with pytest.raises(BankError, match="unfinished build"):
        ImageBank.open(tmp_path / "resumed")
    with pytest.raises(BankError, match="other settings"):  # resuming with other settings would mix two builds
        build(tmp_path / "resumed", jobs, regions, [clip], radio, index="auto")
    resumed = build(tmp_path / "resumed", jobs, regions, [clip], radio)
    assert resumed["hash"] == whole["hash"]
    for name in (banks.KEYS, banks.values_file(0), banks.ROWS):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes()


def write_masks(folder: Path, regions: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, r in regions.items():
        np.save(folder / f"{Path(name).stem}.npy", r)


def cli(*args):
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})


def test_bank_build_info_and_segment_with_bank_on_the_command_line(models, tmp_path):
    from conftest import TINY_CONFIG

    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 3)
    write_masks(tmp_path / "masks", regions)
    common = ["--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu"]
    built = cli("bank", "build", tmp_path / "images", "--out", tmp_path / "bank", "--regions", tmp_path / "masks", *common,
                "--values-attn", VALUES, "--resolution", 64, "--window", 48, "--stride", 32, "--index", "flat")  # fmt: skip
    assert built.exit_code == 0, built.output
    bank = ImageBank.open(tmp_path / "bank")
    assert bank.content_hash in built.output, built.output
    assert bank.manifest["images"] == ["img00", "img01", "img02"]  # the images' paths under the input, without suffix
    info = cli("bank", "info", tmp_path / "bank")
    assert info.exit_code == 0 and bank.content_hash in info.output and "c_radio_v3_l" in info.output and "tiny-vit:none" in info.output
    assert f": {VALUES} at 64 px" in info.output, info.output  # the spec's [cos,...] is text, not rich markup
    named = [(path, Path(name).stem) for path, name in jobs]
    direct = build(tmp_path / "direct", named, {Path(n).stem: r for n, r in regions.items()}, [clip], radio)  # through the library
    assert direct["rows"] == bank.rows and (tmp_path / "direct" / banks.KEYS).read_bytes() == (tmp_path / "bank" / banks.KEYS).read_bytes()

    query, query_regions = write_images(tmp_path / "query", 1, seed=4)
    write_masks(tmp_path / "qmasks", query_regions)
    seg = ["segment", tmp_path / "query", "--classes", "cat,grass|lawn,sky", *common, "--templates", "single", "--resolution", "0",
           "--window", "64", "--stride", "32", "--attn", TINY_V2, "--regions", tmp_path / "qmasks"]  # fmt: skip
    missing = cli(*seg, "--out", tmp_path / "out0")
    assert missing.exit_code == 2 and "needs an image bank: give --bank BANK" in missing.output
    done = cli(*seg, "--bank", tmp_path / "bank", "--out", tmp_path / "out")
    assert done.exit_code == 0, done.output
    record = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert json.dumps(record).count(bank.content_hash) >= 1
    unfinished = cli(*seg, "--bank", tmp_path / "images", "--out", tmp_path / "out2")
    assert unfinished.exit_code == 2 and "not an image bank" in unfinished.output


GLOO_SCRIPT = """
import json, sys
import numpy as np, torch
sys.path[:0] = {tests!r}
from conftest import TINY_CONFIG
from test_bank import ByName, VALUES, VALUE_SETTINGS, write_images
from test_dense_backbones import tiny_radio
from clipseg_sparse import load_clip
from clipseg_sparse.attention import resolve_spec
from clipseg_sparse.models.backbones import BACKBONES, Backbone
from clipseg_sparse.runtime.distributed import init_from_env
from clipseg_sparse.segment.bank import ValueModel, build_bank
import timm.models.vision_transformer as vt
from pathlib import Path

init_from_env()
torch.set_num_threads(1)
clip = load_clip(TINY_CONFIG, pretrained=None, device="cpu")
torch.manual_seed(0)
dino = vt.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True)
clip.proxies.use(Backbone(BACKBONES.get("dino_vitb8"), dino, weights="none"), "cpu")
radio = tiny_radio()
clip.proxies.use(radio, "cpu")
jobs, regions = write_images(Path({images!r}), 5)
values = [ValueModel(clip, resolve_spec(VALUES), VALUE_SETTINGS)]
build_bank(jobs, {out!r}, values, radio, clip.proxies.config(["c_radio_v3_l"])["c_radio_v3_l"], ByName(regions), "test", "flat")
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_two_gloo_ranks_build_the_same_bank_as_one_process(tmp_path):
    outs = {}
    for procs in (1, 2):
        script = tmp_path / f"build{procs}.py"
        out = tmp_path / f"bank{procs}"
        script.write_text(GLOO_SCRIPT.format(tests=[str(ROOT / "tests" / folder) for folder in ("", "segment", "models")], images=str(tmp_path / f"images{procs}"), out=str(out)))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), str(script)],
                             env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        outs[procs] = out
    one, two = (json.loads((outs[p] / banks.MANIFEST).read_text()) for p in (1, 2))
    assert one["hash"] == two["hash"] and one["rows"] == two["rows"] > 0
    for name in (banks.KEYS, banks.values_file(0), banks.ROWS):
        assert (outs[1] / name).read_bytes() == (outs[2] / name).read_bytes()


def test_eval_with_a_bank_records_its_hash_and_sweep_files_name_it(models, tmp_path):
    from conftest import TINY_CONFIG
    from fake_benchmarks import make_benchmark_with_masks

    from clipseg_sparse.sweeps.grid import Grid
    from clipseg_sparse.sweeps.run import SweepPaths

    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 2)
    build(tmp_path / "bank", jobs, regions, [clip], radio)
    bank = ImageBank.open(tmp_path / "bank")
    make_benchmark_with_masks("voc21", tmp_path, n=2, size=(48, 64))
    args = ["eval", "--dataset", "voc21", "--root", tmp_path / "voc", "--protocol", "corrclipv2", "--attn", TINY_V2, "--model", TINY_CONFIG,
            "--pretrained", "none", "--device", "cpu", "--templates", "single", "--resolution", 64, "--window", 64, "--stride", 32,
            "--regions", tmp_path / "masks", "--out", tmp_path / "voc.json"]  # fmt: skip
    res = cli(*args, "--bank", tmp_path / "bank")
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "voc.json").read_text())["config"]
    assert config["bank"]["hash"] == bank.content_hash and config["stages"] == ["regionvote"]
    # sweep: a cell that reads the bank names it in its result file; one that does not keeps its name
    cells = Grid.from_dict({"datasets": ["voc21"], "presets": ["corrclipv2", "sclip"]}).cells()
    paths = SweepPaths(out=tmp_path / "sweep", bank=tmp_path / "bank")
    (v2,), (sclip,) = ([c for c in cells if ("retrieve" in str(c.attention)) == want] for want in (True, False))
    assert paths.result(v2).name == f"{v2.hash}.bank-{bank.content_hash}.json" and paths.result(sclip).name == f"{sclip.hash}.json"
    assert paths.image_bank(v2).content_hash == bank.content_hash and paths.image_bank(sclip) is None


def test_bank_build_defaults_to_the_published_builder_and_names_older_banks(models, tmp_path):
    """`bank build`'s values are the published memory_bank_builder's: OpenCV resize and (n + 0.1) positions at
    its windows (here scaled down), equal to the library's build with those settings; a bank built with the
    float resize is named in a note when a run reads it."""
    from conftest import TINY_CONFIG
    from clipseg_sparse.segment.resources import Resources

    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 2)
    write_masks(tmp_path / "masks", regions)
    built = cli("bank", "build", tmp_path / "images", "--out", tmp_path / "bank", "--regions", tmp_path / "masks", "--model", TINY_CONFIG,
                "--pretrained", "none", "--device", "cpu", "--values-attn", VALUES, "--resolution", 64, "--window", 48, "--stride", 32,
                "--index", "flat")  # fmt: skip
    assert built.exit_code == 0, built.output
    settings = ImageBank.open(tmp_path / "bank").manifest["values"][0]["settings"]
    assert (settings["resize"], settings["pos_interp"]) == ("opencv", "scale")
    named = [(path, Path(name).stem) for path, name in jobs]
    by_stem = ByName({Path(n).stem: r for n, r in regions.items()})
    record = clip.proxies.config(["c_radio_v3_l"])["c_radio_v3_l"]
    published = VALUE_SETTINGS.replace(resize="opencv", pos_interp="scale")
    build_bank(named, tmp_path / "published", [ValueModel(clip, resolve_spec(VALUES), published)], radio, record, by_stem, "test", "flat")
    ours = np.load(tmp_path / "bank" / banks.values_file(0)).astype(np.float32)
    assert np.abs(ours - np.load(tmp_path / "published" / banks.values_file(0)).astype(np.float32)).max() <= 1e-6
    build_bank(named, tmp_path / "older", [ValueModel(clip, resolve_spec(VALUES), VALUE_SETTINGS)], radio, record, by_stem, "test", "flat")
    assert np.abs(ours - np.load(tmp_path / "older" / banks.values_file(0)).astype(np.float32)).max() > 1e-4
    notes = []
    Resources.open([Plan.of(TINY_V2)], regions=str(tmp_path / "masks"), bank=tmp_path / "older", note=notes.append)
    Resources.open([Plan.of(TINY_V2)], regions=str(tmp_path / "masks"), bank=tmp_path / "bank", note=notes.append)
    assert len(notes) == 1 and "older" in notes[0] and "not built with the published builder's settings" in notes[0]


def test_bank_build_with_a_second_clip_loads_each_backbone_once(models, tmp_path, monkeypatch):
    import clipseg_sparse.models.proxies as proxies
    from conftest import TINY_CONFIG

    _, aux, _ = models
    jobs, regions = write_images(tmp_path / "images", 2)
    write_masks(tmp_path / "masks", regions)
    aux_config = tmp_path / "tiny-aux.json"
    aux_config.write_text(json.dumps({**json.loads((ROOT / "tests/data/tiny-vit.json").read_text()), "embed_dim": 48}))
    loads, installed = [], proxies.load_backbone

    def counted(name, *args, **kwargs):
        loads.append(name)
        return installed(name, *args, **kwargs)

    monkeypatch.setattr(proxies, "load_backbone", counted)
    built = cli("bank", "build", tmp_path / "images", "--out", tmp_path / "bank", "--regions", tmp_path / "masks", "--model", TINY_CONFIG,
                "--pretrained", "none", "--aux-model", aux_config, "--aux-pretrained", "none", "--device", "cpu", "--values-attn", VALUES,
                "--resolution", 64, "--window", 48, "--stride", 32, "--index", "flat")  # fmt: skip
    assert built.exit_code == 0, built.output
    assert sorted(loads) == ["c_radio_v3_l", "dino_vitb8"]
    assert len(ImageBank.open(tmp_path / "bank").manifest["values"]) == 2


def bank_build_cli(images: Path, out: Path, masks: Path):
    from conftest import TINY_CONFIG

    return cli("bank", "build", images, "--out", out, "--regions", masks, "--model", TINY_CONFIG, "--pretrained", "none", "--device", "cpu",
               "--values-attn", VALUES, "--resolution", 64, "--window", 48, "--stride", 32, "--index", "flat")  # fmt: skip


def test_a_bank_whose_files_do_not_match_its_manifest_is_refused_and_a_rerun_rebuilds_it(models, tmp_path):
    """A store replaced, a part replaced, the hash or the row count edited in manifest.json: opening the bank
    (`bank info`, a run with --bank) is refused in one line naming the file; a re-run of the build redoes the
    part that does not match and merges again, giving the bank built first."""
    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 3)
    bank = tmp_path / "bank"
    first = build(bank, jobs, regions, [clip], radio)
    stores = {name: (bank / name).read_bytes() for name in (banks.KEYS, banks.values_file(0), banks.ROWS)}
    np.save(bank / banks.values_file(0), np.zeros_like(np.load(bank / banks.values_file(0))))
    built = (bank / banks.values_file(0)).stat().st_mtime_ns
    os.utime(bank / banks.values_file(0), ns=(built, built + 2 * 10**9))  # a later time even on coarse file-system clocks
    (bank / banks.PARTS / "00000001.npz").write_bytes((bank / banks.PARTS / "00000000.npz").read_bytes())
    with pytest.raises(BankError, match=r"values-0\.npy: does not match the bank's manifest"):
        ImageBank.open(bank)
    info = cli("bank", "info", bank)
    assert info.exit_code == 2 and "values-0.npy: does not match" in info.output and len(info.output.strip().splitlines()) == 1, info.output
    again = build(bank, jobs, regions, [clip], radio)
    assert again["hash"] == first["hash"] and ImageBank.open(bank).rows == first["rows"]
    assert all((bank / name).read_bytes() == data for name, data in stores.items())
    manifest = json.loads((bank / banks.MANIFEST).read_text())
    for field, value in (("hash", "0" * 16), ("rows", manifest["rows"] - 1)):
        (bank / banks.MANIFEST).write_text(json.dumps({**manifest, field: value}))
        with pytest.raises(BankError, match=r"manifest\.json: its fields do not match its content hash"):
            ImageBank.open(bank)


def test_bank_build_skips_an_unreadable_image_lists_it_and_tries_it_again(models, tmp_path):
    clip, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 3)
    write_masks(tmp_path / "masks", regions)
    good = (tmp_path / "images" / "img01.png").read_bytes()
    (tmp_path / "images" / "img01.png").write_bytes(good[: len(good) // 3])  # truncated
    built = bank_build_cli(tmp_path / "images", tmp_path / "bank", tmp_path / "masks")
    assert built.exit_code == 0, built.output
    assert "skipping an image that cannot be read" in built.output and "img01.png" in built.output
    bank = ImageBank.open(tmp_path / "bank")
    assert bank.manifest["skipped"] == ["img01"] and sorted(set(np.load(tmp_path / "bank" / banks.ROWS)[:, 0])) == [0, 2]
    info = cli("bank", "info", tmp_path / "bank")
    assert info.exit_code == 0 and "skipped (unreadable)" in info.output and "img01" in info.output
    (tmp_path / "images" / "img01.png").write_bytes(good)
    again = bank_build_cli(tmp_path / "images", tmp_path / "bank", tmp_path / "masks")
    assert again.exit_code == 0, again.output
    assert ImageBank.open(tmp_path / "bank").manifest["skipped"] == [] and sorted(set(np.load(tmp_path / "bank" / banks.ROWS)[:, 0])) == [0, 1, 2]


def test_bank_build_on_a_full_disk_is_one_line_and_the_same_command_then_finishes_from_the_parts(models, tmp_path, monkeypatch):
    """Issue 35, reliability 10 (the other commands: tests/cli/test_bad_files.py): ENOSPC while the manifest is
    written ends the build with one line naming it and exit 1; the re-run reads no image again."""
    _, _, radio = models
    jobs, regions = write_images(tmp_path / "images", 2)
    write_masks(tmp_path / "masks", regions)
    replace = Path.replace

    def disk_full(self, target):
        if Path(target).name == banks.MANIFEST:
            raise OSError(errno.ENOSPC, "No space left on device")  # as a failed write says it: no file name
        return replace(self, target)

    read = []
    monkeypatch.setattr(radio, "image_feature_map", lambda *a, f=radio.image_feature_map: read.append(1) or f(*a))
    monkeypatch.setattr(Path, "replace", disk_full)
    full = bank_build_cli(tmp_path / "images", tmp_path / "bank", tmp_path / "masks")
    assert full.exit_code == 1 and "Traceback" not in full.output, full.output
    assert full.output.strip().splitlines()[-1] == (f"error: {tmp_path / 'bank' / banks.MANIFEST}: no space left on device; free some and run "
                                                    "the same command again (it resumes, nothing finished is lost)")  # fmt: skip
    monkeypatch.setattr(Path, "replace", replace)
    assert len(read) == 2
    read.clear()
    again = bank_build_cli(tmp_path / "images", tmp_path / "bank", tmp_path / "masks")
    assert again.exit_code == 0 and read == [] and ImageBank.open(tmp_path / "bank").manifest["skipped"] == [], again.output
