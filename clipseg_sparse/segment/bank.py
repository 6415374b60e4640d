"""An image bank for region retrieval (CorrCLIPv2, zdk258/CorrCLIP@103bc18 CorrCLIPv2/memory_bank_builder and
corrclip_segmentor.py `_faiss_search` / `get_support_clip_logits`).

A bank is a folder built once from unlabeled images (`build_bank`, `clipseg-sparse bank build`): for every
region of every image (region maps from any region source, the unsegmented pixels left out) one **key**, the
region mean of a dense backbone's whole-image features (`Backbone.image_features` at the image's own size),
and one **value** per CLIP named, the L2-normalised region mean of that CLIP's dense pixel features (the
windows' unnormalised projected features, averaged and resized bilinearly to the image's size, as the
published `generate_clip_embeddings.py`). Layout:

    BANK/manifest.json   models, weights tags and settings of keys and values, row count, images skipped as
                         unreadable, a stamp (size, modification time, digest) of every file below and every
                         part, and the content hash of all that (opening a bank checks both: a file replaced
                         or a manifest edited since the build is refused by name)
    BANK/keys.npy        rows x C float16 (raw region means, as the published store)
    BANK/values-I.npy    rows x D float16, one per CLIP (row r of every store is the same region)
    BANK/rows.npy        rows x 2 int64: (image index in the manifest's list, region id)
    BANK/index.faiss     inner-product index over the L2-normalised keys; row ids are store rows
    BANK/parts/          one .npz per image while building (written atomically; a kill loses at most the
                         image in flight), merged into the files above at the end; a re-run redoes the
                         merge when a file does not match the manifest, and the images whose part does not
                         match its stamp

The stores are opened memory-mapped (`np.load(mmap_mode="r")`, nothing loaded into RAM); retrieval reads only
the rows it needs, with pread (`read_rows`), so the process's resident set does not grow with the store.
Index: flat inner product below `FLAT_BELOW` rows, else the published IVF-PQ (nlist = 8 sqrt(N), m 32, 8 bits,
nprobe min(256, nlist)). Retrieval (`region_support`, `retrieval_logits`): per region of the image's map (each
value, the unsegmented one too) q = L2(region mean of the whole-image features at the network input, reduced by
region index from the raw map: `resized_region_means`), the k nearest keys by inner product, support = L2(mean
of their stored values), logits = support . text, painted on the region by gather; with more stores than one
(the published DFN auxiliary CLIP), each store's logits with its own CLIP's text, averaged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserValueError
from ..runtime.atomic import atomic_path, write_json_atomic
from ..runtime.fingerprint import file_stamp, stamp_matches
from .plan import ImageRun, Plan
from .maps import CosineMap
from .preprocess import input_regions
from .windows import dense_cosine

BANK_FORMAT = 2  # 2: file stamps in the manifest, its hash over them
MANIFEST = "manifest.json"
KEYS = "keys.npy"
ROWS = "rows.npy"
INDEX = "index.faiss"
PARTS = "parts"
#: the published index (generate_vfm_embeddings.py): IVF-PQ, nlist = 8 sqrt(N), m = 32 sub-quantizers of 8 bits
IVFPQ_M, IVFPQ_NBITS, NLIST_FACTOR, NPROBE_MAX = 32, 8, 8, 256
#: below this many rows the index is exact (flat inner product); the published code also keeps small banks flat
FLAT_BELOW = 20_000
INDEX_KINDS = ("auto", "flat", "ivfpq")
NUM_SUPPORT = 20  # published num_support
SUPPORT_WEIGHT = 0.5  # published alpha: logits = alpha * own + (1 - alpha) * support
#: the published memory_bank_builder's values: mmcv's Resize (cv2 on the uint8 image) to short side 448, 336 / 112
#: windows, positional embeddings by (n + 0.1) / native (its open_clip fork); `bank build`'s defaults
BUILDER_SETTINGS = {"resolution": 448, "window": 336, "stride": 112, "resize": "opencv", "pos_interp": "scale"}


class BankError(UserValueError):
    """A bank that is missing, unfinished, or built with other models or settings than asked for."""


def values_file(i: int) -> str:
    return f"values-{i}.npy"


def clip_id(clip) -> str:
    """`MODEL:WEIGHTS` naming a loaded DenseCLIP in a bank's manifest."""
    return f"{clip.model_name}:{clip.pretrained}"


