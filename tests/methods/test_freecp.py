"""FreeCP (stages `freecp`, `freecpbg`; presets `NAME+freecp`; protocols `freecp*`) against a transcription of
`chenqi1126/FreeCP@6946aa7` `freecp_segmentor.py` (`forward_feature`, `refinement`, `redundancy_purification`,
`ambiguity_purification`, `forward_slide`, `postprocess_result`, `scoremap2bbox`, `connected_components`) and
`open_clip/transformer.py` (`forward_all`, `custom_attn`), run on a tiny random CLIP."""

from __future__ import annotations

import math

import cv2
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
from clipseg_sparse.methods import freecp
from clipseg_sparse.segment.segmenter import Segmenter
from clipseg_sparse.segment.settings import InferenceSettings
from clipseg_sparse.segment.vocabulary import Vocabulary
from clipseg_sparse.stages import parse_stage
from conftest import TINY_CONFIG, structured_pixels


# -- transcription ----------------------------------------------------------------------------------------------------
def scoremap2bbox(scoremap, threshold, multi_contour_eval=False):
    scoremap = scoremap.cpu().numpy()
    height, width = scoremap.shape
    scoremap_image = np.expand_dims((scoremap * 255).astype(np.uint8), 2)
    _, thr_gray_heatmap = cv2.threshold(src=scoremap_image, thresh=int(threshold * np.max(scoremap_image)), maxval=255, type=cv2.THRESH_BINARY)
    contours = cv2.findContours(image=thr_gray_heatmap, mode=cv2.RETR_TREE, method=cv2.CHAIN_APPROX_SIMPLE)[0]
    if len(contours) == 0:
        return np.asarray([[0, 0, 0, 0]]), 1
    if not multi_contour_eval:
        contours = [max(contours, key=cv2.contourArea)]
    estimated_boxes = []
    for contour in contours:
        x, y, w, h = cv2.boundingRect(contour)
        x0, y0, x1, y1 = x, y, x + w, y + h
        x1 = min(x1, width - 1)
        y1 = min(y1, height - 1)
        estimated_boxes.append([x0, y0, x1, y1])
    return np.asarray(estimated_boxes), len(contours)


def dfs(matrix, visited, node, component):
    visited[node] = True
    component.append(node)
    for neighbor in range(len(matrix)):
        if matrix[node][neighbor] == 1 and not visited[neighbor]:
            dfs(matrix, visited, neighbor, component)


def connected_components(matrix):
    n = len(matrix)
    visited = [False] * n
    components = []
    for node in range(n):
        if not visited[node]:
            component = []
            dfs(matrix, visited, node, component)
            components.append(component)
    return components


def forward_all_attn(clip, img, per_head):
    """`forward_all`'s attn_weights (the CLIP path's attention of every block, head mean as `custom_attn` returns it,
    or per head as GEM's wrapper does), on CLIP-normalised img (1 x 3 x H x W)."""
    v = clip.visual
    gh, gw = img.shape[-2] // 16, img.shape[-1] // 16
    x = v.conv1(img).flatten(2).transpose(1, 2)
    x = torch.cat([v.class_embedding.view(1, 1, -1), x], dim=1) + clip.positional_embedding((gh, gw), "size")
    x = v.ln_pre(x).permute(1, 0, 2)
    attn_weights = []
    for blk in v.transformer.resblocks:
        u = blk.ln_1(x)
        num_heads = blk.attn.num_heads
        _, bsz, embed_dim = u.size()
        head_dim = embed_dim // num_heads
        q, k, val = F.linear(u, blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, dim=-1)
        q = q.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        val = val.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        attn = F.softmax(torch.bmm(q, k.transpose(1, 2)) * head_dim**-0.5, dim=-1)
        out = blk.attn.out_proj(torch.bmm(attn, val).transpose(0, 1).contiguous().view(-1, bsz, embed_dim))
        x = x + out
        x = x + blk.mlp(blk.ln_2(x))
        attn_weights.append(attn if per_head else attn.mean(0, keepdim=True))
    return attn_weights


