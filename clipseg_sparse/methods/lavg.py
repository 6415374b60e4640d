"""LaVG (Kang & Cho, ECCV 2024): Panoptic-Cut masks from DINO, then SCLIP's features pooled per mask.

Read from dahyun-kang/lavg@2db88e5 (`panoptic_cut/panoptic_cut.py`: `get_affinity_matrix`,
`second_smallest_eigenvector`, `get_salient_areas`, `check_num_fg_corners`, `panoptic_cut_forward`,
`panoptic_cut`; `panoptic_cut/utils.py` `detect_box`; `panoptic_cut/dino.py` `ViTFeat`; `panoptic_cut/predict.py`;
`panoptic_cut/crf.py` `densecrf_postprocess`; `clip_segmentor.py`: `forward_feature`, `forward_slide`, `predict`;
`clip/model.py` `custom_attn`; `configs/cfg_*.py`, `cls_*.txt`). In the engine's axes:

- the masks are a region source, `--regions ncut` (`NCutRegions`, registered in `REGION_SOURCES`): the image
  resized to 640 x 640 (PIL Lanczos), the keys of DINO ViT-B/8's last block (heads concatenated, patches only),
  a binary cosine graph (> 0.3, others 1e-5), the generalised Fiedler vector (`torch.lobpcg`), split at its
  mean, reversed when 3 or more corners fall on the foreground or the peak does not, the seed's 4-connected
  component, repeated on the patches no mask holds, up to 8 masks (early stop at 5 free patches); each mask
  nearest to 640, then PIL-resized to the image and cut at half its maximum (`densecrf_postprocess`); pixels no
  mask covers are the region -1 (LaVG's last, "background" mask);
- the pooling is the spec option `pool:B`, which runs the forward `pooled` below: SCLIP's windows
  (`qq+kk/softmax`), each window's cosine upsampled bilinearly to the window, every region of the window (the
  unsegmented pixels one more) replaced by its mean there (= the mean feature's cosine with the text: both
  steps are linear), windows averaged, resized to the image. B > 0 is LaVG's VOC21 rule (`remove_falsefg`): in
  the unsegmented pixels every name after the first B (the background class's) is set to the window's minimum.

One normalizer slot (SCLIP's): `lavg-entmax` puts entmax:1.5 there. Quirks copied, fixed and not copied:
`LAVG_NOTES` (docs/datasets.md, Presets). Grid: `sweeps/grids/lavg.toml`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import register_option
from ..attention.presets import register_entmax_variant, register_preset
from ..errors import UserValueError
from ..evaluation.protocols import PROTOCOLS
from ..evaluation.published import register_published
from ..models.backbones import Backbone, load_backbone
from ..segment.maps import CosineMap, resize_matrix, resized_cosine
from ..segment.plan import FORWARDS
from ..segment.preprocess import window_geometry
from ..segment.regions import REGION_SOURCES, CachedRegions
from ..segment.windows import WindowsForward, iter_window_features
from ..stages import Needs
from . import sclip

NCUT_SIZE, NCUT_TAU, NCUT_MASKS, NCUT_EPS = 640, 0.3, 8, 1e-5  # predict.py --imgsize, --tau, --N; get_affinity_matrix
NCUT_BACKBONE = "dino_vitb8"
VOC21_BACKGROUND_NAMES = 26  # configs/cls_voc21.txt: the background line's names (`query_idx.index(1)`)


# -- Panoptic Cut -----------------------------------------------------------------------------------------------
def fiedler_vector(feats: torch.Tensor, tau: float = NCUT_TAU, seed: int = 0) -> torch.Tensor:
    """The second-smallest generalised eigenvector of (D - A) y = l D y, A the cosine graph of the C x M
    features thresholded at `tau` (1 above, 1e-5 below), by `torch.lobpcg` as published, its random start drawn
    from a generator seeded with `seed` (the published start is unseeded)."""
    f = F.normalize(feats, dim=0)
    a = ((f.T @ f) > tau).to(f.dtype)
    a[a == 0] = NCUT_EPS
    d = torch.diag(a.sum(1))
    start = torch.randn(a.shape[0], 2, generator=torch.Generator().manual_seed(seed), dtype=f.dtype).to(f.device)
    return torch.lobpcg(A=d - a, B=d, X=start, largest=False)[1][:, 1]


def ncut_masks(feats: torch.Tensor, grid: tuple[int, int], tau: float = NCUT_TAU, count: int = NCUT_MASKS) -> list[torch.Tensor]:
    """Panoptic Cut on C x (h*w) patch features: up to `count` disjoint boolean h x w masks (see the module docstring)."""
    from scipy import ndimage

    free = torch.ones(grid[0] * grid[1], dtype=torch.bool, device=feats.device)
    masks = []
    for _ in range(count):
        vec_free = fiedler_vector(feats[:, free], tau)
        part_free = vec_free > vec_free.mean()
        part = torch.zeros_like(free)
        part[free] = part_free
        vec = torch.full_like(free, float(vec_free.abs().min()), dtype=vec_free.dtype)
        vec[free] = vec_free
        corners = part.view(grid)[[0, 0, -1, -1], [0, -1, 0, -1]].sum()
        if bool(corners >= 3) or not bool(part[vec.abs().argmax()]):
            vec, part = -vec, torch.zeros_like(free)
            part[free] = ~part_free
        labelled, _ = ndimage.label(part.view(grid).cpu().numpy())
        component = labelled.reshape(-1)[int(vec.argmax())]
        mask = torch.from_numpy(labelled == component).to(free.device)
        masks.append(mask)
        free &= ~mask.view(-1)
        if int(free.sum()) <= 5:
            break
    return masks


class NCutRegions(CachedRegions):
    """LaVG's Panoptic-Cut masks (DINO ViT-B/8 keys at 640 x 640), cached per image; `backbone`: a loaded one
    (tests: a small random one), else `dino_vitb8` is loaded with `checkpoint` on first use."""

    def __init__(self, cache_dir: str | Path, checkpoint: str = "hub", device: str = "cpu", backbone: Backbone | None = None,
                 size: int = NCUT_SIZE, tau: float = NCUT_TAU, count: int = NCUT_MASKS) -> None:  # fmt: skip
        super().__init__(cache_dir, checkpoint, device)
        self._backbone, self.size, self.tau, self.count = backbone, size, tau, count

    def source(self) -> str:
        return f"ncut:{NCUT_BACKBONE}:{self.checkpoint}:size={self.size},tau={self.tau:g},masks={self.count}"

    def settings(self) -> str:
        return self.source()

    def patch_masks(self, image: np.ndarray) -> list[torch.Tensor]:
        """The boolean masks on the DINO patch grid of the image resized to size x size."""
        from PIL import Image

        if self._backbone is None:
            self._backbone = load_backbone(NCUT_BACKBONE, self.checkpoint, self.device)
        b = self._backbone
        resized = np.asarray(Image.fromarray(image).resize((self.size, self.size), Image.LANCZOS), dtype=np.float32) / 255.0
        view = lambda t: torch.tensor(t).view(1, 3, 1, 1)  # noqa: E731
        pixels = (torch.from_numpy(resized).permute(2, 0, 1)[None] - view(b.info.mean)) / view(b.info.std)
        out = b.features(pixels, want=("qkv",))
        keys = out.k[0].transpose(0, 1).reshape(out.k.shape[2], -1).T.float()  # C x h*w, heads concatenated
        return ncut_masks(keys, out.grid, self.tau, self.count)

    def masks(self, image: np.ndarray) -> list[np.ndarray]:
        from PIL import Image

        H, W = image.shape[:2]
        out = []
        for m in self.patch_masks(image):
            big = F.interpolate(m[None, None].float(), size=(self.size, self.size), mode="nearest")[0, 0]
            small = np.asarray(Image.fromarray(np.uint8(big.cpu().numpy() * 255)).resize((W, H)))
            out.append(small > small.max() / 2.0)
        taken = np.zeros((H, W), dtype=bool)
        for m in out:  # painted in reverse, so an earlier mask wins an overlap (forward_feature)
            m &= ~taken
            taken |= m
        return out


def _ncut_source(cache_dir: Path, device: str) -> NCutRegions:
    return NCutRegions(cache_dir / "regions-ncut", device=device)


REGION_SOURCES.register(
    "ncut", _ncut_source, help=f"LaVG's Panoptic-Cut masks: Normalized Cut on DINO ViT-B/8 keys at {NCUT_SIZE}x{NCUT_SIZE}, up to {NCUT_MASKS} (no CRF)"
)


# -- region pooling -----------------------------------------------------------------------------------------------
def _pool_arg(arg: str) -> int:
    if not arg.isdigit():
        raise UserValueError(f"option pool:{arg}: write pool:B, B >= 0 the number of leading (background) names kept in unsegmented pixels (LaVG's VOC21: 26)")
    return int(arg)


def pool_window(cos: torch.Tensor, regions: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """N x h x w window cosine -> each region's mean (ids < 0: one more region, LaVG's background mask); keep > 0:
    in that region the names after the first `keep` are set to the map's minimum (`remove_falsefg`)."""
    n = cos.shape[0]
    ids = (regions.clamp(min=-1) + 1).reshape(-1)
    sums = cos.new_zeros(int(ids.max()) + 1, n).index_add_(0, ids, cos.reshape(n, -1).T)
    counts = torch.bincount(ids, minlength=sums.shape[0]).clamp(min=1).to(cos.dtype)
    pooled = (sums / counts[:, None])[ids].T.reshape(cos.shape)
    if keep:
        pooled[keep:, regions < 0] = pooled.min()
    return pooled