def content_hash(manifest: dict) -> str:
    """The first 16 hex digits of the SHA-256 of the manifest's fields, the stores' sizes and digests among
    them; not of the stamps' times (a copied bank keeps its hash) nor of the parts' stamps (a part's .npz
    holds the time it was written, so a resumed build would hash otherwise than an uninterrupted one)."""
    fields = {k: v for k, v in manifest.items() if k not in ("hash", "parts")}
    fields["files"] = {name: {k: v for k, v in stamp.items() if k != "mtime_ns"} for name, stamp in (manifest.get("files") or {}).items()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def mismatch(path: Path, manifest: dict) -> str | None:
    """Why a bank's files do not match its manifest (one line naming the file), or None."""
    if manifest.get("hash") != content_hash(manifest):
        return f"{path / MANIFEST}: its fields do not match its content hash (edited since the build)"
    for name, stamp in manifest["files"].items():
        if not stamp_matches(path / name, stamp):
            return f"{path / name}: does not match the bank's manifest (replaced or changed since the build)"
    return None


def _faiss():
    import faiss  # faiss-cpu, a core dependency; imported on first use (it is slow to import)

    return faiss


# -- index --------------------------------------------------------------------------------------------
def normalized_keys(keys: np.ndarray) -> np.ndarray:
    """float32 rows divided by their norm + 1e-12 (the published normalisation before the index)."""
    k = np.asarray(keys, dtype=np.float32)
    return np.ascontiguousarray(k / (np.linalg.norm(k, axis=1, keepdims=True) + 1e-12))


def build_index(keys: np.ndarray, kind: str = "auto", seed: int = 0):
    """A FAISS inner-product index over the L2-normalised keys, ids = row numbers. kind: flat, ivfpq (the
    published IndexIVFPQ(IndexFlatIP(C), C, 8 sqrt(N), 32, 8) in an IndexIDMap2) or auto (flat below FLAT_BELOW)."""
    faiss = _faiss()
    if kind not in INDEX_KINDS:
        raise BankError(f"index kind must be one of {', '.join(INDEX_KINDS)} (got {kind!r})")
    vecs = normalized_keys(keys)
    n, dim = vecs.shape
    if kind == "flat" or (kind == "auto" and n < FLAT_BELOW):
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    else:
        if dim % IVFPQ_M:
            raise BankError(f"IVF-PQ needs a key width divisible by {IVFPQ_M} (got {dim}); use --index flat")
        nlist = max(1, int(NLIST_FACTOR * math.sqrt(n)))
        if n < max(nlist, 1 << IVFPQ_NBITS):
            raise BankError(f"IVF-PQ needs at least {max(nlist, 1 << IVFPQ_NBITS)} regions to train (the bank has {n}); use --index flat")
        ivf = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, IVFPQ_M, IVFPQ_NBITS)
        ivf.cp.seed = seed
        ivf.train(vecs)
        index = faiss.IndexIDMap2(ivf)
    index.add_with_ids(vecs, np.arange(n, dtype=np.int64))
    return index


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(inner products, store rows) of the k nearest keys of each query row; -1 where fewer exist
    (`_faiss_search`: nprobe min(256, nlist) for IVF indexes)."""
    faiss = _faiss()
    inner = faiss.downcast_index(index.index) if hasattr(index, "index") else index
    if hasattr(inner, "nprobe"):
        inner.nprobe = min(NPROBE_MAX, inner.nlist)
    return index.search(np.ascontiguousarray(queries, dtype=np.float32), k)


# -- the bank -----------------------------------------------------------------------------------------
@dataclass
class ImageBank:
    """An opened bank: manifest, memory-mapped stores and the index (see the module docstring)."""

    path: Path
    manifest: dict
    keys: np.ndarray
    values: dict[str, np.ndarray]
    index: object = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> "ImageBank":
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            hint = " (an unfinished build: run `bank build` again to finish it)" if (path / PARTS).is_dir() else ""
            raise BankError(f"{path}: not an image bank, no {MANIFEST}{hint}")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # torn, not UTF-8, not JSON
            raise BankError(f"{manifest_path}: not a readable bank manifest ({type(e).__name__}: {e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != BANK_FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            older = f"; run `bank build` again with --out {path} to update it" if isinstance(found, int) and found < BANK_FORMAT else ""
            raise BankError(f"{path}: bank format {found!r}, this version reads {BANK_FORMAT}{older}")
        problem = mismatch(path, manifest)
        if problem:
            raise BankError(f"{problem}; run `bank build` again with --out {path} to rebuild it")
        try:
            keys = np.load(path / KEYS, mmap_mode="r")
            values = {store["clip"]: np.load(path / values_file(i), mmap_mode="r") for i, store in enumerate(manifest["values"])}
            index = _faiss().read_index(str(path / INDEX))
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # a missing or torn array or index
            raise BankError(f"{path}: a bank file cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        return cls(path, manifest, keys, values, index)

    @property
    def content_hash(self) -> str:
        return self.manifest["hash"]

    @property
    def proxy(self) -> str:
        """The backbone whose whole-image features are the keys (and must make the queries)."""
        return self.manifest["keys"]["backbone"]

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])

    def record(self) -> dict:
        """What names this bank in a result file: its content hash, key backbone and value CLIPs."""
        return {"hash": self.content_hash, "keys": self.manifest["keys"]["backbone"], "values": [s["clip"] for s in self.manifest["values"]]}

    def check(self, clip, proxy: dict) -> None:
        """BankError unless the values hold `clip`'s store and the keys came from the backbone, weights and
        precision of `proxy` (`ProxyBackbones.config` of the key backbone)."""
        stores = [s["clip"] for s in self.manifest["values"]]
        if clip_id(clip) not in stores:
            raise BankError(f"{self.path}: bank values were built with {', '.join(stores)}, not {clip_id(clip)}; build a bank with this model")
        built = self.manifest["keys"]
        for what in ("timm", "weights"):
            if built.get(what) != proxy.get(what):
                raise BankError(f"{self.path}: bank keys were built with {built['backbone']} {what} {built.get(what)!r}, not {proxy.get(what)!r}")

    def unpublished(self) -> str | None:
        """A note naming the stores whose values were not made the published builder's way (resize and
        positional rule of BUILDER_SETTINGS: banks of an older `bank build`), or None."""
        rules = ("resize", "pos_interp")
        other = [s for s in self.manifest["values"] if any(s["settings"].get(r) != BUILDER_SETTINGS[r] for r in rules)]
        if not other:
            return None
        built = ", ".join(f"{s['clip']} (resize {s['settings'].get('resize')}, positions {s['settings'].get('pos_interp')})" for s in other)
        return (f"bank {self.path}: values of {built} were not built with the published builder's settings (resize opencv, "
                "positions scale); an older `bank build` default: rebuild the bank for the published values")

    def region_support(self, regions: torch.Tensor, features: torch.Tensor, texts: dict[str, torch.Tensor], k: int = NUM_SUPPORT) -> tuple[torch.Tensor, torch.Tensor]:
        """`region_support` of this bank."""
        return region_support(regions, features, self, texts, k)

    def support(self, store: str, rows: np.ndarray) -> torch.Tensor:
        """R x D: L2(mean of the stored values of each row set) (rows: R x k store rows, -1 ignored); a
        region without any neighbour gets a zero vector (the published code would give NaN)."""
        values = self.values[store]
        out = np.zeros((len(rows), values.shape[1]), dtype=np.float32)
        for r, ids in enumerate(rows):
            ids = ids[ids >= 0]
            if len(ids):
                out[r] = read_rows(values, np.sort(ids)).astype(np.float32).mean(0)
        return F.normalize(torch.from_numpy(out), dim=-1)


def read_rows(array: np.memmap, rows: np.ndarray) -> np.ndarray:
    """Rows of a memory-mapped 2-D store read from its file with pread, not through the mapping: touching the
    mapping would also map the neighbouring pages the kernel keeps cached (fault-around), so the resident set
    grew to the whole store after a few images; read this way it does not grow with the store."""
    width = array.shape[1] * array.itemsize
    fd = os.open(array.filename, os.O_RDONLY)
    try:
        data = b"".join(os.pread(fd, width, array.offset + int(r) * width) for r in rows)
    finally:
        os.close(fd)
    return np.frombuffer(data, dtype=array.dtype).reshape(len(rows), array.shape[1])


def _linear_taps(src: int, dst: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first source index, its weight, the next index's weight), float64, per output position of 1-D linear
    resizing (align_corners False, torch's own weights): the next index is first + 1, weight 0 where the edge
    clamps (a zero-padded cell)."""
    from .maps import resize_matrix

    m = F.pad(resize_matrix(src, dst).double(), (0, 1))  # dst x (src + 1)
    first = (m > 0).to(torch.uint8).argmax(1)
    at = torch.arange(dst)
    return first, m[at, first], m[at, first + 1]


