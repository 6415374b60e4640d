"""What a sweep runs: a grid expanded into cells, and the TOML grid files shipped with the package.

A grid crosses models x data x attention specs x resolutions. The specs come from presets (each gives
the block edits), optionally with their source and/or normalizer replaced by every value listed, plus
any explicit specs. Data are segmentation datasets (one cell each) and FG-OVD benchmark files (one cell
each, so the report can put the benchmarks side by side). How the cells run is `sweeps.run`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import UserError, UserValueError
from ..files.results import config_hash
from ..runtime.fingerprint import file_id
from ..registry import Registry

GRID_DIR = Path(__file__).parent / "grids"


@dataclass(frozen=True)
class Grid:
    """What to run. Empty `presets` means the unmodified block (`clip`, i.e. qk/softmax) as the base spec;
    empty `sources` / `normalizers` keep each preset's own. `alphas` are shorthand for entmax:ALPHA and are
    folded into `normalizers`. `resolutions` empty = the protocol's own. `overrides` are further inference
    settings (window, stride, logit_scale, ...) applied to every cell. `class_names` None = the protocol's
    (sclip, plain or a file, see `evaluate`). `templates` None = each runner's
    own default (the 80 OpenAI templates for eval, captions as written for FG-OVD). `prompts`: a prompt
    file of description sentences per class name for the eval cells (`segment.vocabulary.Prompts`).
    A model may name its own weights, `NAME:TAG` (`ViT-B-16-quickgelu:metaclip_fullcc`), so one grid can
    cross families and weights of one architecture (grid `families`); `pretrained` is the others' tag.
    Empty `models` / None `pretrained`: the protocol's CLIP (`corrclip-metaclip`), else the library's default
    (`Protocol.clip_weights`, the one precedence)."""

    models: tuple[str, ...] = ()
    pretrained: str | None = None
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
    prompts: str | None = None

    def __post_init__(self) -> None:
        from ..attention import PRESETS, AttentionSpec
        from ..datasets import DATASETS
        from ..segment.settings import InferenceSettings
        from ..attention.normalizers import Normalizer
        from ..evaluation.protocols import PROTOCOLS

        for name in ("models", "datasets", "fgovd", "presets", "sources", "normalizers", "specs", "resolutions"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, (str, int)) else tuple(value))
        object.__setattr__(self, "normalizers", tuple(str(Normalizer.parse(n)) for n in self.normalizers))
        if not isinstance(self.overrides, Mapping):
            raise UserValueError(f"overrides must be a table of inference settings (got {self.overrides!r})")
        object.__setattr__(self, "overrides", dict(self.overrides))
        for preset in self.presets:
            PRESETS.get(preset)
        for dataset in self.datasets:
            DATASETS.get(dataset)
        PROTOCOLS.get(self.protocol)
        InferenceSettings().replace(**self.overrides)  # unknown or bad settings raise UserValueError
        if self.fgovd:
            from ..evaluation.fgovd import REGIONS, split_name

            REGIONS.get(self.region)
            for path in self.fgovd:
                split_name(path)  # the split comes from the file name
        for source in self.sources:
            AttentionSpec(source=tuple(source.split("+")))
        for spec in self.specs:
            AttentionSpec.parse(spec)
        if self.prompts is not None:
            from ..segment.vocabulary import Prompts

            Prompts.read(self.prompts)  # a bad file fails the grid, not every cell
        from ..models.clip import check_model_name

        for entry, (model, pretrained) in zip(self.models or ["the protocol's"], self.clips()):
            name = check_model_name(model)  # a typo fails the grid, not every cell
            named = model_weights(entry)[1] is not None or (self.pretrained is None and PROTOCOLS.get(self.protocol).pretrained)
            if named and not name.endswith(".json"):  # a tag from NAME:TAG or the protocol
                import open_clip

                if pretrained not in open_clip.list_pretrained_tags_by_model(name):
                    raise UserValueError(f"model {entry!r}: {name} has no pretrained tag {pretrained!r}; tags: {', '.join(open_clip.list_pretrained_tags_by_model(name)) or '(none)'}")
        if not self.datasets and not self.fgovd:
            raise UserValueError("the grid names no data: give datasets and/or FG-OVD benchmark files")
        try:
            positive = all(int(r) > 0 for r in self.resolutions)
        except (TypeError, ValueError):  # not a number
            positive = False
        if not positive:
            raise UserValueError(f"resolutions must be positive (got {list(self.resolutions)})")
        if self.limit is not None and self.limit < 1:
            raise UserValueError(f"limit must be >= 1 (got {self.limit})")

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
            raise UserValueError(f"unknown grid key(s) {', '.join(hints)}; keys: alphas, {', '.join(sorted(known))}")
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

    def clips(self) -> list[tuple[str, str]]:
        """(model, pretrained) per entry of `models`: NAME:TAG's tag, else the grid's `pretrained`; what is
        not named here comes from the protocol, else the library default (`Protocol.clip_weights`)."""
        from ..evaluation.protocols import PROTOCOLS

        protocol = PROTOCOLS.get(self.protocol)
        entries = [model_weights(m) for m in self.models] or [(None, None)]
        return [protocol.clip_weights(name, tag if tag is not None else self.pretrained) for name, tag in entries]

    def cells(self) -> list["Cell"]:
        """models x data x specs x resolutions, ordered by model first; repeats dropped."""
        data = [("eval", d) for d in self.datasets] + [("fgovd", str(f)) for f in self.fgovd]
        resolutions = [int(r) for r in self.resolutions] or [None]
        cells = [
            Cell(self, kind, model, pretrained, item, spec, res)
            for model, pretrained in self.clips()
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
    pretrained: str  # resolved (`Grid.clips`)
    data: str  # dataset name, or the benchmark file's path
    attention: str
    resolution: int | None

    def config(self) -> dict:
        """The full configuration of this cell (the input side; the result file holds the resolved one)."""
        g = self.grid
        config = {"kind": self.kind, "model": self.model, "pretrained": self.pretrained, "precision": g.precision,
                  "attention": self.attention, "resolution": self.resolution, "overrides": g.overrides, "limit": g.limit,
                  "templates": g.templates}  # fmt: skip
        if self.kind == "eval":
            config |= {"dataset": self.data, "protocol": g.protocol, "class_names": g.class_names}
            if g.prompts is not None:  # absent without one, so the hashes of earlier results stand
                from ..segment.vocabulary import Prompts

                config["prompts"] = Prompts.read(g.prompts).id()
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
        return (self.model, self.pretrained, self.grid.precision)

    @property
    def label(self) -> str:
        data = self.data if self.kind == "eval" else Path(self.data).stem
        res = f" @{self.resolution}" if self.resolution else ""
        from ..models.clip import DEFAULT_PRETRAINED

        weights = f":{self.pretrained}" if self.pretrained != DEFAULT_PRETRAINED else ""
        return f"{Path(self.model).stem}{weights} {data} {self.attention}{res}"


def model_weights(entry: str) -> tuple[str, str | None]:
    """A grid's model entry `NAME` or `NAME:TAG` as (NAME, TAG or None); a model-config JSON path is a NAME."""
    name, colon, tag = entry.rpartition(":")
    if not colon or not name or entry.endswith(".json") or "/" in tag or "\\" in tag:
        return entry, None
    return name, tag


