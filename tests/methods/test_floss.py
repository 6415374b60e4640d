"""FLOSS (option `floss`, forward `floss`, presets `naclip+floss`, `maskclip+floss`; `rank_templates` and the
command `floss rank`) against a transcription of `yasserben/FLOSS@ccf1d49`:
`mmseg/models/segmentors/naclip/naclip.py` (`_load_template_rankings`, `encode_text_features`, `expert_fusion`,
`forward_feature`, `forward_slide`, `predict`, `postprocess_result`) and `mmseg/evaluation/metrics/entropy_metric.py`
(`EntropyMetric.process`, `compute_metrics`), run on a tiny random CLIP."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from clipseg_sparse.cli.app import app
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.methods import floss
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.images import load_image
from clipseg_sparse.segment.vocabulary import Vocabulary, openai_imagenet_templates
from conftest import TINY_CONFIG

TEMPLATES = [lambda c, t=t: t.format(c) for t in openai_imagenet_templates()]  # openai_imagenet_template
VOCAB = Vocabulary.from_names([["cat"], ["dog", "puppy"], ["sky"], ["grass"]])
SETTINGS = dict(resolution=0, window=64, stride=32, logit_scale=100.0)


# -- transcription ----------------------------------------------------------------------------------------------------
def load_template_rankings(rankings_data, top_n=4):
    template_dict = {}
    for class_name, class_data in rankings_data["classes"].items():
        templates = [t for t in class_data["entropy_ranking"] if t["pixel_percentage"] > 0.0]
        template_ids = [t["template_id"] for t in templates][:top_n]
        template_dict[class_name] = template_ids
    return template_dict


def encode_text_features(clip, query_words, template_dict):
    list_of_experts = []
    for name in query_words:
        templates = [TEMPLATES[tid] for tid in template_dict[name]]
        expert_embeddings = []
        for element in query_words:
            feature = clip.encode_text([template(element) for template in templates]).clone()
            feature /= feature.norm(dim=-1, keepdim=True)
            feature = feature.mean(dim=0)
            feature /= feature.norm()
            expert_embeddings.append(feature)
        list_of_experts.append(torch.stack(expert_embeddings))
    default = []
    for qw in query_words:
        feature = clip.encode_text([temp(qw) for temp in TEMPLATES]).clone()
        feature /= feature.norm(dim=-1, keepdim=True)
        feature = feature.mean(dim=0)
        default.append(feature / feature.norm())
    list_of_experts.append(torch.stack(default))
    return torch.stack(list_of_experts)


def expert_fusion(expert_probs, default_prob):
    expert_probs = expert_probs.squeeze(1)
    default_prob = default_prob.squeeze(0)
    num_experts, C, H, W = expert_probs.shape
    predictions = torch.argmax(expert_probs, dim=1)
    final_probs = torch.zeros((C, H, W))
    expert_masks = torch.zeros((num_experts, H, W), dtype=torch.bool)
    for expert_idx in range(num_experts):
        expert_masks[expert_idx] = predictions[expert_idx] == expert_idx
    overlap_count = torch.sum(expert_masks, dim=0)
    exact_match, no_expert_match, conflict = overlap_count == 1, overlap_count == 0, overlap_count > 1
    for expert_idx in range(num_experts):
        mask = expert_masks[expert_idx] & exact_match
        if mask.any():
            m = mask.unsqueeze(0).expand(C, -1, -1)
            final_probs[m] = expert_probs[expert_idx][m]
    if no_expert_match.any():
        m = no_expert_match.unsqueeze(0).expand(C, -1, -1)
        final_probs[m] = default_prob[m]
    if conflict.any():
        max_probs = torch.full((H, W), -1.0)
        selected_experts = torch.full((H, W), -1, dtype=torch.long)
        for expert_idx in range(num_experts):
            current_mask = expert_masks[expert_idx] & conflict
            if current_mask.any():
                confidence = expert_probs[expert_idx, expert_idx]
                update_mask = current_mask & (confidence > max_probs)
                max_probs[update_mask] = confidence[update_mask]
                selected_experts[update_mask] = expert_idx
        for expert_idx in range(num_experts):
            expert_mask = selected_experts == expert_idx
            if expert_mask.any():
                m = expert_mask.unsqueeze(0).expand(C, -1, -1)
                final_probs[m] = expert_probs[expert_idx][m]
    return final_probs.unsqueeze(0)


class PublishedNACLIP:
    """NACLIP's segmentor in FLOSS's modes, with `net.encode_image` our preset's features (the base model)."""

    def __init__(self, clip, spec, query_words, query_idx, query_features, logit_scale=100.0):
        self.clip, self.spec, self.query_features, self.logit_scale = clip, spec, query_features, logit_scale
        self.num_queries, self.query_idx = len(query_words), torch.tensor(query_idx)

    def features(self, img):
        return self.clip.encode_dense(img, self.spec, pos_interp="size").flatten(1, 2)  # L2-normalised, CLS dropped

    def forward_feature(self, img, mode):
        image_features = self.features(img)
        num_experts, num_classes, text_channels = self.query_features.shape
        w, h = img[0].shape[-2] // 16, img[0].shape[-1] // 16
        image_features = image_features.permute(0, 2, 1).reshape(-1, image_features.shape[-1], w, h)
        outputs = F.conv2d(image_features, self.query_features.reshape(-1, text_channels)[:, :, None, None])
        outputs = outputs.reshape(1, num_experts, num_classes, outputs.size(2), outputs.size(3))
        if mode == "compute_metric":
            return nn.functional.interpolate(outputs.permute(1, 0, 2, 3, 4).squeeze(1), size=img.shape[-2:], mode="bilinear", align_corners=False)
        outputs = F.softmax(outputs * self.logit_scale, dim=2).permute(1, 0, 2, 3, 4)
        final = torch.stack([nn.functional.interpolate(o, size=img.shape[-2:], mode="bilinear", align_corners=False) for o in outputs])
        return expert_fusion(expert_probs=final[:-1], default_prob=final[-1])

    def forward_slide(self, img, mode, stride=32, crop=64, batch=1):
        _, _, h_img, w_img = img.shape
        h_grids = max(h_img - crop + stride - 1, 0) // stride + 1
        w_grids = max(w_img - crop + stride - 1, 0) // stride + 1
        preds = img.new_zeros((batch, self.num_queries, h_img, w_img))
        count_mat = img.new_zeros((batch, 1, h_img, w_img))
        for h_idx in range(h_grids):
            for w_idx in range(w_grids):
                y1, x1 = h_idx * stride, w_idx * stride
                y2, x2 = min(y1 + crop, h_img), min(x1 + crop, w_img)
                y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
                out = self.forward_feature(img[:, :, y1:y2, x1:x2], mode)
                preds += nn.functional.pad(out, (int(x1), int(preds.shape[3] - x2), int(y1), int(preds.shape[2] - y2)))
                count_mat[:, :, y1:y2, x1:x2] += 1
        return preds / count_mat

    def synonym_max(self, probs):
        num_cls, num_queries = int(max(self.query_idx)) + 1, len(self.query_idx)
        cls_index = nn.functional.one_hot(self.query_idx).T.view(1, num_cls, num_queries, 1, 1)
        return (probs.unsqueeze(1) * cls_index).max(2)[0]

    def predict_fusion(self, img):
        seg_probs = torch.softmax(self.forward_slide(img, "fusion")[0] * self.logit_scale, dim=0)
        seg_probs = self.synonym_max(seg_probs[None])[0]
        return seg_probs, seg_probs.argmax(0)

    def predict_metric(self, img):
        """T x C x H x W: every template's class probabilities (`predict` in compute_metric mode)."""
        logits = self.forward_slide(img, "compute_metric", batch=self.query_features.shape[0])
        return self.synonym_max(F.softmax(logits * self.logit_scale, dim=1))