def resized_region_means(features: torch.Tensor, inverse: torch.Tensor, count: int) -> torch.Tensor:
    """count x C float64: per region the mean of the C x h x w map resized bilinearly (align_corners False) to
    inverse's H x W and L2-normalised per pixel (F.normalize), without the C x H x W map. inverse: H x W region
    index in [0, count), -1 left out.

    Why: the resized map is C x H x W (616 MB at 1024-d and 336 x 448); one pass over it takes longer than the
    search. A resized pixel is sum_ab ay_a bx_b f[i + a, j + b] over 2 x 2 source cells, so its squared norm
    comes from the cells' Gram entries with their neighbours (resized along y, then gathered along x), and the
    region mean is f @ M with M[cell, region] = sum over the region's pixels of ay_a bx_b / norm."""
    C, h, w = features.shape
    H, W = inverse.shape
    f = F.pad(features.detach().double().cpu(), (0, 2, 0, 2))  # (h + 2) x (w + 2) cells: i + 1, j + 1 stay inside
    iy, a0, a1 = _linear_taps(h, H)
    jx, b0, b1 = _linear_taps(w, W)
    dot = lambda u, v: (u * v).sum(0)  # noqa: E731
    sq, right, down = dot(f, f), dot(f[:, :, :-1], f[:, :, 1:]), dot(f[:, :-1], f[:, 1:])
    cross = dot(f[:, :-1, :-1], f[:, 1:, 1:]) + dot(f[:, :-1, 1:], f[:, 1:, :-1])  # <f[i,j], f[i+1,j+1]> + <f[i,j+1], f[i+1,j]>
    y0, y1 = a0[:, None], a1[:, None]
    # squared norm of the y-resized column j with itself (same) and with column j + 1 (next): H x (w + 2) / (w + 1)
    same = y0 * y0 * sq[iy] + y1 * y1 * sq[iy + 1] + 2 * y0 * y1 * down[iy]
    nxt = y0 * y0 * right[iy] + y1 * y1 * right[iy + 1] + y0 * y1 * cross[iy]
    norm2 = b0 * b0 * same[:, jx] + b1 * b1 * same[:, jx + 1] + 2 * b0 * b1 * nxt[:, jx]
    scale = norm2.clamp(min=0).sqrt().clamp(min=1e-12).reciprocal()
    slots = count + 1  # the last collects the pixels left out
    cols = w + 2
    at = (iy[:, None] * cols + jx) * slots + torch.where(inverse >= 0, inverse, count).cpu()  # H x W, corner (0, 0)
    weights = torch.zeros((h + 2) * cols * slots, dtype=torch.float64)
    for dy, wy in ((0, y0 * scale), (1, y1 * scale)):
        for dx, wx in ((0, b0), (1, b1)):
            weights.index_add_(0, (at + (dy * cols + dx) * slots).flatten(), (wy * wx).flatten())
    sums = f.reshape(C, -1) @ weights.view(-1, slots)[:, :count]  # C x count
    counts = torch.bincount(inverse.flatten().cpu() + 1, minlength=count + 1)[1:]
    return (sums / counts.clamp(min=1)).T