class Published:
    """FreeCPSegmentation's purification with `self.net.cam` on our tiny CLIP: pixel logits from the preset's
    features (the base model, not transcribed here), attention from `forward_all_attn`, class logits from plain
    CLIP's CLS."""

    def __init__(self, clip, spec, names, num_bkg_prompts, llm, rp, ap, per_head):
        self.clip, self.spec, self.num_bkg_prompts, self.rp_thres, self.ap_thres, self.per_head = clip, spec, num_bkg_prompts, rp, ap, per_head
        self.query_features = clip.encode_text([f"a photo of a {n}." for n in names])
        self.query_featuresLLM = llm
        self.num_queries = len(names)
        self.crops_classified = 0

    def cam(self, image, text_features, base):
        feats, cls = self.clip.encode_dense(image, self.spec if base else None, with_cls=True)
        pixel_logits = 100 * feats.flatten(1, 2) @ text_features.t()
        class_logits = 100 * cls[:, None] @ text_features.t()
        attn = forward_all_attn(self.clip, image, self.per_head) if base else None
        return pixel_logits, class_logits, attn, None

    def refinement(self, img, normalized_logits, attn_weight_list, cls_label):
        _, c, w, h = normalized_logits.shape
        attn_weight = [aw[:, 1:, 1:] for aw in attn_weight_list]
        attn_weight = torch.stack(attn_weight, dim=0)[:-1].mean(dim=0).float()[0]
        trans_mat = attn_weight / torch.sum(attn_weight, dim=0, keepdim=True)
        trans_mat = trans_mat / torch.sum(trans_mat, dim=1, keepdim=True)
        for _ in range(2):
            trans_mat = trans_mat / torch.sum(trans_mat, dim=0, keepdim=True)
            trans_mat = trans_mat / torch.sum(trans_mat, dim=1, keepdim=True)
        trans_mat = (trans_mat + trans_mat.transpose(1, 0)) / 2
        trans_mat = torch.matmul(trans_mat, trans_mat)
        logits_ref = torch.zeros(img.shape[0], self.num_queries, w, h)
        process_length = len(cls_label)
        aff_masks = torch.zeros(process_length, 1, w * h)
        for i in range(self.num_bkg_prompts, c):
            grayscale_cam = normalized_logits[0, i]
            box, cnt = scoremap2bbox(scoremap=grayscale_cam, threshold=0.4, multi_contour_eval=True)
            aff_mask = torch.zeros((grayscale_cam.shape[0], grayscale_cam.shape[1]))
            for i_ in range(cnt):
                x0_, y0_, x1_, y1_ = box[i_]
                aff_mask[y0_:y1_, x0_:x1_] = 1
            aff_masks[i - self.num_bkg_prompts] = aff_mask.view(1, grayscale_cam.shape[0] * grayscale_cam.shape[1])
        trans = trans_mat.unsqueeze(0) * aff_masks
        cam_refined = torch.matmul(trans, normalized_logits[0, self.num_bkg_prompts : c].float().view(-1, h * w, 1)).reshape(-1, w, h)
        for i in range(process_length):
            cam_refined[i] = (cam_refined[i] - cam_refined[i].min()) / (cam_refined[i].max() - cam_refined[i].min() + 1e-8)
            logits_ref[0, self.num_bkg_prompts + cls_label[i]] = cam_refined[i]
        return logits_ref

    def redundancy_purification(self, logits, logits_ref):
        b = self.num_bkg_prompts
        iou = (logits[0, b:] * logits_ref[0, b:]).sum((-1, -2)) / (logits[0, b:].sum((-1, -2)) + logits_ref[0, b:].sum((-1, -2)) + 1e-8)
        candidate_classes = torch.where(iou > self.rp_thres)[0]
        for i in range(b, logits_ref.shape[1]):
            if i - b not in candidate_classes:
                logits_ref[:, i] = logits_ref[:, i] * 0.0
        return logits_ref, candidate_classes

    def ambiguity_purification(self, logits, logits_ref, candidate_classes, img):
        postref = logits_ref[0][self.num_bkg_prompts + candidate_classes]
        postref_expanded = postref.unsqueeze(1)
        intersection = torch.minimum(postref_expanded, postref)
        union = torch.maximum(postref_expanded, postref)
        soft_iou_matrix = torch.sum(intersection, (2, 3)) / torch.sum(union, (2, 3))
        soft_iou_matrix[soft_iou_matrix < self.ap_thres] = 0
        soft_iou_matrix[soft_iou_matrix >= self.ap_thres] = 1
        components = connected_components(soft_iou_matrix)
        if len(components) != 0:
            valid_classes = []
            for group in components:
                if len(group) == 1:
                    valid_classes.append(group[0])
                    continue
                fused_activation = postref[group].mean(0)
                box, cnt = scoremap2bbox(scoremap=fused_activation, threshold=0.4, multi_contour_eval=True)
                have_valid = False
                for i_ in range(cnt):
                    x0_, y0_, x1_, y1_ = box[i_] * 16
                    crop_img = img[:, :, y0_:y1_, x0_:x1_]
                    if y0_ == y1_ or x0_ == x1_:
                        valid_classes.extend(group)
                        continue
                    crop_img = torch.nn.functional.interpolate(crop_img, size=(112, 112), mode="bilinear")
                    _, cls_logits, _, _ = self.cam(crop_img, self.query_featuresLLM[self.num_bkg_prompts + candidate_classes[group]], False)
                    self.crops_classified += 1
                    true_class = group[cls_logits.argmax(-1).squeeze()]
                    valid_classes.extend([true_class])
                    have_valid = True
                if not have_valid:
                    valid_classes.extend(group)
            valid_classes = torch.tensor(valid_classes).unique()
            candidate_classes = candidate_classes[valid_classes]
            for i in range(self.num_bkg_prompts, logits_ref.shape[1]):
                if i - self.num_bkg_prompts not in candidate_classes:
                    logits_ref[:, i] = logits_ref[:, i] * 0.0
        return logits_ref, candidate_classes

    def forward_feature(self, img, cls_label):
        w, h = img[0].shape[-2] // 16, img[0].shape[-1] // 16
        logits, cls_logits, attn_weight_list, _ = self.cam(img, self.query_features, True)
        logits = torch.cat([logits[:, :, : self.num_bkg_prompts], logits[:, :, self.num_bkg_prompts + cls_label]], dim=-1)
        logits = logits.softmax(dim=-1)
        out_dim = logits.shape[-1]
        logits = logits.permute(0, 2, 1).reshape(-1, out_dim, w, h)
        normalized_logits = (logits - logits.min()) / (logits.max() - logits.min())
        logits_ref = self.refinement(img, normalized_logits, attn_weight_list, cls_label)
        logits_ref, candidate_classes = self.redundancy_purification(logits, logits_ref)
        if len(candidate_classes) > 1:
            logits_ref, candidate_classes = self.ambiguity_purification(logits, logits_ref, candidate_classes, img)
        return nn.functional.interpolate(logits_ref, size=img.shape[-2:], mode="bilinear")

    def forward_slide(self, img, cls_label, stride, crop):
        batch_size, _, h_img, w_img = img.shape
        h_grids = max(h_img - crop + stride - 1, 0) // stride + 1
        w_grids = max(w_img - crop + stride - 1, 0) // stride + 1
        preds = img.new_zeros((batch_size, self.num_queries, h_img, w_img))
        count_mat = img.new_zeros((batch_size, 1, h_img, w_img))
        for h_idx in range(h_grids):
            for w_idx in range(w_grids):
                y1, x1 = h_idx * stride, w_idx * stride
                y2, x2 = min(y1 + crop, h_img), min(x1 + crop, w_img)
                y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
                crop_seg_logit = self.forward_feature(img[:, :, y1:y2, x1:x2], cls_label)
                preds += nn.functional.pad(crop_seg_logit, (int(x1), int(preds.shape[3] - x2), int(y1), int(preds.shape[2] - y2)))
                count_mat[:, :, y1:y2, x1:x2] += 1
        return preds / count_mat

    def predict(self, img, num_classes, with_bkg):
        """postprocess_result: the seg logits of the classes, background 1 - max in front when with_bkg."""
        cls_label = torch.arange(num_classes - 1 if with_bkg else num_classes)
        seg = self.forward_slide(img, cls_label, self.stride, self.crop)[0][self.num_bkg_prompts + cls_label]
        if with_bkg:
            seg = torch.cat([1 - torch.max(seg, dim=0, keepdims=True)[0], seg], dim=0)
        return seg, seg.argmax(0)


