"""LaVG (presets `lavg`, `lavg-entmax`, region source `ncut`, option `pool:B`, forward `pooled`, protocol `lavg`)
against a transcription of dahyun-kang/lavg@2db88e5 (`panoptic_cut/panoptic_cut.py`, `panoptic_cut/utils.py`
`detect_box`, `panoptic_cut/dino.py` `ViTFeat` with vit_feat 'k', `panoptic_cut/crf.py` `densecrf_postprocess`,
`clip_segmentor.py` `forward_feature` / `forward_slide`, `clip/model.py` `custom_attn` with csa=True), on
random weights and small images."""

from __future__ import annotations

import numpy as np
import PIL.Image as Image
import pytest
import torch
import torch.nn.functional as F
from scipy import ndimage

from sclip_line_reference import dino_last_qkv, embed, heads, merge, block, sclip_postprocess, slide_inference, structured
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.methods import lavg
from clipseg_sparse.models.backbones import BACKBONES, Backbone
from clipseg_sparse.segment.labels import ClassMaps
from clipseg_sparse.segment.plan import ImageRun, Plan
from clipseg_sparse.segment.regions import REGION_SOURCES
from clipseg_sparse.segment.settings import InferenceSettings


# -- Panoptic Cut, transcribed (panoptic_cut.py, utils.py, dino.py, crf.py) -----------------------------------------
def ref_get_affinity_matrix(feats, tau, eps=1e-5):
    feats = F.normalize(feats, p=2, dim=0)
    A = feats.transpose(0, 1) @ feats
    A = (A > tau).float()
    A[A == 0] = eps
    D = torch.diag(torch.sum(A, dim=1))
    return A, D


def ref_second_smallest_eigenvector(A, D):
    torch.manual_seed(0)  # the only change: the published start is unseeded (the engine seeds it with 0)
    _, eigenvectors = torch.lobpcg(A=D - A, B=D, k=2, largest=False)
    return eigenvectors[:, 1]


def ref_check_num_fg_corners(bipartition, dims):
    b = bipartition.reshape(dims)
    return int(b[0][0]) + int(b[0][-1]) + int(b[-1][0]) + int(b[-1][-1])


def ref_detect_box(bipartition, seed, dims):
    objects, _ = ndimage.label(bipartition.cpu().numpy())
    cc = objects[np.unravel_index(seed.item(), dims)]
    objects = torch.from_numpy(objects)
    binary_mask = objects.to(torch.float)
    binary_mask[objects == cc] = 1.0
    binary_mask[objects != cc] = 0.0
    return binary_mask


def ref_panoptic_cut_forward(feats, dims, init_image_size, tau, N):
    bipartitions = []
    unoccupied = torch.ones(dims, dtype=torch.bool).view(-1)
    occupied = 0
    for _ in range(N):
        feats_i = feats[:, unoccupied]
        A, D = ref_get_affinity_matrix(feats_i, tau)
        eigenvec_sp = ref_second_smallest_eigenvector(A, D)
        bipartition_sp = eigenvec_sp > torch.mean(eigenvec_sp)
        bipartition = torch.zeros(dims, dtype=torch.bool).view(-1)
        eigenvec = torch.zeros(dims, dtype=torch.float).view(-1)
        bipartition[unoccupied] = bipartition_sp
        eigenvec[unoccupied] = eigenvec_sp
        eigenvec[unoccupied == False] = torch.abs(eigenvec_sp).min()  # noqa: E712
        seed = torch.argmax(torch.abs(eigenvec))
        reverse = True if ref_check_num_fg_corners(bipartition, dims) >= 3 else bipartition[seed] != 1
        if reverse:
            eigenvec = eigenvec * -1
            bipartition_sp = torch.logical_not(bipartition_sp)
            bipartition = torch.zeros(dims, dtype=torch.bool).view(-1)
            bipartition[unoccupied] = bipartition_sp
        seed = torch.argmax(eigenvec)
        pseudo_mask = ref_detect_box(bipartition.reshape(dims).float(), seed, dims)
        bipartitions.append(F.interpolate(pseudo_mask[None, None], size=init_image_size, mode="nearest").squeeze().numpy())
        occupied += pseudo_mask.view(-1)
        occupied = (occupied > 0).float()
        unoccupied = torch.logical_not(occupied)
        if unoccupied.sum() <= 5:
            return bipartitions
    return bipartitions


def ref_densecrf_postprocess(pseudo_mask, size):
    width, height = size
    pseudo_mask = pseudo_mask.copy()
    pseudo_mask[pseudo_mask < 0] = 0
    pseudo_mask = np.asarray(Image.fromarray(np.uint8(pseudo_mask * 255)).resize((width, height))).astype(np.uint8).copy()
    upper, lower = np.max(pseudo_mask), np.min(pseudo_mask)
    thresh = upper / 2.0
    pseudo_mask[pseudo_mask > thresh] = upper
    pseudo_mask[pseudo_mask <= thresh] = lower
    return pseudo_mask