def region_index(regions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R sorted region values, h x w index of each pixel's value): `torch.unique`, by a table where the
    ids span fewer values than the map has pixels (no sort of the pixels)."""
    regions = regions.cpu().long()
    low, high = (int(v) for v in regions.aminmax())
    if high - low >= regions.numel():
        values, inverse = torch.unique(regions, return_inverse=True)
        return values, inverse
    present = torch.bincount((regions - low).flatten(), minlength=high - low + 1) > 0
    return present.nonzero().flatten() + low, (present.cumsum(0) - 1)[regions - low]


def region_queries(regions: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R region values, R x C queries, h x w index of each pixel's region): each value of the h x w map (the
    unsegmented one too) and the L2-normalised mean over its pixels of the C x h' x w' features resized
    bilinearly to h x w and L2-normalised per pixel (`resized_region_means`; the key backbone's raw map, or the
    resized normalised map itself)."""
    values, inverse = region_index(regions)
    return values, F.normalize(resized_region_means(features, inverse, len(values)).float(), dim=-1), inverse


def region_support(
    regions: torch.Tensor, features: torch.Tensor, bank: ImageBank, texts: dict[str, torch.Tensor], k: int = NUM_SUPPORT
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R x N support logits per region, h x w index of each pixel's region) of an image (published
    `forward_slide` + `get_support_clip_logits` before painting): regions h x w ids, features C x h' x w'
    key-backbone features (the raw whole-image map: the queries are region means of it resized to h x w and
    L2-normalised per pixel, as `Backbone.image_features`), texts store -> N x D text embeddings (one per CLIP
    store used; their logits averaged)."""
    _, queries, inverse = region_queries(regions, features)
    _, rows = search(bank.index, queries.numpy(), k)
    logits = sum(bank.support(store, rows) @ text.float().cpu().T for store, text in texts.items()) / len(texts)
    return logits, inverse


def paint(logits: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """N x h x w: each pixel's region's row of the R x N logits (a gather, inverse h x w region index)."""
    return torch.index_select(logits.T.contiguous(), 1, inverse.flatten().to(logits.device)).view(-1, *inverse.shape)


def retrieval_logits(
    regions: torch.Tensor, features: torch.Tensor, bank: ImageBank, texts: dict[str, torch.Tensor], k: int = NUM_SUPPORT
) -> torch.Tensor:
    """N x h x w support logits of an image, painted on its regions (`region_support`)."""
    return paint(*region_support(regions, features, bank, texts, k)).to(features.device)


# -- building -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ValueModel:
    """One CLIP whose values a bank stores, with the spec and settings of its dense pixel features."""

    clip: object
    spec: object  # AttentionSpec
    settings: object  # InferenceSettings (resolution, windows, ...)
    backbones: object = None  # models.proxies.ProxyBackbones its spec's `ext:` taps run (None: the CLIP's own)

    def record(self) -> dict:
        """Its manifest entry: the store's CLIP id, model, weights, width, spec and settings."""
        return {
            "clip": clip_id(self.clip), "model": self.clip.model_name, "pretrained": self.clip.pretrained, "precision": self.clip.precision,
            "dim": int(self.clip.visual.proj.shape[1]), "spec": str(self.spec), "settings": dataclasses.asdict(self.settings),
        }  # fmt: skip

    def feature_map(self, rgb: np.ndarray, regions: np.ndarray, image_features: dict | None = None) -> CosineMap:
        """D x H x W unnormalised dense features at the image's size, rows on demand (a CosineMap against
        the identity: the published builder's window-averaged projections resized bilinearly)."""
        plan = Plan.of(self.spec, self.settings)
        pixels = plan.forward.pixels(rgb, self.clip, plan.settings)
        eye = torch.eye(int(self.clip.visual.proj.shape[1]))
        backbones = self.backbones or self.clip.proxies
        run = ImageRun(plan, self.clip, eye, rgb, pixels, input_regions(regions, tuple(pixels.shape[-2:])), backbones, image_features or {}, raw=True)
        return dense_cosine(run, tuple(rgb.shape[:2]))


def factored_region_means(cosine: CosineMap, inverse: torch.Tensor, count: int, band: int = 32) -> torch.Tensor:
    """count x N float64: per region the mean of a CosineMap's N x H x W map (rows_from @ grid @ cols^T) without
    making the map or any band of it. inverse: H x W region index in [0, count), -1 left out. Why: the map is
    linear in its small grid, so a region's sum is the grid contracted with M[region, r, k] = sum over the
    region's pixels of rows_from[y, r] cols[x, k] (summed by region index, `band` image rows at a time); reading
    the 512 x H x W values map band by band was a third of a bank build's time."""
    R, K, N = cosine.grid.shape
    H, W = inverse.shape
    ly, lx = cosine.rows_from[:H].double().cpu(), cosine.cols.double().cpu()  # H x R, W x K
    slots = count + 1  # the last collects the pixels left out
    at = torch.arange(H)[:, None] * slots + torch.where(inverse >= 0, inverse, count).cpu()  # H x W
    per_row = torch.zeros(H * slots, K, dtype=torch.float64)  # [y, region]: sum of cols[x] over the row's pixels
    for y0 in range(0, H, band):
        rows = at[y0 : y0 + band]
        per_row.index_add_(0, rows.flatten(), lx.repeat(len(rows), 1))
    weights = torch.einsum("yr,ysk->srk", ly, per_row.view(H, slots, K))[:count]  # count x R x K
    sums = weights.reshape(count, R * K) @ cosine.grid.double().cpu().reshape(R * K, N)
    counts = torch.bincount(inverse.flatten().cpu() + 1, minlength=count + 1)[1:]
    return sums / counts.clamp(min=1)[:, None]


def image_part(rgb: np.ndarray, regions: np.ndarray, key_map: torch.Tensor, models: Sequence[ValueModel]) -> dict[str, np.ndarray]:
    """One image's rows: region ids (sorted, unsegmented left out), keys (float16 region means of the key
    backbone's per-pixel normalised features at the image's size; key_map: its 1 x C x h x w raw map) and
    one values array per model (float16 L2-normalised region means of its unnormalised pixel features)."""
    values, inverse = region_index(torch.from_numpy(np.asarray(regions, dtype=np.int64)))
    unsegmented = int((values < 0).sum())  # sorted: the negative values first
    ids = values[unsegmented:].numpy()
    keys = resized_region_means(key_map[0], (inverse - unsegmented).clamp(min=-1), len(ids))
    part = {"ids": ids, "keys": keys.numpy().astype(np.float16)}
    for i, model in enumerate(models):
        means = factored_region_means(model.feature_map(rgb, regions), (inverse - unsegmented).clamp(min=-1), len(ids))
        part[f"values{i}"] = F.normalize(means.float(), dim=-1).numpy().astype(np.float16)
    return part


def part_path(bank: Path, index: int) -> Path:
    return bank / PARTS / f"{index:08d}.npz"


def write_part(bank: Path, index: int, part: dict[str, np.ndarray]) -> None:
    """Atomically (a kill leaves no torn part: resuming skips only complete ones)."""
    with atomic_path(part_path(bank, index)) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **part)