# -- the stage against the transcription ----------------------------------------------------------------------------
NAMES = ["cat", "dog", "grass", "sky", "car", "tree"]


def _image(seed=0, size=(192, 256)):
    torch.manual_seed(seed)
    return structured_pixels(1, size)


def _run(tiny_clip, spec, stage, vocabulary, pixels, **settings):
    """The Segmenter's N_names x H x W map and labels of `pixels` as an image (resolution 0: the network input is
    the image; its CLIP normalisation undone so that `prepare` gives the same pixels back)."""
    s = InferenceSettings(resolution=0, window=128, stride=64, logit_scale=100.0, stages=stage, **settings)
    seg = Segmenter(tiny_clip, vocabulary, spec=spec, settings=s, templates="single")
    run = seg.image_run(np.zeros((pixels.shape[-2], pixels.shape[-1], 3), np.uint8))
    run.pixels = pixels
    maps = seg._cosine(run)
    return seg, maps.rows(0, pixels.shape[-2])


@pytest.mark.parametrize("with_bkg,per_head", [(False, False), (True, False), (False, True)])
def test_freecp_equals_the_published_purification(tiny_clip, with_bkg, per_head):
    vocabulary = Vocabulary.from_names([["road", "wall"], *[[n] for n in NAMES[:4]]]) if with_bkg else Vocabulary.from_names([[n] for n in NAMES])
    flat = list(vocabulary.flat_names)
    pixels = _image(1)
    words = ",bg" if with_bkg else ""
    stage = (f"freecp:0.02,0.3{words}{',head1' if per_head else ''}", *(("freecpbg",) if with_bkg else ()))
    seg, cos = _run(tiny_clip, "clearclip", stage, vocabulary, pixels)

    ref = Published(tiny_clip, "clearclip", flat, 2 if with_bkg else 0, seg.text, 0.02, 0.3, per_head)
    ref.stride, ref.crop = 64, 128
    assert torch.allclose(ref.query_features, seg.text, atol=1e-6)
    seg_ref, labels_ref = ref.predict(pixels, len(vocabulary), with_bkg)
    assert ref.crops_classified > 0  # the ambiguity purification ran

    classes = [seg_ref[0:1]] * 2 + [seg_ref[i : i + 1] for i in range(1, len(seg_ref))] if with_bkg else [seg_ref]
    expected = torch.cat(classes)  # per name: the background's names share its score
    assert torch.allclose(cos, expected, atol=1e-4)
    probs = torch.softmax(100 * cos, 0)
    got = torch.tensor(vocabulary.name_to_class)[probs.argmax(0)]
    top2 = seg_ref.topk(2, dim=0).values
    near_tie = (top2[0] - top2[1]) < 1e-4
    assert torch.equal(got[~near_tie], labels_ref[~near_tie])