def entropy_metric(probs_per_template, total_pixels, entropy_data):
    """EntropyMetric.process for one image (NACLIP: no resize)."""
    for template_idx, prob in enumerate(probs_per_template):
        pred_label = torch.argmax(prob, dim=0)
        for class_idx in range(prob.shape[0]):
            class_mask = pred_label == class_idx
            if not torch.any(class_mask):
                continue
            class_probs = prob[:, class_mask].to(torch.float32)
            entropy = -(class_probs * torch.log(class_probs + 1e-10)).sum(dim=0)
            count = class_mask.sum().item()
            entropy_data[template_idx][class_idx]["sum"] += np.float64(entropy.mean().item() * count)
            entropy_data[template_idx][class_idx]["count"] += np.float64(count)


# -- fixtures -------------------------------------------------------------------------------------------------------
def _pixels(seed):
    from conftest import structured_pixels

    torch.manual_seed(seed)
    return structured_pixels(1, (96, 128))


def _segmenter(clip, spec, **settings):
    return Segmenter(clip, VOCAB, spec=spec, settings=InferenceSettings(**{**SETTINGS, **settings}), templates="openai")


def _cosine(seg, pixels):
    run = seg.image_run(np.zeros((pixels.shape[-2], pixels.shape[-1], 3), np.uint8))
    run.pixels = pixels
    return run, seg._cosine(run).rows(0, pixels.shape[-2])