def claim_manifest(bank: Path, settings: dict) -> None:
    """Record the build settings in BANK/parts/settings.json; a bank begun with other settings is refused
    by name (resuming must not mix two builds)."""
    path = bank / PARTS / "settings.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if before != json.loads(json.dumps(settings)):
            changed = sorted(k for k in set(before) | set(settings) if before.get(k) != json.loads(json.dumps(settings)).get(k))
            raise BankError(f"{bank}: a bank build with other settings ({', '.join(changed)}) is in this folder; choose another --out")
    else:
        write_json_atomic(path, settings)


def finish_bank(bank: Path, settings: dict, images: Sequence[str], index_kind: str = "auto") -> dict:
    """Merge the parts (image order, then region id) into the memory-mapped stores, build the index, stamp
    the files and hash the manifest, written last (a bank without one is unfinished). Images without a part
    (unreadable) are listed as skipped. Returns the manifest."""
    kept = [i for i in range(len(images)) if part_path(bank, i).is_file()]
    parts = [np.load(part_path(bank, i)) for i in kept]
    n = sum(len(p["ids"]) for p in parts)
    if n == 0:
        raise BankError(f"{bank}: the images hold no regions; nothing to store")
    arrays = {KEYS: "keys", **{values_file(i): f"values{i}" for i in range(len(settings["values"]))}}
    for name, key in arrays.items():
        width = parts[0][key].shape[1]
        with atomic_path(bank / name) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(n, width))
            row = 0
            for p in parts:
                out[row : row + len(p["ids"])] = p[key]
                row += len(p["ids"])
            out.flush()
            del out
    rows = np.concatenate([np.stack([np.full(len(p["ids"]), i), p["ids"]], 1) for i, p in zip(kept, parts)]).astype(np.int64)
    with atomic_path(bank / ROWS) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, rows)
    index = build_index(np.load(bank / KEYS, mmap_mode="r"), index_kind)
    with atomic_path(bank / INDEX) as tmp:
        _faiss().write_index(index, str(tmp))
    manifest = {
        "format": BANK_FORMAT, **settings, "images": list(images), "skipped": [images[i] for i in range(len(images)) if i not in kept],
        "rows": n, "index": type(_faiss().downcast_index(index.index)).__name__,
        "files": {name: file_stamp(bank / name) for name in (*arrays, ROWS, INDEX)},
        "parts": {part_path(bank, i).name: file_stamp(part_path(bank, i)) for i in kept},
    }  # fmt: skip
    manifest["hash"] = content_hash(manifest)
    write_json_atomic(bank / MANIFEST, manifest)
    return manifest


