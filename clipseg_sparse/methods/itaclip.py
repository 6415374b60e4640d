"""ITACLIP (CVPRW 2025, arXiv 2411.12044): self-self attention mixed with intermediate blocks' maps, five views
of each window, a closing of the label map.

Read from m-arda-aydn/ITACLIP@521a33c (`clip/model.py`: `VisionTransformer.forward`, `custom_attn`,
`use_saved_attn`; `itaclip_segmentor.py`: `forward_feature`, `get_flipped_logits`, `forward_slide`,
`postprocess_result`; `configs/cfg_*.py`, `configs/cls_*.txt`). In the engine's axes:

- the last block: A = 1/2 (softmax(qq) + softmax(kk)) + 1/2 mean over blocks 7, 8, 10 of (softmax(qq@L) +
  softmax(kk@L)), with `qq@L` block L's own q q^T on the hidden state entering it (CLS included); x + W_o(A V),
  residual kept, FFN dropped: eight score groups with weights 1/2, 1/2 and 1/6, `noffn`;
- `tta:LAMBDA` (the forward `views` below): each window is also encoded grayscale and Gaussian-blurred (kernel 11,
  sigma 5, on the CLIP-normalised crop), the three L2-normalised features averaged (not renormalised), and flipped
  vertically and horizontally, those maps flipped back and averaged; LAMBDA x the first + (1 - LAMBDA) x the second
  (0.75; VOC21 and Cityscapes 0.7, through the protocol);
- the refine stage `close:K`: a K x K morphological closing of the label map after the background rules
  (cv2's MORPH_CLOSE with its default border); PAMR through the settings.

Eight normalizer slots (the last block's two softmaxes and the six of blocks 7, 8, 10): `itaclip-entmax` puts
entmax:1.5 in every one. Not implemented: the LLaMA text mix ((1 - delta) x the name's embedding + delta x its
shipped definition's or synonym's, delta 0.05-0.2): the engine's prompt files (`--prompts`) average description
sentences into the template mean instead. Quirks copied, fixed and not copied: `ITACLIP_NOTES` (datasets.md,
Presets). Grid: `sweeps/grids/itaclip.toml`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..attention.presets import register_entmax_variant, register_preset
from ..attention.spec import register_option
from ..attention.terms import fmt_num
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS, Protocol
from ..evaluation.published import register_published
from ..segment.maps import CosineMap
from ..segment.plan import FORWARDS, ImageRun, Plan
from ..segment.windows import WindowsForward, iter_window_features, window_cosine_map
from ..stages import STAGES, Needs, Stage

BLOCKS = (7, 8, 10)  # model.py: selected_intermediate_layers
BLUR_KERNEL, BLUR_SIGMA = 11, 5.0  # itaclip_segmentor.py: T.GaussianBlur(kernel_size=11, sigma=5)
GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
MAIN_WEIGHT = 0.75  # img_eng_coefficient (VOC21, Cityscapes 0.7)
CLOSE = 3  # cv2.getStructuringElement(cv2.MORPH_RECT, (3, 3))
FORWARD = "views"


# -- the five views --------------------------------------------------------------------------------------------------
def grayscale(x: torch.Tensor) -> torch.Tensor:
    """B x 3 x H x W -> its luma (torchvision's weights) in all three channels (T.Grayscale, then expanded)."""
    luma = GRAY[0] * x[:, 0] + GRAY[1] * x[:, 1] + GRAY[2] * x[:, 2]
    return luma[:, None].expand(-1, 3, -1, -1)


def gaussian_blur(x: torch.Tensor, kernel: int = BLUR_KERNEL, sigma: float = BLUR_SIGMA) -> torch.Tensor:
    """torchvision's gaussian_blur of B x C x H x W: the 2-D outer product of the normalised 1-D Gaussian on
    linspace(-(k - 1) / 2, (k - 1) / 2, k), reflect padding k // 2."""
    half = (kernel - 1) * 0.5
    pdf = torch.exp(-0.5 * (torch.linspace(-half, half, kernel, device=x.device) / sigma).pow(2))
    k1 = pdf / pdf.sum()
    weight = (k1[:, None] @ k1[None, :]).to(x.dtype).expand(x.shape[1], 1, kernel, kernel)
    return F.conv2d(F.pad(x, [kernel // 2] * 4, mode="reflect"), weight, groups=x.shape[1])


def view_features(encode, crops: torch.Tensor, main: float) -> torch.Tensor:
    """B x h x w x D features of the five views of B crops (`encode`: B' x 3 x H x W -> B' x h x w x D,
    L2-normalised): main x mean(original, grayscale, blurred) + (1 - main) x mean(vertical flip, horizontal flip,
    each flipped back on the patch grid)."""
    B = crops.shape[0]
    f = encode(torch.cat([crops, grayscale(crops), gaussian_blur(crops), crops.flip(-2), crops.flip(-1)]))
    plain, gray, blur, vflip, hflip = f.split(B)
    flips = (vflip.flip(1) + hflip.flip(2)) / 2
    return main * (plain + gray + blur) / 3 + (1 - main) * flips


def _tta_arg(arg: str) -> float:
    try:
        value = float(arg)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise UserValueError(f"bad option tta:{arg}: write tta:LAMBDA, 0 <= LAMBDA <= 1 (the weight of the three unflipped views)")
    return value


register_option(
    "tta",
    lambda arg: fmt_num(_tta_arg(arg)),
    help="tta:LAMBDA (ITACLIP: each window also encoded grayscale, blurred and flipped; LAMBDA x mean(original, gray, blur) + "
    "(1 - LAMBDA) x mean(flips, flipped back); the views forward: encode_dense and attention_maps give the original view)",
    needs=lambda arg: Needs(forward=((FORWARD, f"tta:{arg}"),)),
)


class ViewsForward(WindowsForward):
    """ITACLIP's forward (`tta:LAMBDA`): each window through CLIP as five views, their features mixed (see
    `view_features`); the windows' maps averaged as usual. Its attention (analyze, explain) is the original view's."""

    name = FORWARD
    kinds = frozenset({"token", "windows", "retrieval"})

    def check(self, plan: Plan) -> None:
        needs = plan.needs
        if needs.regions or needs.image_features:
            raise UserValueError(f"spec {plan.spec}: tta:LAMBDA flips its views, and region maps and whole-image features would have to be flipped with them")

    def cosine(self, run: ImageRun) -> CosineMap:
        return views_cosine(run, run.out_size)


def views_cosine(run: ImageRun, out_size: tuple[int, int] | None = None) -> CosineMap:
    """The views forward's N_names x H x W cosine map (at `out_size`, default the network input's): each batch of
    windows through `view_features`, the settings' token stages inside each view."""
    clip = run.clip
    main = _tta_arg(run.spec.extra("tta"))
    hooks = run.plan.added_token_stages()
    text = run.text.to(clip.device)

    def encode(crops, spec, pos_interp, regions, context):
        return view_features(lambda x: clip.encode_dense(x, spec, hooks, pos_interp=pos_interp, context=context), crops, main)

    boxes, cos = [], []
    for chunk, feats in iter_window_features(run, encode=encode):
        boxes += chunk
        cos.append(torch.einsum("bhwd,nd->bhwn", feats, text))
    return window_cosine_map(run, boxes, torch.cat(cos), out_size)


FORWARDS.register(FORWARD, ViewsForward(), help="ITACLIP: each window as five views (original, grayscale, blurred, two flips), features mixed (tta:LAMBDA)")


# -- the closing of the label map --------------------------------------------------------------------------------------
def close_labels(labels: torch.Tensor, size: int = CLOSE) -> torch.Tensor:
    """H x W integer labels -> their size x size grayscale closing (max filter, then min filter), pixels outside
    the image ignored (cv2.morphologyEx MORPH_CLOSE with a rectangle and the default border)."""
    pad = size // 2
    x = labels[None, None].double()
    dilated = F.max_pool2d(F.pad(x, [pad] * 4, value=-math.inf), size, stride=1)
    closed = -F.max_pool2d(F.pad(-dilated, [pad] * 4, value=-math.inf), size, stride=1)
    return closed[0, 0].to(labels.dtype)


def _close_stage(args: str) -> Stage:
    if args and not (args.isdigit() and int(args) % 2 == 1):
        raise UserValueError(f"bad stage 'close:{args}': close[:K] takes an odd window side K (ITACLIP's 3)")
    size = int(args) if args else CLOSE
    return Stage("refine", f"close:{size}", lambda labels, maps, run: close_labels(labels, size))


STAGES.register(
    "close",
    _close_stage,
    help="refine: ITACLIP's morphological closing of the label map, a K x K max then min filter (default 3, cv2's MORPH_CLOSE)",
)


# -- presets and protocol -------------------------------------------------------------------------------------------
def _attention(main: float) -> str:
    side = "+".join(f"{fmt_num(1 / (2 * len(BLOCKS)))}*{pair}@{block}" for block in BLOCKS for pair in ("qq", "kk"))
    return f"0.5*qq+0.5*kk+{side}/softmax/noffn/tta:{fmt_num(main)}"


ITACLIP = _attention(MAIN_WEIGHT)
ITACLIP_NOTES = (
    "copied: blocks 1..11 as they are; at blocks 7, 8, 10 softmax(s q q^T) + softmax(s k k^T) of the block's own ln_1 "
    "input, CLS included, averaged over the three blocks; the last block's A = (softmax(qq) + softmax(kk)) / 2 + that "
    "mean / 2 (rows sum to 2), x + W_o(A V), residual kept, FFN dropped, ln_post and proj on every token; five views "
    "per window: the original, grayscale (torchvision's luma weights) and Gaussian-blurred (kernel 11, sigma 5, reflect "
    "padding) CLIP-normalised crops, their L2-normalised features averaged without renormalising, and the vertical "
    "and horizontal flips, their maps flipped back and averaged; lambda x the first + (1 - lambda) x the second "
    "(0.75; VOC21, Cityscapes 0.7); 224 windows at stride 28; PAMR (10 steps, dilations 8, 16) on the logits at the "
    "original size; after prob_thd a 3 x 3 morphological closing of the labels; "
    "fixed: the flips flipped back on the patch grid before upsampling (the code flips the upsampled logits: the "
    "same where the window is whole patches, as its 224 windows are); "
    "not copied: the LLaMA text mix ((1 - delta) name + delta definition / synonym embedding, delta 0.05-0.2, "
    "background words unmixed; not implemented), fp16, the uint8 cast of the labels before the closing"
)
register_preset(
    "itaclip",
    ITACLIP,
    "ITACLIP (CVPRW 2025), ViT-B/16: (softmax(qq) + softmax(kk)) / 2 + the mean self-self maps of blocks 7, 8, 10 / 2, "
    "residual kept, FFN dropped; five views per window (tta:0.75)",
    ITACLIP_NOTES,
)
register_entmax_variant("itaclip")

# configs/cfg_{voc21,context60,coco_object,coco_stuff164k,cityscapes}.py (the segmentor refuses other datasets): short
# side 336 (COCO-Stuff 448, Cityscapes 560), 224 windows at stride 28, PAMR 10 steps, logit scale VOC21 60, Context60
# 55, COCO-Object 50, else 40; prob_thd 0.1 with background; VOC21 area_thd 0.1; its own class files. VOC20, Context59
# and ADE20K have no config: the other sets' defaults (336, lambda 0.75, logit scale 40), not published.
PROTOCOL = PROTOCOLS.register(
    "itaclip",
    Protocol(
        name="itaclip",
        attention="itaclip",
        class_names="itaclip",
        source="m-arda-aydn/ITACLIP@521a33c configs/cfg_*.py, configs/cls_*.txt, itaclip_segmentor.py",
        defaults=dict(resolution=336, window=224, stride=28, logit_scale=40.0, pamr=True, stages=(f"close:{CLOSE}",),
                      resize="opencv", pos_interp="scale", remainder="drop"),
        per_dataset={
            "voc21": dict(logit_scale=60.0, bg_threshold=0.1, area_threshold=0.1),
            "context60": dict(logit_scale=55.0, bg_threshold=0.1),
            "coco-object": dict(logit_scale=50.0, bg_threshold=0.1),
            "coco-stuff": dict(resolution=448),
            "cityscapes": dict(resolution=560),
        },
        attention_per_dataset={"voc21": _attention(0.7), "cityscapes": _attention(0.7)},
    ),
    help="ITACLIP (CVPRW 2025): short side 336 (COCO-Stuff 448, Cityscapes 560), 224 windows at stride 28, PAMR, a 3 x 3 "
    "closing of the labels, its class files; VOC20, Context59, ADE20K unpublished (defaults)",
)

# Reported mIoU, OpenAI CLIP ViT-B/16, the five sets the repository has configs for (the README's table). Not
# measured here.
register_published(
    PROTOCOL,
    {"voc21": 67.9, "context60": 37.5, "coco-object": 37.7, "coco-stuff": 27.0, "cityscapes": 40.2},
    "m-arda-aydn/ITACLIP@521a33c README.md (Results, the default configurations)",
    note="five benchmarks only: the repository has no VOC20, Context59 or ADE20K config; its LLaMA text mix is not implemented here",
)  # fmt: skip