def ref_panoptic_cut(rgb: np.ndarray, dino, fixed_size: int, tau: float, N: int) -> list[np.ndarray]:
    """`panoptic_cut` (ViTFeat 'k', patch 8) and predict.py's per-mask post-processing without the CRF."""
    I = Image.fromarray(rgb)
    I_new = I.resize((fixed_size, fixed_size), Image.LANCZOS)
    x = torch.from_numpy(np.asarray(I_new, dtype=np.float32) / 255.0).permute(2, 0, 1)
    x = (x - torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)) / torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)
    q, k, v = dino_last_qkv(dino, x[None])
    feat_h = feat_w = fixed_size // 8
    nb_token = k.shape[2]
    feats = k.transpose(1, 2).reshape(1, nb_token, -1)[:, 1:].transpose(1, 2)[0]
    bips = ref_panoptic_cut_forward(feats, [feat_h, feat_w], [fixed_size, fixed_size], tau, N)
    return [ref_densecrf_postprocess(b, I.size) > 0 for b in bips]


@pytest.fixture(scope="module")
def tiny_dino():
    import timm.models.vision_transformer as vt

    torch.manual_seed(0)
    model = vt.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0, qkv_bias=True).eval()
    return Backbone(BACKBONES.get("dino_vitb8"), model, weights="none")


def rgb_image(seed: int, size=(44, 60)) -> np.ndarray:
    x = structured(1, size, seed)[0].permute(1, 2, 0)
    return ((x - x.min()) / (x.max() - x.min()) * 255).to(torch.uint8).numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ncut_masks_equal_the_published_panoptic_cut(tiny_dino, tmp_path, seed):
    image = rgb_image(seed)
    source = lavg.NCutRegions(tmp_path, backbone=tiny_dino, size=64, count=4)
    got = source.masks(image)
    want = ref_panoptic_cut(image, tiny_dino.model, 64, lavg.NCUT_TAU, 4)
    assert len(got) == len(want) >= 2
    taken = np.zeros(image.shape[:2], bool)
    for g, w in zip(got, want):
        assert np.array_equal(g, w & ~taken)  # an overlap goes to the earlier mask
        taken |= w
    regions = source(image, "a.png")  # cached map: -1 where no mask is
    assert set(np.unique(regions)) <= set(range(-1, len(got)))
    assert np.array_equal(regions == -1, ~taken)


def test_ncut_source_is_registered_and_keyed_by_its_settings(tmp_path, tiny_dino):
    assert "ncut" in REGION_SOURCES
    a = lavg.NCutRegions(tmp_path, backbone=tiny_dino, size=64, count=4)
    assert a.settings() != lavg.NCutRegions(tmp_path, backbone=tiny_dino, size=64, count=3).settings()


# -- the segmentor, transcribed (clip_segmentor.py, clip/model.py) ---------------------------------------------------
def ref_encode(visual, img):
    """`VisionTransformer.forward(return_all=True, csa=True)`: SCLIP's last block, ln_post, proj: N x D."""
    x, rows, cols = embed(visual, img)
    for blk in visual.transformer.resblocks[:-1]:
        x = block(blk, x)
    blk = visual.transformer.resblocks[-1]
    q, k, v = heads(blk.attn, blk.ln_1(x))
    scale = q.shape[-1] ** -0.5
    w = F.softmax(q @ q.transpose(1, 2) * scale, dim=-1) + F.softmax(k @ k.transpose(1, 2) * scale, dim=-1)
    x = x + merge(blk.attn, w @ v)
    x = x + blk.mlp(blk.ln_2(x))
    return visual.ln_post(x) @ visual.proj, rows, cols


def ref_forward_feature(visual, text, img, obj_masks, bgidx=None):
    image_features, rows, cols = ref_encode(visual, img)
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    image_features = image_features[1:]
    c = image_features.shape[-1]
    image_features = image_features.T.reshape(1, c, rows, cols)
    image_features = F.interpolate(image_features, size=img.shape[-2:], mode="bilinear", align_corners=False)
    logits = torch.einsum("b d h w, c d -> b h w c", image_features, text)
    for i in reversed(range(obj_masks.shape[0])):
        if obj_masks[i].sum() == 0:
            continue
        mask_feat = torch.sum(image_features * obj_masks[i], dim=[-1, -2]) / obj_masks[i].sum()
        logits[obj_masks[i].unsqueeze(0)] = mask_feat @ text.T
    if bgidx is not None:
        bglogit = torch.zeros(logits.shape).type(torch.bool)
        bglogit[:, :, :, bgidx:][obj_masks[-1].unsqueeze(0)] = True
        logits[bglogit == True] = logits.min().item()  # noqa: E712
    return logits.permute(0, 3, 1, 2)


def random_regions(size, count: int, seed: int) -> torch.Tensor:
    """H x W ids -1 .. count - 1 from smooth random fields."""
    g = torch.Generator().manual_seed(seed)
    fields = F.interpolate(torch.randn(1, count + 1, 5, 6, generator=g), size=size, mode="bilinear")[0]
    return fields.argmax(0) - 1