def pending(bank: Path, order: Iterable[int], parts: dict | None = None) -> list[int]:
    """Image indices (in `order`) without a finished part, or whose part does not match its stamp in
    `parts` (a finished bank's manifest)."""
    parts = parts or {}
    paths = {i: part_path(bank, i) for i in order}
    return [i for i, p in paths.items() if not p.is_file() or (p.name in parts and not stamp_matches(p, parts[p.name]))]


def build_bank(
    jobs: Sequence[tuple[Path, str]],
    out: str | Path,
    models: Sequence[ValueModel],
    key_backbone,
    key_record: dict,
    regions: Callable[[np.ndarray, str], np.ndarray],
    region_source: str,
    index_kind: str = "auto",
    progress: bool = False,
    note: Callable[[str], None] | None = None,
) -> dict:
    """Build (or finish) a bank from `jobs` ((image file, name) pairs, in a fixed order) into `out`.
    Resumable: each image's rows go to their own part, written atomically, and finished parts are skipped;
    under torchrun each rank takes every world-th image and rank 0 merges. A finished bank is returned as
    it is unless its files do not match its manifest (then the parts that do not match are redone and the
    bank merged again) or it skipped images (then they are tried again). An image that cannot be read is
    skipped (`note` says why) and listed in the manifest. A bank or an unfinished build with other settings
    in `out` is refused by name. Returns the manifest."""
    from ..runtime.distributed import barrier, rank_and_world
    from ..runtime.progress import progress_bar
    from .images import ImageReadError, load_image

    if index_kind not in INDEX_KINDS:
        raise BankError(f"index kind must be one of {', '.join(INDEX_KINDS)} (got {index_kind!r})")
    out = Path(out)
    names = [name for _, name in jobs]
    settings = {"keys": {"backbone": key_backbone.info.name, **key_record}, "values": [m.record() for m in models], "regions": region_source, "index_kind": index_kind}
    wanted = json.loads(json.dumps({**settings, "images": names}, default=str))
    done = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else {}
    if done and {k: done.get(k) for k in wanted} != wanted:
        changed = sorted(k for k in wanted if done.get(k) != wanted[k])
        raise BankError(f"{out}: a bank built with other settings ({', '.join(changed)}) is there; choose another --out")
    if done and not done.get("skipped") and mismatch(out, done) is None:
        return done
    rank, world = rank_and_world()
    if rank == 0:
        claim_manifest(out, wanted)
    barrier()
    if rank:
        claim_manifest(out, wanted)
    todo = pending(out, range(rank, len(jobs), world), done.get("parts"))
    bar = progress_bar("images") if progress and rank == 0 else None
    task = bar.add_task("bank build", total=len(todo)) if bar else None
    if bar:
        bar.start()
    try:
        for i in todo:
            path, name = jobs[i]
            try:
                rgb = load_image(path)
            except (ImageReadError, OSError) as e:  # as segment does: the others go on, a re-run tries it again
                if note:
                    note(f"skipping an image that cannot be read ({e}); the bank's manifest lists it")
            else:
                region_map = np.asarray(regions(rgb, name))
                if region_map.shape != rgb.shape[:2]:
                    raise BankError(f"{name}: region map {region_map.shape} differs from the image {rgb.shape[:2]}")
                key_map = key_backbone.image_feature_map(torch.from_numpy(np.array(rgb)))
                write_part(out, i, image_part(rgb, region_map, key_map, models))
            if bar:
                bar.advance(task)
    finally:
        if bar:
            bar.stop()
    barrier()
    manifest = finish_bank(out, settings, names, index_kind) if rank == 0 else None
    barrier()
    return manifest if manifest is not None else json.loads((out / MANIFEST).read_text())
