"""Grids of runs: expand a grid into cells, run each as one `eval` or `fgovd` run, resumably.

A grid crosses models x data x attention specs x resolutions. The specs come from presets (each gives
the block edits), optionally with their source and/or normalizer replaced by every value listed, plus
any explicit specs. Data are segmentation datasets (one cell each) and FG-OVD benchmark files (one cell
each, so the report can put the benchmarks side by side).

Every cell writes its own result file `OUT/<hash>.json`, the hash being `results.config_hash` of the
cell's full configuration; its resumable progress log lives beside it (written by evaluate /
evaluate_fgovd). A cell whose result file exists is skipped unless its data changed (another root, or
files added, removed or modified: `data_changed`), which recomputes it in place; a cell that raises gets `OUT/<hash>.error.json`
(the error and a traceback summary) and the sweep goes on; re-running the sweep retries failed cells and
resumes an interrupted one. Cells run ordered by model, so each model is loaded once; the text
embeddings of a vocabulary are computed once per model and then come from the on-disk text cache.
"""

from __future__ import annotations

import dataclasses
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..registry import Registry
from ..files.results import RESULT_SCHEMA, config_hash, file_id
from ..runtime.atomic import write_json_atomic

GRID_DIR = Path(__file__).parent / "grids"


@dataclass(frozen=True)
class Grid:
    """What to run. Empty `presets` means the unmodified block (`clip`, i.e. qk/softmax) as the base spec;
    empty `sources` / `normalizers` keep each preset's own. `alphas` are shorthand for entmax:ALPHA and are
    folded into `normalizers`. `resolutions` empty = the protocol's own. `overrides` are further inference
    settings (window, stride, logit_scale, ...) applied to every cell. `class_names` None = the protocol's
    (sclip, plain or a file, see `evaluate`). `templates` None = each runner's
    own default (the 80 OpenAI templates for eval, captions as written for FG-OVD)."""

    models: tuple[str, ...] = ("ViT-B-16",)
    pretrained: str = "openai"
    precision: str = "fp32"
    datasets: tuple[str, ...] = ()
    fgovd: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    normalizers: tuple[str, ...] = ()
    specs: tuple[str, ...] = ()
    resolutions: tuple[int, ...] = ()
    protocol: str = "sclip"
    class_names: str | None = None
    limit: int | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    region: str = "pool"
    negatives: int = 10
    templates: str | None = None

    def __post_init__(self) -> None:
        from ..attention import PRESETS, AttentionSpec
        from ..datasets import DATASETS
        from ..segment.segmenter import InferenceSettings
        from ..attention.normalizers import Normalizer
        from ..evaluation.protocols import PROTOCOLS

        for name in ("models", "datasets", "fgovd", "presets", "sources", "normalizers", "specs", "resolutions"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, (str, int)) else tuple(value))
        object.__setattr__(self, "normalizers", tuple(str(Normalizer.parse(n)) for n in self.normalizers))
        object.__setattr__(self, "overrides", dict(self.overrides))
        for preset in self.presets:
            PRESETS.get(preset)
        for dataset in self.datasets:
            DATASETS.get(dataset)
        PROTOCOLS.get(self.protocol)
        InferenceSettings().replace(**self.overrides)  # unknown or bad settings raise ValueError
        if self.fgovd:
            from ..evaluation.fgovd import REGIONS, split_name

            REGIONS.get(self.region)
            for path in self.fgovd:
                split_name(path)  # the split comes from the file name
        for source in self.sources:
            AttentionSpec(source=tuple(source.split("+")))
        for spec in self.specs:
            AttentionSpec.parse(spec)
        if not self.models:
            raise ValueError("the grid names no model")
        from ..models.clip import check_model_name

        for model in self.models:
            check_model_name(model)  # a typo fails the grid, not every cell
        if not self.datasets and not self.fgovd:
            raise ValueError("the grid names no data: give datasets and/or FG-OVD benchmark files")
        if any(int(r) <= 0 for r in self.resolutions):
            raise ValueError(f"resolutions must be positive (got {list(self.resolutions)})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (got {self.limit})")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Grid":
        """Build from flag/TOML keys; `alphas = [1.25, 1.5]` adds entmax:1.25 and entmax:1.5 to normalizers."""
        data = dict(data)
        alphas = data.pop("alphas", None) or ()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            import difflib

            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, n=1)) else repr(k) for k in unknown]
            raise ValueError(f"unknown grid key(s) {', '.join(hints)}; keys: alphas, {', '.join(sorted(known))}")
        normalizers = tuple(data.pop("normalizers", None) or ()) + tuple(f"entmax:{a}" for a in alphas)
        return cls(**data, normalizers=normalizers)

    def attention_specs(self) -> list[str]:
        """Canonical spec strings, in grid order, without repeats."""
        from ..attention import PRESETS, AttentionSpec

        bases = [PRESETS.get(p).spec for p in self.presets] or [AttentionSpec()]
        out = []
        for base in bases:
            for source in self.sources or ["+".join(base.source)]:
                for normalizer in self.normalizers or [base.normalizer]:
                    out.append(str(base.replace(source=tuple(source.split("+")), normalizer=normalizer)))
        out += [str(AttentionSpec.parse(s)) for s in self.specs]
        return list(dict.fromkeys(out))

    def cells(self) -> list["Cell"]:
        """models x data x specs x resolutions, ordered by model first; repeats dropped."""
        data = [("eval", d) for d in self.datasets] + [("fgovd", str(f)) for f in self.fgovd]
        resolutions = [int(r) for r in self.resolutions] or [None]
        cells = [
            Cell(self, kind, model, item, spec, res)
            for model in self.models
            for kind, item in data
            for spec in self.attention_specs()
            for res in resolutions
        ]
        unique: dict[str, Cell] = {}
        for cell in cells:
            unique.setdefault(cell.hash, cell)
        return list(unique.values())


