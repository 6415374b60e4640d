"""CLIPer (presets `cliper`, `cliper-nofgc` and their `-entmax`, options `fuse`, `cam`, `bg`, `fgc`, forward `fused`,
protocols `cliper*`) against a transcription of linsun449/cliper.code@c05fa41 (`modified_clip/model.py`: `upsample_pos_emb`,
`forward_visual`, `forward_transformer`, `custom_attn` ('fused-attn'), `classify`, `forward`, `forward_slide`,
`_resize`; `ovs/pipeline.py` (`refinement`: None and 'SFSA'); `diffusion_model/stable_diffusion.py`, `Processor.py`;
`ovs/main_ovs.py`; `util/miou.py`: `cam_to_label`), run on random weights through the models' own modules
(nn.MultiheadAttention with need_weights for blocks 1..L-1; a tiny random diffusers StableDiffusionPipeline)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import tiny_stable_diffusion, window_run
from sclip_line_reference import structured
from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.errors import UserValueError
from clipseg_sparse.methods import cliper
from clipseg_sparse.segment.labels import ClassMaps
from clipseg_sparse.segment.maps import DenseMap
from clipseg_sparse.segment.plan import Plan


# -- transcription (batch 1, LND as the published code; blocks read through ln_1, attn, ln_2, mlp) ---------------
def ref_upsample_pos_emb(emb, new_size):
    first, emb = emb[:1, :], emb[1:, :]
    n, d = emb.size(0), emb.size(1)
    size = int(np.sqrt(n))
    emb = emb.permute(1, 0).view(1, d, size, size)
    emb = F.interpolate(emb, size=new_size, mode="bilinear")
    emb = emb.view(d, -1).contiguous().permute(1, 0)
    emb = torch.cat([first, emb], 0)
    return emb.half()


def ref_custom_attn(attn_layer, x, attn_mask):
    num_heads = attn_layer.num_heads
    _, bsz, embed_dim = x.size()
    head_dim = embed_dim // num_heads
    q, k, v = F.linear(x, attn_layer.in_proj_weight, attn_layer.in_proj_bias).chunk(3, dim=-1)
    v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
    attn_mask /= torch.sum(attn_mask, dim=-2, keepdim=True)
    attn_mask /= torch.sum(attn_mask, dim=-1, keepdim=True)
    attn_mask = (attn_mask + attn_mask.transpose(-2, -1)) / 2
    attn_mask -= attn_mask.mean(-2, keepdim=True)
    attn_mask = torch.clamp(attn_mask, 0)
    attn_mask /= torch.sum(attn_mask, dim=-1, keepdim=True)
    attn_mask = attn_mask.flatten(0, 1)
    attn_weights = torch.repeat_interleave(attn_mask, dim=0, repeats=v.shape[0] // attn_mask.shape[0])
    attn_output = torch.bmm(attn_weights, v)
    attn_output = attn_output.transpose(0, 1).contiguous().view(-1, bsz, embed_dim)
    return attn_layer.out_proj(attn_output), attn_weights


def ref_mha(blk, ln_x):
    """resblocks[i].attn(ln_x, ln_x, ln_x, need_weights=True, average_attn_weights=False) on LND tokens."""
    y = ln_x.transpose(0, 1) if blk.attn.batch_first else ln_x
    out, w = blk.attn(y, y, y, need_weights=True, average_attn_weights=False)
    return (out.transpose(0, 1) if blk.attn.batch_first else out), w


def ref_encode_image(visual, img, patch=16):
    """forward_visual + forward_transformer (fuse_feature True, attn_type 'fused-attn'): L x (N+1) x D, attn."""
    h, w = img.shape[-2:]
    pos = ref_upsample_pos_emb(visual.positional_embedding, (h // patch, w // patch))
    x = visual.conv1(img)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    x = torch.cat([visual.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype), x], dim=1)
    x = visual.ln_pre(x + pos.to(x.dtype)).permute(1, 0, 2)
    blocks = visual.transformer.resblocks
    layers = len(blocks)
    attn_maps, img_features = 0, torch.zeros([layers] + list(x.shape), dtype=x.dtype)
    for i in range(layers - 1):
        ln_x = blocks[i].ln_1(x)
        img_features[i] = ln_x
        ln_x, attn_map = ref_mha(blocks[i], ln_x)
        attn_maps += attn_map
        x = x + ln_x
        x = x + blocks[i].mlp(blocks[i].ln_2(x))
    res = blocks[-1]
    img_features[-1] = x
    for kth, x in enumerate(img_features):
        ln_x, attn = ref_custom_attn(res.attn, res.ln_1(x), attn_mask=attn_maps)
        img_features[kth] = ln_x
    img_features = visual.ln_post(img_features.squeeze())
    return img_features @ visual.proj, attn


def ref_classify(x, text_emb, logit_scale):
    x = x / x.norm(dim=-1, keepdim=True)
    norm_text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True)
    return logit_scale * x @ norm_text_emb.to(x.dtype).t()


def ref_forward_slide(visual, img, text_features, logit_scale, stride, crop_size, patch=16):
    _, _, h_img, w_img = img.shape
    layers = len(visual.transformer.resblocks)
    h_grids = max(h_img - crop_size + stride - 1, 0) // stride + 1
    w_grids = max(w_img - crop_size + stride - 1, 0) // stride + 1
    preds = img.new_zeros((layers, len(text_features), h_img // patch, w_img // patch))
    attns = img.new_zeros((h_img // patch, w_img // patch, h_img // patch, w_img // patch))
    count_mat = img.new_zeros((1, h_img // patch, w_img // patch))
    count_mat_attns = torch.zeros_like(attns)
    for h_idx in range(h_grids):
        for w_idx in range(w_grids):
            y1, x1 = h_idx * stride, w_idx * stride
            y2, x2 = min(y1 + crop_size, h_img), min(x1 + crop_size, w_img)
            y1, x1 = max(y2 - crop_size, 0), max(x2 - crop_size, 0)
            crop_img = img[:, :, y1:y2, x1:x2]
            cts_h, cts_w = crop_img.shape[-2] // patch, crop_img.shape[-1] // patch
            cts_y1, cts_y2, cts_x1, cts_x2 = y1 // patch, y2 // patch, x1 // patch, x2 // patch
            img_feature, attn = ref_encode_image(visual, crop_img, patch)
            seg = ref_classify(img_feature[:, 1:], text_features, logit_scale)
            seg = seg.transpose(-1, -2).reshape(-1, len(text_features), cts_h, cts_w)
            attns[cts_y1:cts_y2, cts_x1:cts_x2, cts_y1:cts_y2, cts_x1:cts_x2] += attn.mean(0)[1:, 1:].reshape(cts_h, cts_w, cts_h, cts_w)
            count_mat_attns[cts_y1:cts_y2, cts_x1:cts_x2, cts_y1:cts_y2, cts_x1:cts_x2] += 1
            preds[..., cts_y1:cts_y2, cts_x1:cts_x2] += seg
            count_mat[..., cts_y1:cts_y2, cts_x1:cts_x2] += 1
    preds /= count_mat
    attns /= count_mat_attns + 1e-5
    attns = attns.flatten(0, 1).flatten(-2, -1)
    attns /= attns.sum(dim=-1, keepdim=True)
    preds = preds.flatten(-2, -1) @ attns
    return preds.unflatten(-1, sizes=(h_img // patch, w_img // patch))


def ref_forward(visual, img, fg, bg, logit_scale, attention_thr, select_layer=-1, crop=0, stride=112, patch=16):
    """CLIPer.forward: seg (C x h x w)."""
    img_h, img_w = img.shape[2] // patch, img.shape[3] // patch
    text_features = torch.cat([fg, bg, fg.mean(0, True)], dim=0)
    img_feature, attn = ref_encode_image(visual, img, patch)
    seg = ref_classify(img_feature, text_features, logit_scale)[:, 1:]
    seg = seg.transpose(-1, -2).reshape(-1, len(text_features), img_h, img_w)
    seg = seg.softmax(-3)[:, : len(fg)]
    if crop > 0:
        seg_slide = ref_forward_slide(visual, img, text_features, logit_scale, stride, crop, patch).to(seg.dtype)
        seg_slide = seg_slide.softmax(-3)[:, : len(fg)]
        seg = seg_slide * 0.5 + seg * 0.5
    seg_last = seg[select_layer]
    seg_last[seg_last < seg_last.amax((-1, -2), keepdim=True) * attention_thr] = 0
    seg_last = seg_last.flatten(-2, -1) @ attn.mean(0)[1:, 1:]
    seg_last = seg_last.unflatten(dim=-1, sizes=(img_h, img_w))
    return seg_last + seg.mean(0)


def ref_cam_to_label(cam, cls_label, bkg_thre=0.3, cls_thre=0.4, is_normalize=True):
    b, c, h, w = cam.shape
    cls_label_rep = (cls_label > cls_thre).unsqueeze(-1).unsqueeze(-1).repeat([1, 1, h, w])
    reshape_cam = cam.reshape(b, c, -1)
    if is_normalize:
        reshape_cam -= reshape_cam.amin(dim=-1, keepdim=True)
        reshape_cam /= reshape_cam.amax(dim=-1, keepdim=True) + 1e-6
    if bkg_thre > 0:
        reshape_cam[reshape_cam < bkg_thre] = 0
        reshape_cam = reshape_cam.reshape(b, c, h, w)
        valid_cam = cls_label_rep * reshape_cam
        cam_value, _pseudo_label = valid_cam.max(dim=1, keepdim=False)
        _pseudo_label += 1
        _pseudo_label[cam_value == 0] = 0
    else:
        reshape_cam = reshape_cam.reshape(b, c, h, w)
        valid_cam = cls_label_rep * reshape_cam
        valid_cam = torch.cat([torch.pow(1 - valid_cam.amax(dim=1, keepdim=True), 2), valid_cam], dim=1)
        _pseudo_label = valid_cam.argmax(dim=1)
    return valid_cam, _pseudo_label


@torch.no_grad()
def ref_main(visual, img, fg, bg, ori_size, thr, score, bkg, norm, logit_scale=100.0, select_layer=-1, crop=0, stride=112):
    """Pipeline.forward (refinement None) and main_ovs.py's labels: (valid cams, labels 0 = background)."""
    seg = ref_forward(visual, img, fg, bg, logit_scale, thr, select_layer, crop, stride)
    final_score = seg.amax(dim=(-1, -2))
    pred_mask = seg
    final_score = pred_mask.amax(dim=(-1, -2)) * 0.5 + final_score * 0.5
    pred_mask = F.interpolate(pred_mask[None], size=ori_size, mode="bilinear")[0]
    pred_mask = pred_mask / (pred_mask.amax((-1, -2), keepdim=True) + 1e-5) * final_score[..., None, None]
    valid, labels = ref_cam_to_label(pred_mask[None].clone(), final_score[None], bkg_thre=bkg, cls_thre=score, is_normalize=norm)
    return valid[0], labels[0]