@pytest.fixture(scope="module")
def rank_json(tmp_path_factory):
    """A FLOSS rank file for VOCAB with a few templates of pixel share 0 ahead of the rest."""
    rng = np.random.default_rng(0)
    classes = {}
    for label in VOCAB.labels:
        order = rng.permutation(80)
        rows = [{"template_id": int(t), "entropy": float(i), "pixel_percentage": 0.0 if i < 2 else 1.0, "rank": i + 1} for i, t in enumerate(order)]
        classes[label] = {"entropy_ranking": rows}
    path = tmp_path_factory.mktemp("floss") / "ranks.json"
    path.write_text(json.dumps({"model": "naclip", "dataset": "x", "split": "train", "classes": classes}))
    return path


# -- the online fusion ------------------------------------------------------------------------------------------------
def test_fusion_equals_the_published_expert_fusion(tiny_clip, rank_json):
    seg = _segmenter(tiny_clip, f"naclip/floss:{rank_json}")
    pixels = _pixels(0)
    _, fused = _cosine(seg, pixels)
    names = list(VOCAB.flat_names)
    template_dict = load_template_rankings(json.loads(rank_json.read_text()))
    template_dict["puppy"] = template_dict["dog"]  # the VOC20 fix: a synonym takes its class's templates
    query = encode_text_features(tiny_clip, names, template_dict)
    ref = PublishedNACLIP(tiny_clip, "naclip", names, VOCAB.name_to_class, query)
    probs, labels = ref.predict_fusion(pixels)
    assert torch.allclose(seg.text, query[-1], atol=1e-6)
    ours = torch.softmax(100 * fused, 0)
    ours = torch.stack([ours[[i for i, c in enumerate(VOCAB.name_to_class) if c == k]].amax(0) for k in range(len(VOCAB))])
    assert torch.allclose(ours, probs, atol=1e-4)
    top2 = probs.topk(2, 0).values
    clear = top2[0] - top2[1] > 1e-4
    assert torch.equal(ours.argmax(0)[clear], labels[clear])


def test_fuse_plain_rule():
    """One claimant -> its vector; none -> the default's; two -> the higher own-name probability, the first on ties."""
    default = torch.tensor([[[0.5]], [[0.5]]])
    e0 = torch.tensor([[[0.6]], [[0.4]]])  # claims (argmax 0 == expert 0)
    e1 = torch.tensor([[[0.3]], [[0.7]]])  # claims
    assert torch.equal(floss.fuse([e0, e0.flip(0)], default), e0)  # e1 = [0.4, 0.6] claims too, 0.6 is not > 0.6: first
    assert torch.equal(floss.fuse([e0, e1], default), e1)
    assert torch.equal(floss.fuse([e1, e0], default), default)  # expert 0's argmax is 1, expert 1's is 0: no claim
    assert torch.equal(floss.fuse([None, e1], default), e1)  # a skipped expert claims nothing


def test_an_expert_below_one_over_n_everywhere_is_skipped_and_could_claim_nothing():
    torch.manual_seed(0)
    cos = torch.randn(3, 4, 5) * 0.05
    cos[..., 2] -= 1  # name 2's probability is far below 1 / 5 at every patch
    assert floss._upsampled(cos, 100.0, (48, 64), 2) is None
    full = floss._upsampled(cos, 100.0, (48, 64))
    assert not bool((full.argmax(0) == 2).any())
    assert torch.equal(floss._upsampled(cos, 100.0, (48, 64), 0), full) or floss._upsampled(cos, 100.0, (48, 64), 0) is None


def test_entmax_near_one_is_close_to_softmax(tiny_clip, rank_json):
    pixels = _pixels(1)
    _, soft = _cosine(_segmenter(tiny_clip, f"naclip/floss:{rank_json}"), pixels)
    _, near = _cosine(_segmenter(tiny_clip, f"naclip/entmax:1.0001/floss:{rank_json}"), pixels)
    _, sparse = _cosine(_segmenter(tiny_clip, f"naclip-entmax/floss:{rank_json}"), pixels)
    assert (soft - near).abs().mean() < 1e-3
    assert not torch.allclose(soft, sparse, atol=1e-3)


# -- the offline ranking ---------------------------------------------------------------------------------------------
def _images(folder, n=2):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        rgb = (np.random.default_rng(i).random((96, 128, 3)) * 255).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"im{i}.png")
        paths.append((folder / f"im{i}.png", f"im{i}.png"))
    return paths