@dataclass(frozen=True)
class Cell:
    """One run of the grid: one model, one dataset (or FG-OVD benchmark file), one spec, one resolution."""

    grid: Grid = field(repr=False, compare=False)
    kind: str  # "eval" | "fgovd"
    model: str
    data: str  # dataset name, or the benchmark file's path
    attention: str
    resolution: int | None

    def config(self) -> dict:
        """The full configuration of this cell (the input side; the result file holds the resolved one)."""
        g = self.grid
        config = {"kind": self.kind, "model": self.model, "pretrained": g.pretrained, "precision": g.precision,
                  "attention": self.attention, "resolution": self.resolution, "overrides": g.overrides, "limit": g.limit,
                  "templates": g.templates}  # fmt: skip
        if self.kind == "eval":
            config |= {"dataset": self.data, "protocol": g.protocol, "class_names": g.class_names}
        else:
            config |= {"benchmark": file_id(self.data), "region": g.region, "negatives": g.negatives}
        return config

    @property
    def hash(self) -> str:
        return config_hash(self.config())

    @property
    def settings_changes(self) -> dict[str, Any]:
        """Inference-setting overrides of this cell: the grid's, plus its resolution."""
        return {**self.grid.overrides, **({"resolution": self.resolution} if self.resolution else {})}

    @property
    def model_key(self) -> tuple[str, str, str]:
        return (self.model, self.grid.pretrained, self.grid.precision)

    @property
    def label(self) -> str:
        data = self.data if self.kind == "eval" else Path(self.data).stem
        res = f" @{self.resolution}" if self.resolution else ""
        return f"{Path(self.model).stem} {data} {self.attention}{res}"


def check_fgovd_negatives(grid: Grid, metric: str | None = None) -> list[str]:
    """Before any cell runs: a note per FG-OVD file that is reported below the grid's `negatives` (each
    split at the N most of its regions reach, `fgovd.metrics.supported_negatives`); ValueError when
    `metric` names an N (`top1@10`) for which a file has no region, so its split could never be shown."""
    import re

    from ..evaluation.fgovd.data import negative_counts
    from ..evaluation.fgovd.metrics import supported_negatives

    asked = re.fullmatch(r"(?:top1|mean_rank|median_rank|count)@(\d+)", metric or "")
    notes = []
    for path in grid.fgovd:
        counts = negative_counts(path)
        if not counts:
            continue
        if asked and max(counts) < int(asked.group(1)):
            raise ValueError(
                f"report metric {metric}: {Path(path).name} has no region with {asked.group(1)} hard negatives (at most "
                f"{max(counts)}); use the metric without @N (each split at the N it supports) or negatives <= {max(counts)}"
            )
        n = supported_negatives(counts, grid.negatives)
        if n is not None and n < grid.negatives:
            notes.append(f"{Path(path).name}: most regions have fewer than {grid.negatives} hard negatives; reported at N = {n} (`top1` = top1@{n})")
    return notes


