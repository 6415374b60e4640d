"""How a sweep runs: every cell as one `eval` or `fgovd` run, resumably.

Every cell writes its own result file `OUT/<hash>.json`, the hash being `results.config_hash` of the
cell's full configuration; its resumable progress log lives beside it (written by evaluate /
evaluate_fgovd). A cell whose result file exists is skipped unless its data changed (another root, or
files added, removed or modified: `data_changed`), which recomputes it in place; a cell that raises gets `OUT/<hash>.error.json`
(the error and a traceback summary) and the sweep goes on; re-running the sweep retries failed cells and
resumes an interrupted one. Cells run ordered by model, so each model is loaded once; the text
embeddings of a vocabulary are computed once per model and then come from the on-disk text cache.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..errors import UserValueError
from ..files.results import RESULT_SCHEMA, WEIGHTS_KEY
from ..runtime.atomic import write_json_atomic
from ..runtime.fingerprint import file_digest
from ..runtime.weights import is_checkpoint_path
from .grid import Cell, Grid
from .records import read_result

@dataclass
class SweepPaths:
    """Where a sweep reads data and writes results. roots: dataset name -> root, "*" for any dataset.
    regions: dataset name -> region-mask folder (or a registered source: sam2, sam3), "*" -> a folder with one
    sub-folder per dataset."""

    out: Path
    roots: Mapping[str, Path] = field(default_factory=dict)
    images_root: Path | None = None
    regions: Mapping[str, Path] = field(default_factory=dict)
    bank: Path | None = None  # the image bank of cells whose spec runs a retrieval stage (corrclipv2)

    def result(self, cell: Cell) -> Path:
        return self.out / f"{self._name(cell)}.json"

    def error(self, cell: Cell) -> Path:
        return self.out / f"{self._name(cell)}.error.json"

    def _name(self, cell: Cell) -> str:
        """The cell's hash, plus the bank's content hash for a cell that reads the bank (results of two
        banks never share a file)."""
        bank = self.image_bank(cell)
        return cell.hash if bank is None else f"{cell.hash}.bank-{bank.content_hash}"

    def image_bank(self, cell: Cell):
        """The opened bank (`segment.bank.ImageBank`) for an eval cell whose spec runs a retrieval stage."""
        if self.bank is None or cell.kind != "eval":
            return None
        from ..attention import resolve_spec

        return _open_bank(str(self.bank)) if resolve_spec(cell.attention).needs.bank else None

    def resources(self, cell: Cell, device: str = "cpu"):
        """The inputs of an eval cell (`segment.Resources`): its dataset's region source, the bank when its spec
        runs a retrieval stage, the grid's prompt file."""
        from ..segment.resources import Resources
        from ..segment.vocabulary import resolve_prompts

        return Resources(self.region_source(cell.data, device), self.image_bank(cell), resolve_prompts(cell.grid.prompts))

    def region_source(self, dataset: str, device: str = "cpu"):
        """The region source of `dataset`'s cells (`regions.open_regions`), None when none was given."""
        from ..segment.regions import REGION_SOURCES, open_regions

        value = self.regions.get(dataset, self.regions.get("*"))
        if value is None:
            return None
        if str(value) in REGION_SOURCES:  # sam2, sam3: one generator for every dataset
            return open_regions(str(value), device)
        return open_regions(str(value if dataset in self.regions else Path(value) / dataset))

    def root(self, dataset: str) -> Path:
        root = self.roots.get(dataset, self.roots.get("*"))
        if root is None:
            raise UserValueError(f"no data root given for dataset {dataset!r} (use --root {dataset}=DIR or --root DIR)")
        return Path(root)


def parse_roots(values: Iterable[str]) -> dict[str, Path]:
    """`DIR` (every dataset) or `NAME=DIR` (one dataset) -> {"*" or NAME: Path}."""
    roots: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        roots[name if sep else "*"] = Path(path if sep else value)
    return roots


@dataclass
class Failure:
    cell: Cell
    error: str


@dataclass
class SweepSummary:
    total: int
    skipped: int = 0
    ran: int = 0
    failed: list[Failure] = field(default_factory=list)
    wall_s: float = 0.0
    results: list[Path] = field(default_factory=list)
    stale: int = 0  # finished cells recomputed because their data changed


def is_done(paths: SweepPaths, cell: Cell) -> bool:
    path = paths.result(cell)
    return path.is_file() and read_result(path) is not None


def data_changed(paths: SweepPaths, cell: Cell) -> bool:
    """Whether a finished cell was computed on other data or weights than it would be now: a checkpoint file
    rewritten in place (its content digest, `pretrained_sha256`), or for eval cells another root, or files
    added, removed or modified since (Benchmark.fingerprint). Data that cannot be read now (no root given,
    a missing folder) is not judged, so a report can be re-rendered without the datasets. FG-OVD cells'
    hash holds the benchmark file's content digest."""
    from ..datasets import DatasetError

    config = (read_result(paths.result(cell)) or {}).get("config", {})
    checkpoint = Path(cell.pretrained)
    if is_checkpoint_path(cell.pretrained) and checkpoint.is_file() and config.get(WEIGHTS_KEY) != file_digest(checkpoint):
        return True
    if cell.kind != "eval":
        return False
    try:
        root = paths.root(cell.data)
        now = {"root": str(root.resolve()), "data": _fingerprint(cell.data, str(root.resolve()))}
    except (ValueError, DatasetError):
        return False
    return any(config.get(k) != v for k, v in now.items())


@lru_cache(maxsize=None)
def _open_bank(path: str):
    from ..segment.bank import ImageBank

    return ImageBank.open(path)