def test_descriptions_set_classifies_crops_with_the_shipped_sentences(tiny_clip):
    """The crop classification reads the set's sentences (each embedded alone, averaged): the same run with the
    descriptions as the transcription's query_featuresLLM."""
    names = ["aeroplane", "bicycle", "bird", "ship", "bottle", "bus"]
    vocabulary = Vocabulary.from_names([[n] for n in names])
    sentences = freecp.read_descriptions("voc21")
    llm = torch.stack([F.normalize(tiny_clip.encode_text(list(sentences[n])).mean(0), dim=-1) for n in names])
    # image 4: its purification decisions are >= 3e-3 from their thresholds (IoU 0.02, soft IoU 0.3) and the crops' top
    # two descriptions 0.3 apart, and 1.7e-5 apart on an AVX2 CPU; image 2's IoU was 5e-4 from 0.02 and its maps
    # 5e-4 apart there, and an AVX-512 CPU (CI) went past 1e-3
    pixels = _image(4)
    seg, cos = _run(tiny_clip, "clearclip", ("freecp:0.02,0.3,voc21",), vocabulary, pixels)
    ref = Published(tiny_clip, "clearclip", names, 0, llm, 0.02, 0.3, False)
    ref.stride, ref.crop = 64, 128
    seg_ref, _ = ref.predict(pixels, len(names), False)
    assert ref.crops_classified > 0
    assert torch.allclose(cos, seg_ref, atol=2e-4)  # per-name min-max magnifies float rounding where a map's range is small