# -- running -----------------------------------------------------------------------------------------
@dataclass
class SweepPaths:
    """Where a sweep reads data and writes results. roots: dataset name -> root, "*" for any dataset.
    regions: dataset name -> region-mask folder (or sam2), "*" -> a folder with one sub-folder per dataset."""

    out: Path
    roots: Mapping[str, Path] = field(default_factory=dict)
    images_root: Path | None = None
    regions: Mapping[str, Path] = field(default_factory=dict)

    def result(self, cell: Cell) -> Path:
        return self.out / f"{cell.hash}.json"

    def error(self, cell: Cell) -> Path:
        return self.out / f"{cell.hash}.error.json"

    def region_source(self, dataset: str, device: str = "cpu"):
        """The region source of `dataset`'s cells (`regions.open_regions`), None when none was given."""
        from ..segment.regions import open_regions

        value = self.regions.get(dataset, self.regions.get("*"))
        if value is None:
            return None
        if str(value) == "sam2":
            return open_regions("sam2", device)
        return open_regions(str(value if dataset in self.regions else Path(value) / dataset))

    def root(self, dataset: str) -> Path:
        root = self.roots.get(dataset, self.roots.get("*"))
        if root is None:
            raise ValueError(f"no data root given for dataset {dataset!r} (use --root {dataset}=DIR or --root DIR)")
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
    from .report import read_result

    path = paths.result(cell)
    return path.is_file() and read_result(path) is not None


def data_changed(paths: SweepPaths, cell: Cell) -> bool:
    """Whether a finished eval cell was computed on other data than `paths` now gives it: another root,
    or files added, removed or modified since (Benchmark.fingerprint). Data that cannot be read now (no
    root given, a missing folder) is not judged, so a report can be re-rendered without the datasets.
    FG-OVD cells need no check: their hash holds the benchmark file's content hash."""
    from ..datasets import DatasetError
    from .report import read_result

    if cell.kind != "eval":
        return False
    config = (read_result(paths.result(cell)) or {}).get("config", {})
    try:
        root = paths.root(cell.data)
        now = {"root": str(root.resolve()), "data": _fingerprint(cell.data, str(root.resolve()))}
    except (ValueError, DatasetError):
        return False
    return any(config.get(k) != v for k, v in now.items())


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
                 regions=paths.region_source(cell.data, str(clip.device)), **templates)  # fmt: skip
    else:
        from ..evaluation.fgovd import evaluate_fgovd
        from ..segment.segmenter import InferenceSettings

        if paths.images_root is None:
            raise ValueError("FG-OVD cells need the COCO images folder (--images-root)")
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
                    clip = load_clip(cell.model, pretrained=cell.grid.pretrained, device=device, precision=cell.grid.precision)
                if clip is None:
                    raise RuntimeError(f"model {cell.model} ({cell.grid.pretrained}) could not be loaded; see the first failure")
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


# -- shipped grids -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GridFile:
    """A TOML grid: the grid keys at top level, plus an optional `description`, `[roots]` (dataset ->
    folder, relative to the file), `images_root`, and `[report]` (rows, cols, metric) for `reproduce`."""

    grid: Grid
    description: str = ""
    roots: Mapping[str, Path] = field(default_factory=dict)
    images_root: Path | None = None
    report: Mapping[str, str] = field(default_factory=dict)


def read_grid_file(
    path: str | Path, overrides: Mapping[str, Any] | None = None, benchmarks_dir: str | Path | None = None
) -> GridFile:
    """Parse a TOML grid; `overrides` (flag values that were given) replace the file's keys. Relative
    paths are relative to the file, FG-OVD benchmark files to `benchmarks_dir` when given."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: grid file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    description = data.pop("description", "")
    report = data.pop("report", {})
    roots = {k: path.parent / v for k, v in data.pop("roots", {}).items()}
    images_root = data.pop("images_root", None)
    data["fgovd"] = [str(Path(benchmarks_dir or path.parent) / f) for f in data.get("fgovd", [])]
    data.update(overrides or {})
    try:
        grid = Grid.from_dict(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return GridFile(grid, description, roots, path.parent / images_root if images_root else None, report)


GRIDS: Registry[Path] = Registry("grid")
for _path in sorted(GRID_DIR.glob("*.toml")):
    GRIDS.register(_path.stem, _path, help=tomllib.loads(_path.read_text(encoding="utf-8")).get("description", ""))