def test_rank_equals_the_published_entropy_metric(tiny_clip, tmp_path):
    images = _images(tmp_path / "images")
    seg = _segmenter(tiny_clip, "naclip")
    result = floss.rank_templates(seg, images, tmp_path / "ranks.json")
    assert json.loads((tmp_path / "ranks.json").read_text()) == result and not (tmp_path / "ranks.json.partial.json").exists()

    names = list(VOCAB.flat_names)
    single = torch.stack([torch.stack([tiny_clip.encode_text([t(n)])[0] for n in names]) for t in TEMPLATES])
    ref = PublishedNACLIP(tiny_clip, "naclip", names, VOCAB.name_to_class, single)
    data = [[{"sum": np.float64(0), "count": np.float64(0)} for _ in range(len(VOCAB))] for _ in range(80)]
    total = 0
    for path, _ in images:
        rgb = load_image(path)
        pixels = seg.pixels(rgb)
        entropy_metric(ref.predict_metric(pixels), total, data)
        total += rgb.shape[0] * rgb.shape[1]
    exact = 0
    for c, label in enumerate(VOCAB.labels):
        rows = {r["template_id"]: r for r in result["classes"][label]["entropy_ranking"]}
        for t in range(80):
            d = data[t][c]
            entropy = d["sum"] / d["count"] if d["count"] > 0 else 0.0
            share = d["count"] / total * 100 if d["count"] > 0 else 0.0
            # a pixel whose top two classes tie to float rounding may change sides: a few pixels, a small shift of the mean
            assert rows[t]["pixel_percentage"] == pytest.approx(share, abs=3 / total * 100)
            assert rows[t]["entropy"] == pytest.approx(entropy, abs=1e-3)
            exact += rows[t]["pixel_percentage"] == pytest.approx(share, abs=1e-9) and rows[t]["entropy"] == pytest.approx(entropy, abs=1e-5)
        entropies = [r["entropy"] for r in result["classes"][label]["entropy_ranking"]]
        assert entropies == sorted(entropies) and [r["rank"] for r in result["classes"][label]["entropy_ranking"]] == list(range(1, 81))
    assert exact >= 0.95 * 80 * len(VOCAB)  # all but the (template, class) cells a tied pixel touches


def test_rank_resumes_after_a_stop(tiny_clip, tmp_path, monkeypatch):
    images = _images(tmp_path / "images", 3)
    seg = _segmenter(tiny_clip, "naclip")
    whole = floss.rank_templates(seg, images, tmp_path / "whole.json")
    import clipseg_sparse.segment.images as loader

    real, calls = loader.load_image, []

    def stop_at_third(path):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path)

    monkeypatch.setattr(loader, "load_image", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        floss.rank_templates(seg, images, tmp_path / "part.json")
    assert len(json.loads((tmp_path / "part.json.partial.json").read_text())["done"]) == 2
    (tmp_path / "o.json.partial.json").write_text((tmp_path / "part.json.partial.json").read_text())
    monkeypatch.setattr(loader, "load_image", real)
    notes = []
    resumed = floss.rank_templates(seg, images, tmp_path / "part.json", note=notes.append)
    assert "2 of 3 images done" in notes[0]
    assert resumed["classes"] == whole["classes"]
    other = _segmenter(tiny_clip, "clearclip")
    with pytest.raises(UserValueError, match="another model, spec"):
        floss.rank_templates(other, images, tmp_path / "o.json")


def test_rank_skips_an_unreadable_image_with_a_note(tiny_clip, tmp_path):
    images = _images(tmp_path / "images", 1)
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    notes = []
    result = floss.rank_templates(_segmenter(tiny_clip, "naclip"), [*images, (tmp_path / "images" / "broken.png", "broken.png")], tmp_path / "r.json", note=notes.append)
    assert result["clipseg_sparse"]["images"] == 1 and notes and notes[0].startswith("skipped broken.png")


# -- command line, presets, protocols, errors -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tiny_clip, tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip.model.state_dict().items()}, path)
    return str(path)


def test_cli_ranks_then_segments_with_floss_auto(tmp_path, monkeypatch, checkpoint):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    _images(tmp_path / "images")
    common = ["--model", TINY_CONFIG, "--pretrained", checkpoint, "--device", "cpu", "--resolution", "96", "--window", "64", "--stride", "32"]
    runner = CliRunner()
    missing = runner.invoke(app, ["segment", str(tmp_path / "images"), "--out", str(tmp_path / "seg"), "--classes", "cat,dog,sky", "--preset", "naclip+floss", "--templates", "openai", *common])
    errors = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert missing.exit_code == 2 and len(errors) == 1 and "floss rank" in errors[0]
    ranked = runner.invoke(app, ["floss", "rank", str(tmp_path / "images"), "--classes", "cat,dog,sky", "--preset", "naclip+floss", *common])
    assert ranked.exit_code == 0, ranked.output
    assert "top templates" in ranked.stdout and list((tmp_path / "cache" / "floss").glob("*.json"))
    ok = runner.invoke(app, ["segment", str(tmp_path / "images"), "--out", str(tmp_path / "seg2"), "--classes", "cat,dog,sky", "--preset", "naclip+floss", *common])
    assert ok.exit_code == 0, ok.output
    assert len(list((tmp_path / "seg2").rglob("*.png"))) >= 2
    bad = runner.invoke(app, ["floss", "rank", str(tmp_path / "images"), *common])
    assert bad.exit_code == 2 and "--classes" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_bad_rank_files_give_one_line_errors(tiny_clip, tmp_path):
    seg_for = lambda path: _segmenter(tiny_clip, f"naclip/floss:{path}")  # noqa: E731
    pixels = _pixels(2)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "partial.json").write_text(json.dumps({"classes": {"cat": {"entropy_ranking": [{"template_id": 1, "entropy": 0.1, "pixel_percentage": 1.0}]}}}))
    for path, fragment in ((tmp_path / "none.json", "no FLOSS rank file"), (tmp_path / "bad.json", "not a FLOSS rank file"), (tmp_path / "partial.json", "no ranking for 'dog'")):
        with pytest.raises(UserValueError, match=fragment) as e:
            _cosine(seg_for(path), pixels)
        assert "\n" not in str(e.value)
    for typo in ("", "atuo"):  # refused when the spec is read: neither auto, a file, nor a .json path
        with pytest.raises(UserValueError, match=f"bad option floss:{typo}: write floss:auto"):
            _segmenter(tiny_clip, f"naclip/floss:{typo}")