def test_purify_window_keeps_what_passes_both_purifications():
    """Plain-loop checks of the parts: Sinkhorn rows and columns sum to 1 before the square; a name whose refined
    map does not overlap its probabilities is dropped; the output is 0 or a min-max map."""
    torch.manual_seed(0)
    attn = torch.softmax(torch.randn(16, 16), -1)
    t = attn.clone()
    for _ in range(3):
        t = t / t.sum(0, keepdim=True)
        t = t / t.sum(1, keepdim=True)
    sym = (t + t.T) / 2
    assert torch.allclose(freecp.sinkhorn_affinity(attn), sym @ sym)
    cos = torch.randn(4, 4, 3) * 0.1
    out = freecp.purify_window(cos, freecp.sinkhorn_affinity(attn), torch.tensor([False, False, False]), 100.0, 0.99, 0.5, lambda b, n: [0] * len(b))
    assert torch.equal(out, torch.zeros_like(out))  # an IoU above 0.99 cannot happen: every name dropped
    out = freecp.purify_window(cos, freecp.sinkhorn_affinity(attn), torch.tensor([True, False, False]), 100.0, 0.0, 1.01, lambda b, n: [0] * len(b))
    assert torch.equal(out[..., 0], torch.zeros(4, 4))  # a background prompt is never refined
    for c in (1, 2):
        assert math.isclose(float(out[..., c].max()), 1.0, abs_tol=1e-6) and math.isclose(float(out[..., c].min()), 0.0, abs_tol=1e-6)


def test_box_mask_excludes_the_last_row_and_column_as_published():
    cam = torch.zeros(6, 6)
    cam[3:, 3:] = 1.0
    assert freecp.cam_boxes(cam) == [(3, 3, 5, 5)]
    assert freecp.box_mask(cam).sum() == 4
    assert freecp.cam_boxes(torch.zeros(6, 6)) == [(0, 0, 0, 0)]


def test_entmax_near_one_is_close_to_softmax(tiny_clip):
    vocabulary = Vocabulary.from_names([[n] for n in NAMES])
    pixels = _image(3)
    stage = ("freecp:0.02,0.3",)
    _, soft = _run(tiny_clip, "clearclip+freecp", stage, vocabulary, pixels)
    _, near = _run(tiny_clip, "clearclip+freecp/entmax:1.0001", stage, vocabulary, pixels)
    _, sparse = _run(tiny_clip, "clearclip+freecp-entmax", stage, vocabulary, pixels)
    assert (soft - near).abs().mean() < 1e-3
    assert not torch.allclose(soft, sparse, atol=1e-3)