def check_fgovd_negatives(grid: Grid, metric: str | None = None) -> list[str]:
    """Before any cell runs: a note per FG-OVD file that is reported below the grid's `negatives` (each
    split at the N most of its regions reach, `fgovd.metrics.supported_negatives`); UserValueError when
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
            raise UserValueError(
                f"report metric {metric}: {Path(path).name} has no region with {asked.group(1)} hard negatives (at most "
                f"{max(counts)}); use the metric without @N (each split at the N it supports) or negatives <= {max(counts)}"
            )
        n = supported_negatives(counts, grid.negatives)
        if n is not None and n < grid.negatives:
            notes.append(f"{Path(path).name}: most regions have fewer than {grid.negatives} hard negatives; reported at N = {n} (`top1` = top1@{n})")
    return notes


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
        raise UserValueError(f"{path}: grid file not found") from None
    except UnicodeDecodeError:
        raise UserValueError(f"{path}: not a UTF-8 text file; a grid is a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserValueError(f"{path}: not valid TOML: {e}") from None
    description = data.pop("description", "")
    report = data.pop("report", {})
    roots = {k: path.parent / v for k, v in data.pop("roots", {}).items()}
    images_root = data.pop("images_root", None)
    data["fgovd"] = [str(Path(benchmarks_dir or path.parent) / f) for f in data.get("fgovd", [])]
    overrides = dict(overrides or {})
    if "pretrained" in overrides and "models" not in overrides and "models" in data:  # --pretrained: every model's weights
        data["models"] = list(dict.fromkeys(model_weights(m)[0] for m in data["models"]))
    data.update(overrides)
    try:
        grid = Grid.from_dict(data)
    except (UserError, TypeError) as e:  # TypeError: a TOML value of the wrong type (a string for a list of numbers)
        raise UserValueError(f"{path}: {e}") from None
    return GridFile(grid, description, roots, path.parent / images_root if images_root else None, report)


GRIDS: Registry[Path] = Registry("grid", help_column="what", describe=lambda path: {"cells": str(len(read_grid_file(path, benchmarks_dir=".").grid.cells()))})
for _path in sorted(GRID_DIR.glob("*.toml")):
    GRIDS.register(_path.stem, _path, help=tomllib.loads(_path.read_text(encoding="utf-8")).get("description", ""))


def leaderboard_grids(overrides: Mapping[str, Any] | None = None, only: Sequence[str] | None = None) -> dict[str, Grid]:
    """`reproduce leaderboard`: one grid per paper's entry (evaluation.published) whose protocol runs a preset,
    named by its protocol: the protocol's preset with softmax and, where it has a normalizer slot, entmax,
    on the benchmarks the paper reports, with the CLIP it reports. `overrides`: grid keys given on the command
    line (a smoke run's models, weights, limit); `only`: these entries (protocol names) alone."""
    from ..attention import PRESETS
    from ..attention.presets import ENTMAX_ALPHA
    from ..evaluation.protocols import PROTOCOLS
    from ..evaluation.published import EIGHT, PUBLISHED

    grids = {}
    for name in only if only is not None else PUBLISHED.names():
        entry = PUBLISHED.get(name)  # an unknown name: "did you mean"
        preset = PROTOCOLS.get(entry.protocol).attention
        if preset not in PRESETS:  # a pipeline (sam3): `eval --protocol` runs it
            if only is not None:
                raise UserValueError(f"{name}: a pipeline's protocol; run it with `eval --protocol {name}`")
            continue
        slot = PRESETS.get(preset).spec.has_normalizer_slot
        overrides = dict(overrides or {})
        model = entry.model if "pretrained" in overrides else entry.clip  # --pretrained: the paper's model with those weights
        data = {
            "models": [model], "datasets": [d for d in EIGHT if d in entry.miou], "protocol": entry.protocol, "presets": [preset],
            "normalizers": ["softmax", f"entmax:{ENTMAX_ALPHA:g}"] if slot else ["softmax"], **overrides,
        }  # fmt: skip
        grids[name] = Grid.from_dict(data)
    return grids