def test_rankings_keyed_like_flosss_voc20_file_serve_sclips_voc20_names():
    """FLOSS's VOC20 rankings key the dataset's names (boat, diningtable, pottedplant, tvmonitor); SCLIP's file says
    ship, table, potted plant's `pottedplant`, `television monitor, tv monitor, ...` (`_apply_quick_and_dirty_fix`)."""
    from clipseg_sparse.datasets.classnames import class_names_file

    vocabulary = Vocabulary.from_file(class_names_file(dataset="voc20", which="sclip"))
    keys = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable", "dog", "horse",
            "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor"]  # fmt: skip
    rankings = {k: [{"template_id": i, "pixel_percentage": 1.0}] for i, k in enumerate(keys)}
    experts = floss.top_templates(rankings, vocabulary)
    by_name = dict(zip(vocabulary.flat_names, experts))
    assert by_name["ship"] == [3] and by_name["table"] == [10] and by_name["person in jacket"] == [14] and by_name["screen"] == [19]
    spaced = {"traffic light": [{"template_id": 7, "pixel_percentage": 1.0}], "Road": [{"template_id": 8, "pixel_percentage": 1.0}]}
    assert floss.top_templates(spaced, Vocabulary.from_names([["trafficlight"], ["road"]])) == [[7], [8]]  # FLOSS's MaskCLIP keys


def test_presets_and_protocols_follow_the_published_configs():
    from clipseg_sparse.attention import PRESETS

    assert str(PRESETS.get("naclip+floss").spec) == "kk/softmax/gauss:5/nores/noffn/floss:auto"
    assert str(PRESETS.get("naclip+floss-entmax").spec) == "kk/entmax:1.5/gauss:5/nores/noffn/floss:auto"
    assert str(PRESETS.get("maskclip+floss").spec) == "id/softmax/floss:auto"
    s = PROTOCOLS.get("floss")
    assert (s.settings("ade20k").resolution, s.settings("ade20k").window, s.settings("ade20k").stride) == (336, 224, 112)
    assert s.settings("voc20").window == 0 and s.settings("cityscapes").resolution == 560 and s.settings("coco-stuff").resolution == 336
    assert all(s.settings(d).logit_scale == 100 and not s.settings(d).pamr for d in ("ade20k", "voc20", "cityscapes"))
    m = PROTOCOLS.get("floss-maskclip")
    assert (m.pretrained, m.settings("voc20").window, m.settings("voc20").stride, m.settings("cityscapes").max_long_side) == ("laion2b_s34b_b88k", 448, 224, 896)