@lru_cache(maxsize=None)
def _fingerprint(dataset: str, root: str) -> str:
    from ..datasets import DATASETS

    bench = DATASETS.get(dataset)
    return bench.fingerprint(bench.samples(root))


def run_cell(clip, cell: Cell, paths: SweepPaths, progress: bool = False, overwrite: bool = False) -> None:
    """One eval / fgovd run writing its result (and resumable progress) at `paths.result(cell)`; progress:
    its bars (text embedding, images) under the sweep's; overwrite: recompute a finished (stale) result."""
    g = cell.grid
    out = paths.result(cell)
    templates = {"templates": g.templates} if g.templates else {}
    if cell.kind == "eval":
        from ..evaluation.segmentation import evaluate

        evaluate(clip, cell.data, paths.root(cell.data), cell.attention, protocol=g.protocol, overrides=cell.settings_changes or None,
                 class_names=g.class_names, limit=g.limit, out=out, resume=True, progress=progress, overwrite=overwrite,
                 resources=paths.resources(cell, str(clip.device)), **templates)  # fmt: skip
    else:
        from ..evaluation.fgovd import evaluate_fgovd
        from ..segment.settings import InferenceSettings

        if paths.images_root is None:
            raise UserValueError("FG-OVD cells need the COCO images folder (--images-root)")
        changes = cell.settings_changes
        settings = InferenceSettings().replace(**changes) if changes else None
        evaluate_fgovd(clip, [Path(cell.data)], paths.images_root, cell.attention, region=g.region, negatives=g.negatives,
                       settings=settings, limit=g.limit, out=out, resume=True, progress=progress, **templates)  # fmt: skip


def record_failure(paths: SweepPaths, cell: Cell, exc: BaseException) -> str:
    """Write `<hash>.error.json`: the cell's configuration, the error and a short traceback."""
    message = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)[-6:]
    write_json_atomic(paths.error(cell), {
        "schema": RESULT_SCHEMA, "kind": "error", "config": cell.config(), "label": cell.label, "error": message,
        "traceback": [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}" for f in frames],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })  # fmt: skip
    return message


def run_sweep(
    grid: Grid | Sequence[Cell],
    paths: SweepPaths,
    device: str = "auto",
    progress: bool = True,
    part: tuple[int, int] | None = None,
) -> SweepSummary:
    """Run every cell not done yet; see the module doc. KeyboardInterrupt stops the sweep (resume by
    running it again); any other exception fails only its cell.

    part: (index, count) runs only the index-th (0-based) of `count` disjoint parts of the cells (every
    count-th cell, `--shard I/N`), for job arrays that share nothing but the output folder. Under torchrun
    the cells still to do are dealt out to the ranks (every world-th, in model order), each cell runs in
    one rank alone, and every rank returns the summary of all ranks.
    """
    from ..runtime.distributed import barrier, gather, rank_and_world, shard, single_process
    from ..models.clip import load_clip
    from ..runtime.progress import progress_bar

    start = time.perf_counter()
    cells = grid.cells() if isinstance(grid, Grid) else list(grid)
    if part is not None:
        cells = shard(cells, *part)
    rank, world = rank_and_world()
    summary = SweepSummary(total=len(cells))
    pending, stale = [], set()
    _fingerprint.cache_clear()  # files may have changed since an earlier sweep in this process
    for cell in cells:
        if is_done(paths, cell) and data_changed(paths, cell):
            stale.add(cell.hash)
            pending.append(cell)
        elif is_done(paths, cell):
            summary.skipped += 1
            summary.results.append(paths.result(cell))
        else:
            pending.append(cell)
    summary.stale = len(stale)
    pending.sort(key=lambda c: c.model_key)  # stable: grid order within a model
    paths.out.mkdir(parents=True, exist_ok=True)
    barrier()  # every rank has listed the same cells to do before any rank writes a result
    mine = shard(pending, rank, world)
    ran, failed = [], []
    bar = progress_bar("cells")
    bar.disable = not progress or rank > 0
    with bar, single_process():
        # under torchrun rank 0's bar counts its own share of the cells
        share = f" (rank 0 of {world}: its {len(mine)} of {len(pending)} cells to do)" if world > 1 else ""
        task = bar.add_task("sweep" + share, total=len(mine) if world > 1 else len(cells), completed=0 if world > 1 else summary.skipped)
        clip, loaded = None, None
        for cell in mine:
            bar.update(task, description=f"sweep: {cell.label}")
            try:
                if loaded != cell.model_key:
                    clip, loaded = None, cell.model_key
                    clip = load_clip(cell.model, pretrained=cell.pretrained, device=device, precision=cell.grid.precision)
                if clip is None:
                    raise RuntimeError(f"model {cell.model} ({cell.pretrained}) could not be loaded; see the first failure")
                run_cell(clip, cell, paths, progress and rank == 0, overwrite=cell.hash in stale)
            except Exception as exc:  # noqa: BLE001 - a failing cell must not stop the sweep
                failed.append(Failure(cell, record_failure(paths, cell, exc)))
            else:
                paths.error(cell).unlink(missing_ok=True)
                ran.append(cell.hash)
            bar.advance(task)
        bar.update(task, description="sweep" + share)
    parts = gather((ran, failed))
    done = {h for hashes, _ in parts for h in hashes}
    summary.ran = len(done)
    order = {c.hash: i for i, c in enumerate(pending)}
    summary.failed = sorted((f for _, fails in parts for f in fails), key=lambda f: order[f.cell.hash])
    summary.results += [paths.result(c) for c in pending if c.hash in done]
    summary.wall_s = time.perf_counter() - start
    return summary