def _texts(n_fg, n_bg, seed=1, dim=64):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n_fg, dim, generator=g), dim=-1), F.normalize(torch.randn(n_bg, dim, generator=g), dim=-1)


def _engine(clip, pixels, spec, text, out_size, logit_scale=100.0, window=0, stride=112):
    run = window_run(clip, pixels, spec, text, window=window, stride=stride, logit_scale=logit_scale)
    with torch.inference_mode():
        return cliper.fused_scores(run, out_size).values


# -- the forward against the transcription -------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["voc21", "context", "slide", "layer2"])
def test_cliper_scores_and_labels_equal_the_published_code(tiny_clip, case):
    """Tiny 3-block ViT at 64 x 96 (4 x 6 patches), 4 names and 3 background words in the vocabulary (bg:3): the
    valid cams within 1e-4 and the labels equal off near-ties, for VOC21's (normalised), Context's, a 64 px window
    at stride 32 with the whole image, and the second-to-last layer propagated."""
    fg, bg = _texts(4, 3)
    consts = {"voc21": (0.1, 0.7, 0.6, True), "context": (0.2, 0.45, 0.45, False), "slide": (0.2, 0.3, 0.3, False),
              "layer2": (0.2, 0.3, 0.3, False)}[case]  # fmt: skip
    layer, crop = (-2 if case == "layer2" else -1), (64 if case == "slide" else 0)
    pixels = structured(1, (64, 96), seed=4)
    want_valid, want_labels = ref_main(tiny_clip.visual, pixels, fg, bg, (50, 70), *consts, select_layer=layer, crop=crop, stride=32)
    spec = cliper._spec(*consts, 3, layer, fgc=False)
    got = _engine(tiny_clip, pixels, spec, torch.cat([bg, fg]), (50, 70), window=crop, stride=32)
    assert got.shape == (7, 50, 70)
    assert (got[3:] - want_valid).abs().max() < 1e-4 and got[:3].abs().max() == 0
    maps = ClassMaps(DenseMap(got), [0, 0, 0, 1, 2, 3, 4], 5, 100.0)
    labels = torch.from_numpy(maps.labels(0.0))
    top2 = torch.cat([torch.zeros(1, 50, 70), want_valid]).topk(2, dim=0).values
    sure = ((top2[0] - top2[1]) > 1e-4) | (top2[0] == 0)  # not a near-tie, or background (no name left)
    assert sure.float().mean() > 0.9 and torch.equal(labels[sure], want_labels[sure])
    assert want_labels.unique().numel() > 1  # the thresholds matter