class PooledForward(WindowsForward):
    """LaVG's `forward_slide`: SCLIP's windows, each window's cosine upsampled to its pixels and pooled per
    region (`pool_window`), the windows averaged, then resized bilinearly (one N x H' x W' map per image)."""

    name = "pooled"
    kinds = frozenset({"token"})

    def cosine(self, run) -> CosineMap:
        s, clip = run.settings, run.clip
        keep = _pool_arg(run.spec.extra("pool"))
        _, _, H, W = run.pixels.shape
        text = run.text.to(clip.device)
        regions = run.regions.to(clip.device)
        total = torch.zeros(text.shape[0], H, W, device=clip.device)
        count = torch.zeros(1, H, W, device=clip.device)
        for chunk, feats in iter_window_features(run):
            for (y1, y2, x1, x2), f in zip(chunk, feats):
                (h, w, _), (_, top, _, up_h), (_, left, _, up_w) = f.shape, *(
                    window_geometry(side, clip.patch_size, s.remainder, not s.window) for side in (y2 - y1, x2 - x1)
                )
                ly = resize_matrix(h, up_h)[top : top + y2 - y1].to(f)
                lx = resize_matrix(w, up_w)[left : left + x2 - x1].to(f)
                cos = torch.einsum("yh,hwn,xw->nyx", ly, torch.einsum("hwd,nd->hwn", f, text), lx)
                total[:, y1:y2, x1:x2] += pool_window(cos, regions[y1:y2, x1:x2], keep)
                count[:, y1:y2, x1:x2] += 1
        return resized_cosine(total / count, run.out_size)