# -- presets, protocols, errors --------------------------------------------------------------------------------------
def test_presets_hook_freecp_on_the_base_as_freecp_codes_it():
    from clipseg_sparse.attention import PRESETS

    assert str(PRESETS.get("gem+freecp").spec).endswith("/hook:freecp:0.15,0.7,head1")
    assert str(PRESETS.get("sclip+freecp").spec) == "qq+kk/softmax/nores/hook:freecp:0.15,0.7"
    assert str(PRESETS.get("maskclip+freecp").spec) == "id/softmax/nores/hook:freecp:0.15,0.7"
    assert str(PRESETS.get("clearclip+freecp-entmax").spec) == "qq/entmax:1.5/nores/noffn/hook:freecp:0.15,0.7"


def test_protocol_follows_the_published_configs():
    """configs/cfg_*.py: Resize (2048, 448) keep_ratio, slide_crop 384 / stride 112 (Cityscapes 560, 224), rp_thres /
    ap_thres per set, with_bkg on VOC21, Context60, COCO-Object."""
    published = {"voc21": (0.15, 0.8), "voc20": (0.15, 0.7), "context60": (0.1, 0.7), "context59": (0.1, 0.7),
                 "coco-object": (0.15, 0.8), "coco-stuff": (0.05, 0.7), "ade20k": (0.05, 0.7), "cityscapes": (0.1, 0.8)}  # fmt: skip
    for name, head in (("freecp", ",head1"), ("freecp-sclip", ""), ("freecp-clearclip", ""), ("freecp-maskclip", "")):
        protocol = PROTOCOLS.get(name)
        for dataset, (rp, ap) in published.items():
            s = protocol.settings(dataset)
            assert (s.resolution, s.window, s.stride) == ((560, 224, 112) if dataset == "cityscapes" else (448, 384, 112))
            bg = dataset in ("voc21", "context60", "coco-object")
            assert s.stages[0].startswith(f"freecp:{rp:g},{ap:g},") and s.stages[0].endswith(("bg" if bg else "") + head or s.stages[0][-6:])
            assert ("freecpbg" in s.stages) == bg and s.bg_threshold == 0
        assert protocol.class_names == "freecp"
    assert PROTOCOLS.get("freecp").settings("ade20k").stages == ("freecp:0.05,0.7,ade20k,head1",)


@pytest.mark.parametrize(
    "text,fragment",
    [("freecp:2,0.7", "0 <= RP"), ("freecp:0.1", "expected freecp"), ("freecp:0.1,0.7,imagenet", "SET one of"),
     ("freecp:0.1,0.7,bg,bg", "expected"), ("freecpbg:1", "no arguments")],
)  # fmt: skip
def test_bad_stage_text_is_one_line(text, fragment):
    with pytest.raises(UserValueError, match=fragment) as e:
        parse_stage(text)
    assert "\n" not in str(e.value)


def test_freecp_refuses_another_backbones_grid(tiny_clip):
    cos = torch.zeros(1, 8, 8, 2)

    class Run:
        clip, settings, vocabulary = tiny_clip, InferenceSettings(window=64, stride=32), Vocabulary.from_names([["a"], ["b"]])

    with pytest.raises(UserValueError, match="patch grid"):
        parse_stage("freecp")(cos, [(0, 64, 0, 64)], Run())


def test_cli_segments_with_freecp_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSEG_SPARSE_CACHE", str(tmp_path / "cache"))
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 128, 3)).astype(np.uint8)).save(image)
    common = ["segment", str(image), "--model", TINY_CONFIG, "--pretrained", "none", "--templates", "single", "--device", "cpu",
              "--resolution", "96", "--window", "64", "--stride", "32"]  # fmt: skip
    ok = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "out"), "--classes", "cat,dog,sky", "--preset", "clearclip/hook:freecp:0.05,0.5,voc21"])
    assert ok.exit_code == 0, ok.output
    assert any((tmp_path / "out").rglob("*.png"))
    bad = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "bad"), "--classes", "cat", "--preset", "clearclip/hook:freecp:0.1,0.7,nope"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1 and "SET one of" in bad.stderr