def test_a_zero_background_threshold_gives_the_background_channel(tiny_clip):
    """bkg_thre 0 (cam_to_label's second branch): the background names carry (1 - max)^2."""
    fg, bg = _texts(3, 2, seed=5)
    pixels = structured(1, (64, 64), seed=6)
    want_valid, _ = ref_main(tiny_clip.visual, pixels, fg, bg, (40, 40), 0.2, 0.0, 0.0, False)
    got = _engine(tiny_clip, pixels, cliper._spec(0.2, 0.0, 0.0, False, 2, fgc=False), torch.cat([bg, fg]), (40, 40))
    assert (got[:2] - want_valid[0]).abs().max() < 1e-4 and (got[2:] - want_valid[1:]).abs().max() < 1e-4


def test_background_words_are_embedded_with_the_run_templates(tiny_clip):
    """bg:WORDS on a vocabulary without background names: CLIPer's words embedded as the vocabulary was."""
    from clipseg_sparse.segment.vocabulary import embed_names

    templates = ("a photo of a {}.", "a {} in the scene")
    fg = embed_names(tiny_clip, ["cat", "dog", "grass"], templates)
    words = embed_names(tiny_clip, list(cliper.BACKGROUND_WORDS["voc"]), templates)
    pixels = structured(1, (64, 64), seed=2)
    want, _ = ref_main(tiny_clip.visual, pixels, fg, words, (64, 64), 0.1, 0.0, 0.001, False)
    run = window_run(tiny_clip, pixels, cliper._spec(0.1, 0.0, 0.001, False, "voc", fgc=False), fg, window=0, logit_scale=100.0)
    run.templates = templates
    got = cliper.fused_scores(run, (64, 64)).values
    assert got.shape == (3, 64, 64) and (got - want).abs().max() < 1e-4