def engine_cosine(clip, pixels, spec, text, regions, out_size):
    settings = InferenceSettings(window=64, stride=32, remainder="drop", pos_interp="scale")
    run = ImageRun(Plan.of(spec, settings), clip, text, np.zeros((*out_size, 3), np.uint8), pixels, regions, clip.proxies)
    with torch.inference_mode():
        return run.plan.forward.cosine(run).rows(0, out_size[0])


NAME_TO_CLASS = [0, 0, 1, 2, 3, 3, 4]


@pytest.mark.parametrize("keep", [0, 2])
def test_pooled_forward_equals_the_published_segmentor(tiny_clip, keep):
    torch.manual_seed(3)
    pixels = structured(1, (80, 112), 5)
    regions = random_regions((80, 112), 4, 7)
    text = F.normalize(torch.randn(len(NAME_TO_CLASS), tiny_clip.visual.output_dim), dim=-1)
    out_size = (70, 101)
    got = engine_cosine(tiny_clip, pixels, f"qq+kk/softmax/pool:{keep}", text, regions, out_size)

    masks = torch.stack([regions == i for i in range(4)] + [regions == -1])
    with torch.no_grad():
        def forward_feature(crop, box):
            y1, y2, x1, x2 = box
            return ref_forward_feature(tiny_clip.visual, text, crop, masks[:, y1:y2, x1:x2], keep or None)

        want = slide_inference_boxes(forward_feature, pixels, 64, 32)
        want = F.interpolate(want, size=out_size, mode="bilinear")[0]
    assert (got - want).abs().max() < 1e-4
    probs, labels = sclip_postprocess(want, NAME_TO_CLASS, 40.0)
    maps = ClassMaps(lavg_cosine_map(got), NAME_TO_CLASS, 5, 40.0)
    got_labels = torch.from_numpy(maps.labels(0.0, 0.0))
    top2 = probs.topk(2, dim=0).values
    off_ties = (top2[0] - top2[1]) > 1e-3
    assert torch.equal(got_labels[off_ties], labels[off_ties])
    assert len(labels.unique()) > 1


def lavg_cosine_map(cos):
    from clipseg_sparse.segment.maps import DenseMap

    return DenseMap(cos)


def slide_inference_boxes(forward_feature, img, crop, stride):
    """`slide_inference` with each window's box given to `forward_feature` (`forward_slide` crops the masks so)."""
    boxes = []

    def with_box(window):
        y1, x1 = boxes.pop(0)
        return forward_feature(window, (y1, y1 + window.shape[-2], x1, x1 + window.shape[-1]))

    _, _, h_img, w_img = img.shape
    for hi in range(max(h_img - crop + stride - 1, 0) // stride + 1):
        for wi in range(max(w_img - crop + stride - 1, 0) // stride + 1):
            y2, x2 = min(hi * stride + crop, h_img), min(wi * stride + crop, w_img)
            boxes.append((max(y2 - crop, 0), max(x2 - crop, 0)))
    return slide_inference(with_box, img, crop, stride)


def test_entmax_variant_is_softmax_near_one_and_differs_at_one_and_a_half(tiny_clip):
    pixels = structured(1, (64, 96), 9)
    regions = random_regions((64, 96), 3, 2)
    text = F.normalize(torch.randn(5, tiny_clip.visual.output_dim, generator=torch.Generator().manual_seed(1)), dim=-1)
    soft = engine_cosine(tiny_clip, pixels, "lavg", text, regions, (64, 96))
    near = engine_cosine(tiny_clip, pixels, "qq+kk/entmax:1.0001/pool:0", text, regions, (64, 96))
    far = engine_cosine(tiny_clip, pixels, "lavg-entmax", text, regions, (64, 96))
    assert (soft - near).abs().max() < 1e-3
    assert (soft - far).abs().max() > 1e-3


def test_pool_option_needs_regions_and_a_count():
    assert Plan.of("lavg").forward_name == "pooled"
    assert Plan.of("lavg").needs.regions
    with pytest.raises(UserValueError, match="pool:B"):
        Plan.of("qq+kk/softmax/pool:x")


def test_protocol_follows_the_configs():
    p = PROTOCOLS.get("lavg")
    assert p.attention == "lavg" and p.class_names == "sclip"
    assert p.settings("voc21").logit_scale == 65 and p.settings("voc21").bg_threshold == 0.1
    assert p.settings("voc21").area_threshold == 0.1
    assert p.settings("context60").logit_scale == 50 and p.settings("coco-object").logit_scale == 50
    assert p.settings("coco-stuff").resolution == 448 and p.settings("cityscapes").resolution == 560
    assert p.settings("ade20k").resolution == 336 and (p.settings("ade20k").window, p.settings("ade20k").stride) == (224, 112)
    from importlib.resources import files

    background = files("clipseg_sparse").joinpath("data/class_names/sclip/voc21.txt").read_text().splitlines()[0]
    assert str(p.spec_for("voc21")) == f"qq+kk/softmax/pool:{len(background.split(', '))}"
    assert str(p.spec_for("voc21", "lavg-entmax")).endswith("/pool:26") and str(p.spec_for("voc20")) == "qq+kk/softmax/pool:0"