FORWARDS.register("pooled", PooledForward(), help="LaVG: sliding windows, each window's upsampled cosine pooled per region (pool:B)")
register_option(
    "pool",
    lambda arg: str(_pool_arg(arg)),
    help="pool:B (LaVG: each window's upsampled cosine replaced by its region means, unsegmented pixels one more "
    "region; B > 0: there, every name after the first B set to the window's minimum; needs --regions)",
    needs=lambda arg: Needs(regions=f"pool:{arg}", forward=(("pooled", f"pool:{arg}"),)),
)


# -- presets and protocol ---------------------------------------------------------------------------------------
LAVG = "qq+kk/softmax/pool:0"
LAVG_NOTES = (
    "copied: Panoptic Cut as panoptic_cut.py runs it (640 x 640 Lanczos, DINO ViT-B/8 last-block keys, cos > 0.3 "
    "else 1e-5, lobpcg's Fiedler vector split at its mean, reversed on >= 3 foreground corners or a background peak, "
    "the seed's 4-connected component, masks on free patches only, N = 8, early stop at <= 5 free patches), each "
    "mask resized to the image by PIL and cut at half its maximum; SCLIP's last block (qq + kk, residual and FFN "
    "kept); per window the cosine upsampled bilinearly to the window and each mask's pixels given the mask's mean "
    "(the mean feature is not re-normalised), the unsegmented pixels pooled as one more mask (the shipped files' "
    "last mask), an earlier mask winning an overlap; VOC21 only: in the unsegmented pixels every non-background name "
    "set to the window's minimum; SCLIP's configs (65 / 50 logit scales, prob_thd 0.1, area_thd 0.1 on VOC21); "
    "fixed: lobpcg's random start seeded per cut (the code's is unseeded, so its masks vary run to run); "
    "not copied: the dense CRF, hole filling and IoU < 0.5 rejection of predict.py (pydensecrf), so masks "
    "follow the patch grid; the published masks overlap after the CRF, a region map cannot (an overlap goes "
    "to the earlier mask and leaves the later one's mean); fp16 on GPU (choose --precision)"
)
register_preset(
    "lavg",
    LAVG,
    "LaVG (ECCV 2024), ViT-B/16: SCLIP's features pooled over Panoptic-Cut masks from DINO ViT-B/8 "
    "(--regions ncut), per window",
    LAVG_NOTES,
)
register_entmax_variant("lavg")

# configs/cfg_*.py: SCLIP's settings and class files (identical files), the masks from panoptic_cut/predict.py,
# VOC21 with the background rule (`remove_falsefg = 'voc21' in name_path`).
PROTOCOL = PROTOCOLS.register(
    "lavg",
    dataclasses.replace(
        sclip.PROTOCOL,
        name="lavg",
        attention="lavg",
        source="dahyun-kang/lavg@2db88e5 configs/cfg_*.py, clip_segmentor.py, panoptic_cut/",
        attention_per_dataset={"voc21": f"qq+kk/softmax/pool:{VOC21_BACKGROUND_NAMES}"},
    ),
    help="LaVG (ECCV 2024): SCLIP's settings, VOC21's background rule; needs --regions (ncut: Panoptic Cut)",
)

# The repository's README table (OpenAI B/16, the masks it ships). Not measured here.
register_published(
    PROTOCOL,
    {"voc21": 62.1, "context60": 31.6, "coco-object": 34.2, "voc20": 82.5, "context59": 34.7, "coco-stuff": 23.2,
     "cityscapes": 26.2, "ade20k": 15.8},
    "dahyun-kang/lavg@2db88e5 README.md, Quantitative performance",
    printed_average=38.8,
    note="the README prints no average; 38.8 as ActiveSAM's, GLA-CLIP's and PEARL's Table 1 print it",
)  # fmt: skip