def test_the_resize_is_cliper_s(tiny_clip):
    """`_resize` (PIL bicubic, sides rounded to the nearest patch multiple) then ToTensor and CLIP's Normalize."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (37, 61, 3), dtype=np.uint8)
    pil = Image.fromarray(image)
    ratio = 64 / min(pil.size)
    w, h = pil.size[0] * ratio, pil.size[1] * ratio
    h, w = int(h / 16 + 0.5) * 16, int(w / 16 + 0.5) * 16
    want = torch.from_numpy(np.array(pil.resize((w, h), Image.BICUBIC))).permute(2, 0, 1).float() / 255
    want = (want - torch.tensor(tiny_clip.mean).view(3, 1, 1)) / torch.tensor(tiny_clip.std).view(3, 1, 1)
    settings = Plan.of("cliper-nofgc").settings.replace(resolution=64)
    got = cliper.FusedForward().pixels(image, tiny_clip, settings)
    assert got.shape == (1, 3, 64, 112) and (got[0] - want).abs().max() < 1e-6


# -- FGC: diffusion_model/stable_diffusion.py, Processor.py, ovs/pipeline.py (refinement 'SFSA') on a tiny SD ------------
@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    pytest.importorskip("diffusers")
    return tiny_stable_diffusion(tmp_path_factory.mktemp("tok"))


DIFFUSION_LAYERS_USED = {-4: "up_blocks[3].attentions[1].transformer_blocks[0].attn1", -6: "up_blocks[3].attentions[0].transformer_blocks[0].attn1"}


class RefAttnProcessorForCallBack:
    """Processor.py's AttnProcessorForCallBack."""

    def __init__(self, model, layer):
        self.model = model
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        query = attn.head_to_batch_dim(query)
        key = attn.head_to_batch_dim(key)
        value = attn.head_to_batch_dim(value)
        attention_probs = attn.get_attention_scores(query, key, attention_mask)
        hidden_states = torch.bmm(attention_probs, value)
        hidden_states = attn.batch_to_head_dim(hidden_states)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        hidden_states = hidden_states / attn.rescale_output_factor
        head_size = attn.heads
        batch_size, q_len, v_len = attention_probs.shape
        self.model.attention_maps[self.layer] = attention_probs.reshape(batch_size // head_size, head_size, q_len, v_len)
        return hidden_states


class RefDiffusion:
    """stable_diffusion.py's `diffusion` (time_step 45) on a given pipeline, its processors restored afterwards."""

    def __init__(self, pipe, layers=(-4, -6), time_step=45):
        self.model, self.layers, self.time_step, self.attention_maps = pipe, layers, time_step, {}
        self.dtype = pipe.unet.dtype

    def one_step(self, latents, prompts):
        from diffusers.utils.torch_utils import randn_tensor

        self.model.scheduler.set_timesteps(50, device="cpu")
        t = self.model.scheduler.timesteps[self.time_step]
        noise = randn_tensor(latents.shape, device=latents.device, dtype=latents.dtype)
        latents = self.model.scheduler.add_noise(latents, noise, t)
        prompt_embeds, _ = self.model.encode_prompt(prompts, "cpu", 1, do_classifier_free_guidance=False, negative_prompt=None,
                                                    prompt_embeds=None, negative_prompt_embeds=None, lora_scale=None, clip_skip=None)
        self.model.unet(latents, t, encoder_hidden_states=prompt_embeds, return_dict=False)

    def __call__(self, img, prompts=""):
        attns = {idx: self.model.unet.get_submodule(DIFFUSION_LAYERS_USED[idx].replace("[", ".").replace("]", "")) for idx in self.layers}
        before = {idx: a.processor for idx, a in attns.items()}
        for idx, a in attns.items():
            a.processor = RefAttnProcessorForCallBack(self, idx)
        try:
            latent = self.model.image_processor.preprocess(img, height=512, width=512).to(self.dtype)
            latent = self.model.vae.encode(latent)[0].mean * self.model.vae.config.scaling_factor
            self.one_step(latent, prompts=prompts)
        finally:
            for idx, a in attns.items():
                a.processor = before[idx]


def ref_refinement(sd, ori_img, pred_mask, attention_thr, layers=(-4, -6)):
    """Pipeline.refinement with refinement 'SFSA'."""
    from functools import reduce

    pred_mask = F.interpolate(pred_mask[None], size=(64, 64), mode="bilinear", align_corners=False)[0].flatten(-2).float()
    cross_att = pred_mask.transpose(0, 1)
    sd(ori_img, "")
    self_att = torch.cat([sd.attention_maps[idx][0] for idx in layers]).float()
    self_att /= torch.amax(self_att, dim=-2, keepdim=True) + 1e-5
    self_att = torch.where(self_att < attention_thr, 0, self_att)
    self_att /= self_att.sum(dim=-1, keepdim=True) + 1e-5
    self_att = reduce(torch.matmul, self_att, torch.eye(self_att.shape[-1], device=self_att.device))
    return (self_att @ cross_att).transpose(0, 1).reshape(-1, 64, 64)


@torch.no_grad()
def ref_main_fgc(visual, sd, image, img, fg, bg, thr, score, bkg, norm, seed, logit_scale=100.0):
    """Pipeline.forward with FGC (the noise drawn after torch.manual_seed(seed)) and main_ovs.py's labels."""
    ori_img = torch.from_numpy(image).float().permute(2, 0, 1)[None] / 255.0
    seg = ref_forward(visual, img, fg, bg, logit_scale, thr)
    final_score = seg.amax(dim=(-1, -2))
    torch.manual_seed(seed)
    pred_mask = ref_refinement(sd, ori_img, seg, thr)
    final_score = pred_mask.amax(dim=(-1, -2)) * 0.5 + final_score * 0.5
    pred_mask = F.interpolate(pred_mask[None], size=image.shape[:2], mode="bilinear")[0]
    pred_mask = pred_mask / (pred_mask.amax((-1, -2), keepdim=True) + 1e-5) * final_score[..., None, None]
    valid, labels = ref_cam_to_label(pred_mask[None].clone(), final_score[None], bkg_thre=bkg, cls_thre=score, is_normalize=norm)
    return valid[0], labels[0]


def _image(seed, size=(60, 84)):
    """A uint8 image of a few smooth blobs."""
    g = torch.Generator().manual_seed(seed)
    x = F.interpolate(torch.rand(1, 3, 3, 3, generator=g), size=size, mode="bilinear")[0] + 0.1 * torch.rand(3, *size, generator=g)
    return (x.clamp(0, 1) * 255).byte().permute(1, 2, 0).numpy()


def test_fgc_maps_are_the_published_processor_s(tiny_sd):
    """The recorded maps (layers -4, -6, every head) equal the published processor's on the same seeded noise."""
    image = _image(1)
    sd = RefDiffusion(tiny_sd)
    torch.manual_seed(3)
    sd(torch.from_numpy(image).float().permute(2, 0, 1)[None] / 255.0, "")
    want = torch.cat([sd.attention_maps[idx][0] for idx in (-4, -6)]).float()
    got = cliper.sd_self_attention(tiny_sd, image, cliper.Fgc(45, 3))
    assert got.shape == (4, 4096, 4096) and (got - want).abs().max() < 1e-6


def test_cliper_with_fgc_equals_the_published_pipeline(tiny_clip, tiny_sd, monkeypatch):
    """The whole method with FGC on a tiny CLIP and a tiny SD (VOC21's constants): valid cams within 1e-3, labels
    equal off near-ties."""
    consts = (0.1, 0.7, 0.6, True)
    image = _image(2)
    fg, bg = _texts(4, 3, seed=7)
    forward = cliper.FusedForward()
    pixels = forward.pixels(image, tiny_clip, Plan.of("cliper").settings.replace(resolution=64))
    want_valid, want_labels = ref_main_fgc(tiny_clip.visual, RefDiffusion(tiny_sd), image, pixels, fg, bg, *consts, seed=0)
    monkeypatch.setattr(cliper, "_PIPELINES", {})
    cliper.use_diffusion(tiny_sd, "cpu")
    run = window_run(tiny_clip, pixels, cliper._spec(*consts, 3), torch.cat([bg, fg]), window=0, logit_scale=100.0)
    run.image = image
    got = cliper.fused_scores(run).values
    # min-max over maps whose range is ~1e-2 (the tiny SD) magnifies the two products' different orders of summation
    assert (got[3:] - want_valid).abs().max() < 1e-3
    top2 = torch.cat([torch.zeros(1, *image.shape[:2]), want_valid]).topk(2, dim=0).values
    sure = ((top2[0] - top2[1]) > 1e-4) | (top2[0] == 0)
    labels = torch.from_numpy(ClassMaps(DenseMap(got), [0, 0, 0, 1, 2, 3, 4], 5, 100.0).labels(0.0))
    assert sure.float().mean() > 0.9 and torch.equal(labels[sure], want_labels[sure])


def test_fgc_refine_is_the_chained_product():
    """Right to left on the names' columns = the published eye @ S_1 @ ... @ S_n @ cross (float64)."""
    g = torch.Generator().manual_seed(0)
    maps = torch.rand(3, 16, 16, generator=g, dtype=torch.float64).softmax(-1)
    seg = torch.rand(2, 3, 5, generator=g, dtype=torch.float64)
    cross = F.interpolate(seg[None], size=(4, 4), mode="bilinear", align_corners=False)[0].flatten(-2).T
    S = maps / (maps.amax(-2, keepdim=True) + 1e-5)
    S = torch.where(S < 0.2, 0, S)
    S = S / (S.sum(-1, keepdim=True) + 1e-5)
    chain = torch.eye(16, dtype=torch.float64)
    for s in S:
        chain = chain @ s
    assert torch.allclose(cliper.fgc_refine(seg.float(), maps.float(), 0.2), (chain @ cross).T.reshape(2, 4, 4).float(), atol=1e-5)


def test_fgc_entmax_slot(tiny_sd, monkeypatch):
    """entmax in the two recorded SD maps (at 128 px: 16 x 16 latents, for speed)."""
    monkeypatch.setattr(cliper, "SD_SIZE", 128)
    image = _image(4)
    maps = {n: cliper.sd_self_attention(tiny_sd, image, cliper.Fgc(), n) for n in ("softmax", "entmax:1.0001", "entmax:1.5")}
    assert (maps["entmax:1.0001"] - maps["softmax"]).abs().max() < 1e-3
    assert (maps["entmax:1.5"] == 0).float().mean() > 0.5 and (maps["softmax"] == 0).float().mean() < 0.01


def test_fgc_without_its_weights_is_one_line(tiny_clip, monkeypatch):
    """No SD 2.1-base in the cache and the Hub unreachable: the run stops before any image with one line."""
    from clipseg_sparse.runtime.weights import WeightsUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    monkeypatch.setattr(cliper, "_PIPELINES", {})
    with pytest.raises(WeightsUnavailableError, match="stabilityai/stable-diffusion-2-1-base") as error:
        Plan.of("cliper", clip=tiny_clip)
    assert "\n" not in str(error.value) and "cliper-nofgc" in str(error.value)
    Plan.of("cliper-nofgc", clip=tiny_clip)


# -- entmax, checks, protocols, grid -------------------------------------------------------------------------------
def test_cliper_entmax_tends_to_cliper(tiny_clip):
    pixels = structured(1, (64, 64), seed=3)
    feats = {n: cliper.fused_features(tiny_clip, pixels, n)[0] for n in ("softmax", "entmax:1.0001", "entmax:1.5")}
    assert (feats["entmax:1.0001"] - feats["softmax"]).abs().max() < 1e-3
    assert (feats["entmax:1.5"] - feats["softmax"]).abs().max() > 1e-2
    assert AttentionSpec.parse("cliper-nofgc-entmax") == AttentionSpec.parse("cliper-nofgc").replace(normalizer="entmax:1.5")


@pytest.mark.parametrize("bad", ["cliper-nofgc/gauss:5", "qq/softmax/nores/noffn/fuse:0.2", "qk/softmax/noffn/fuse:0.2", "sclip/cam:0.3,0.3"])
def test_specs_the_fused_forward_cannot_run_are_refused(bad):
    with pytest.raises(UserValueError):
        Plan.of(bad)


@pytest.mark.parametrize("bad", ["cliper-nofgc/fuse:2", "cliper-nofgc/fuse:0.2,1", "cliper-nofgc/cam:0.3", "cliper-nofgc/cam:0.3,0.3,yes",
                                 "cliper-nofgc/bg:sky", "cliper-nofgc/bg:-1"])
def test_bad_option_arguments_are_refused(bad):
    with pytest.raises(UserValueError):
        AttentionSpec.parse(bad)


def test_the_layer_must_exist(tiny_clip):
    with pytest.raises(UserValueError, match="3 blocks"):
        Plan.of("cliper-nofgc/fuse:0.2,-4", clip=tiny_clip)
    Plan.of("cliper-nofgc/fuse:0.2,-3", clip=tiny_clip)


def test_explain_reads_the_last_input_s_fused_map(tiny_clip):
    run = window_run(tiny_clip, structured(1, (64, 96), seed=1), "cliper-nofgc", window=0)
    (window,) = cliper.FusedForward().attention(run)
    assert window.grid == (4, 6) and window.maps.shape == (3, 25, 25)
    assert torch.allclose(window.maps.sum(-1), torch.ones(3, 25))


# linsun449/cliper.code@c05fa41 template/car_template.txt
CAR_TEMPLATE = """a clean origami {}.
a photo of a {}.
This is a photo of a {}
There is a {} in the scene
There is the {} in the scene
a photo of a {} in the scene
a photo of a small {}.
a photo of a medium {}.
a photo of a large {}.
This is a photo of a small {}.
This is a photo of a medium {}.
This is a photo of a large {}.
There is a small {} in the scene.
There is a medium {} in the scene.
There is a large {} in the scene."""
# typed from linsun449/cliper.code@c05fa41 scripts/config/vit-b-16/*.yaml (attention_thr, score_threshold, bkg_thre,
# is_normalize, select_layer, logit_scale, size, the sliding_crop_size line) and data/*/cls_*.txt's first lines
CLIPER_B16 = {
    "voc21": dict(thr=0.1, score=0.7, bkg=0.6, norm=True, bg=25, scale=100, size=336, crop=336, tpl="car"),
    "context60": dict(thr=0.2, score=0.45, bkg=0.45, norm=False, bg=1, scale=100, size=336, crop=224, tpl="car"),
    "coco-object": dict(thr=0.2, score=0.3, bkg=0.3, norm=False, bg=23, scale=50, size=336, crop=224, tpl="openai"),
    "voc20": dict(thr=0.1, score=0.0, bkg=0.001, norm=False, bg="voc", scale=100, size=336, crop=336, tpl="car"),
    "context59": dict(thr=0.2, score=0.3, bkg=0.3, norm=False, bg="background", scale=100, size=336, crop=224, tpl="car"),
    "coco-stuff": dict(thr=0.2, score=0.1, bkg=0.1, norm=False, bg="background", scale=50, size=336, crop=224, tpl="car"),
    "ade20k": dict(thr=0.2, score=0.3, bkg=0.3, norm=False, bg="background", scale=100, size=336, crop=224, tpl="car"),
    "cityscapes": dict(thr=0.35, score=0.0, bkg=0.0001, norm=False, bg="background", scale=100, size=560, crop=224, tpl="openai"),
}  # fmt: skip
# scripts/config/vit-l-14/*.yaml: (thr, score, bkg, norm, select_layer, scale, size); semantic_templates
CLIPER_L14_TEMPLATES = {'voc21': 'car', 'context60': 'openai', 'coco-object': 'openai', 'voc20': 'car', 'context59': 'car', 'coco-stuff': 'openai', 'ade20k': 'openai', 'cityscapes': 'car'}
CLIPER_L14 = {
    "voc21": (0.1, 0.5, 0.4, True, -2, 50, 336), "context60": (0.2, 0.3, 0.3, False, -2, 50, 336),
    "coco-object": (0.1, 0.5, 0.5, False, -2, 50, 336), "voc20": (0.2, 0.1, 0.0001, False, -1, 70, 336),
    "context59": (0.2, 0.45, 0.45, False, -2, 100, 336), "coco-stuff": (0.2, 0.2, 0.2, False, -2, 50, 336),
    "ade20k": (0.2, 0.2, 0.2, False, -1, 50, 336), "cityscapes": (0.35, 0.0, 0.0001, False, -1, 100, 448),
}  # fmt: skip


@pytest.mark.parametrize("dataset", list(CLIPER_B16))
def test_cliper_protocols_match_the_published_configs(dataset):
    from clipseg_sparse.datasets import class_vocabulary
    from clipseg_sparse.evaluation.protocols import PROTOCOLS
    from clipseg_sparse.segment.vocabulary import resolve_templates

    want = CLIPER_B16[dataset]
    for name, crop in (("cliper", 0), ("cliper-sliding", want["crop"]), ("cliper-nofgc", 0), ("cliper-nofgc-sliding", want["crop"])):
        protocol = PROTOCOLS.get(name)
        spec = protocol.spec_for(dataset)
        assert (spec.extra("fgc") is None) == ("nofgc" in name) and spec.extra("fgc") in (None, "45,0")
        fuse, cam = cliper.Fuse.parse(spec.extra("fuse")), cliper.Cam.parse(spec.extra("cam"))
        assert (fuse.threshold, fuse.layer, cam.score, cam.background, cam.normalize) == (want["thr"], -1, want["score"], want["bkg"], want["norm"])
        assert cliper.background_arg(spec.extra("bg")) == want["bg"]
        s = protocol.settings(dataset)
        assert (s.resolution, s.logit_scale, s.window, s.stride, s.bg_threshold, s.area_threshold) == (want["size"], want["scale"], crop, 112, 0, 0)
        assert protocol.spec_for(dataset, f"{protocol.attention}-entmax").normalizer == "entmax:1.5"
        templates = resolve_templates(protocol.templates_for(dataset))
        assert templates == (tuple(CAR_TEMPLATE.splitlines()) if want["tpl"] == "car" else resolve_templates("openai"))
    vocab, _ = class_vocabulary(dataset, "cliper")
    lead = want["bg"] if isinstance(want["bg"], int) else 0
    assert len(vocab.names[0]) == max(lead, 1) and (lead == 0 or len(vocab.flat_names) > lead)
    thr, score, bkg, norm, layer, scale, size = CLIPER_L14[dataset]
    l14 = PROTOCOLS.get("cliper-l14")
    spec = l14.spec_for(dataset)
    assert (cliper.Fuse.parse(spec.extra("fuse")), cliper.Cam.parse(spec.extra("cam"))) == (cliper.Fuse(thr, layer), cliper.Cam(score, bkg, norm))
    assert (l14.settings(dataset).logit_scale, l14.settings(dataset).resolution, l14.clip_weights()) == (scale, size, ("ViT-L-14", "openai"))
    assert resolve_templates(l14.templates_for(dataset)) == (tuple(CAR_TEMPLATE.splitlines()) if CLIPER_L14_TEMPLATES[dataset] == "car" else resolve_templates("openai"))


def test_cliper_grid_and_published_numbers():
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.evaluation.published import PUBLISHED
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get("cliper")).grid
    assert g.protocol == "cliper" and list(g.presets) == ["cliper"] and list(g.normalizers) == ["softmax", "entmax:1.5"]
    assert set(g.datasets) == set(DATASETS.names())
    for name, avg in (("cliper", 44.5), ("cliper-sliding", 45.3), ("cliper-l14", 48.1), ("cliper-l14-sliding", 48.6),
                      ("cliper-nofgc", 41.9), ("cliper-nofgc-sliding", 43.2), ("cliper-nofgc-l14", 44.0), ("cliper-nofgc-l14-sliding", 45.05)):
        row = PUBLISHED.get(name)
        assert set(row.miou) == set(DATASETS.names())
        assert row.average == pytest.approx(avg, abs=0.05) and row.clip == ("ViT-L-14:openai" if "l14" in name else "ViT-B-16:openai")


def test_eval_runs_each_datasets_constants(tiny_clip, tmp_path):
    """evaluate under the cliper-nofgc protocol on a fake VOC21: CLIPer's class files (25 background words), the
    dataset's constants, labels scored; too many background names is one line."""
    from fake_benchmarks import make_benchmark

    from clipseg_sparse.evaluation.segmentation import evaluate

    make_benchmark("voc21", tmp_path, n=1, size=(40, 56))
    record = evaluate(tiny_clip, "voc21", tmp_path, protocol="cliper-nofgc", class_names=None, progress=False, overrides={"resolution": 64},
                      cache_dir=tmp_path / "cache")  # fmt: skip
    assert record["config"]["attention"] == "qk/softmax/nores/noffn/bg:25/cam:0.7,0.6,norm/fuse:0.1"
    car = [line.strip() for line in CAR_TEMPLATE.splitlines()]
    assert record["config"]["templates"] == car  # the config's car_template.txt
    given = evaluate(tiny_clip, "voc21", tmp_path, protocol="cliper-nofgc", class_names=None, progress=False, overrides={"resolution": 64},
                     templates="single", out=tmp_path / "single.json", cache_dir=tmp_path / "cache")  # fmt: skip
    assert given["config"]["templates"] == "single"  # given templates win over the protocol's
    from clipseg_sparse.evaluation.published import PUBLISHED

    published = PUBLISHED.get("cliper-nofgc")
    assert "templates not the protocol's" in published.differences(given["config"])
    assert "templates not the protocol's" not in published.differences(record["config"])
    assert record["config"]["class_names_version"].startswith("cliper/voc21.txt@") and record["metrics"]["mIoU"] is not None
    run = window_run(tiny_clip, structured(1, (64, 64), seed=1), "cliper-nofgc/bg:3", torch.randn(3, 64), window=0)
    with pytest.raises(UserValueError, match="bg:3"):
        cliper.fused_scores(run, (64, 64))


def test_segment_cli_runs_cliper(tmp_path):
    """`segment --preset cliper-nofgc` end to end on a generated image (tiny random model): whole image and with
    windows, and with a background class named by --background and counted by bg:N."""
    from typer.testing import CliRunner

    from conftest import TINY_CONFIG
    from clipseg_sparse.cli.app import app

    (tmp_path / "img").mkdir()
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (70, 90, 3), dtype=np.uint8)).save(tmp_path / "img" / "a.png")
    base = ["segment", str(tmp_path / "img"), "--classes", "cat,dog,grass", "--model", TINY_CONFIG, "--pretrained", "none",
            "--device", "cpu", "--templates", "single", "--resolution", "64"]  # fmt: skip
    for name, extra in (("whole", ["--preset", "cliper-nofgc", "--window", "0"]), ("windows", ["--preset", "cliper-nofgc-entmax", "--window", "64", "--stride", "32"]),
                        ("bg", ["--attn", "cliper-nofgc/bg:2", "--background", "sky,wall", "--window", "0"])):  # fmt: skip
        result = CliRunner().invoke(app, [*base, *extra, "--out", str(tmp_path / name)], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        labels = np.array(Image.open(tmp_path / name / "a.png"))
        assert labels.shape == (70, 90) and labels.max() < (4 if name == "bg" else 3)
