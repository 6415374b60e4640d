"""Finding the images to segment and where their outputs go, without ever writing outside the output folder.

INPUT arguments are files and/or folders. A folder is walked recursively and each image keeps its path
relative to that folder; a file given directly lands at the top of the output folder. Every image gets an
*output base* `OUT/rel/dir/stem`, to which the output writers add suffixes (`.png`, `.json`, ...).

Rules, all here so the CLI only forwards arguments:
- files with a non-image suffix are collected as `not_images`, and FIFOs, sockets or devices with an image
  suffix as `special` (the CLI prints a note for each kind); hidden files and
  folders (names starting with ".") are ignored, and symlinked folders are not followed (no loops);
- the same file reached twice (a folder and a file inside it) is segmented once;
- the output folder is never searched for inputs, and an input inside the output folder is refused, so
  outputs can never be read back as inputs nor replace an input;
- two images whose outputs would share a name (`c.jpg` and `c.png` in one folder, or names that differ
  only in case) use their full file name as the stem (`c.jpg.png`, `c.png.png`); two inputs with the same
  relative path from different arguments are refused;
- an output base is checked to stay inside the output folder even through symlinked sub-folders.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

from ..errors import UserValueError
from ..segment.images import is_image_path

# Every suffix an output writer may add to a base; naming is resolved against all of them so that the
# names of an image's outputs do not depend on the output options of a run.
OUTPUT_SUFFIXES = (".png", ".overlay.png", ".json", ".probs.npz", ".rle.json")


class InputError(UserValueError):
    """Bad INPUT arguments (missing path, input inside the output folder, clashing outputs)."""


@dataclass(frozen=True)
class ImageJob:
    """One image to segment: `source` on disk and `rel`, its output base relative to the output folder."""

    source: Path
    rel: PurePosixPath


@dataclass
class Discovery:
    """jobs to run; not_images: files skipped for their suffix; special: FIFOs, sockets and devices with an
    image suffix, skipped because reading one could block forever."""

    jobs: list[ImageJob] = field(default_factory=list)
    not_images: list[Path] = field(default_factory=list)
    special: list[Path] = field(default_factory=list)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _walk(folder: Path, out_dir: Path) -> Iterable[Path]:
    """Files under `folder` (sorted, recursive), skipping hidden names, symlinked folders and `out_dir`."""
    for root, dirs, files in os.walk(folder):
        root_path = Path(root)
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and (root_path / d).resolve() != out_dir
        )
        for name in sorted(files):
            if not name.startswith("."):
                yield root_path / name


def safe_output_base(out_dir: Path, rel: PurePosixPath) -> Path:
    """`out_dir / rel`, refusing absolute paths, `..` and symlinked folders that lead outside `out_dir`."""
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise InputError(f"output name {str(rel)!r} would leave the output folder")
    base = out_dir / rel
    real_out = out_dir.resolve()
    if not _inside(base.parent.resolve(), real_out):
        raise InputError(f"output {base} leaves {out_dir} through a symlink; refusing to write there")
    return base


def _assign_stems(entries: list[tuple[Path, PurePosixPath]]) -> list[ImageJob]:
    """Give each (source, relative file path) an output base; full file names where short stems clash."""
    full = [False] * len(entries)

    def bases(i: int) -> list[str]:
        source, rel_file = entries[i]
        stem = rel_file.name if full[i] else rel_file.stem
        return [str(rel_file.parent / (stem + s)).casefold() for s in OUTPUT_SUFFIXES]

    while True:
        owners: dict[str, set[int]] = defaultdict(set)
        for i in range(len(entries)):
            for name in bases(i):
                owners[name].add(i)
        clashing = {i for ids in owners.values() if len(ids) > 1 for i in ids}
        if not clashing:
            break
        if all(full[i] for i in clashing):
            a, b = sorted(next(ids for ids in owners.values() if len(ids) > 1))[:2]
            raise InputError(
                f"{entries[a][0]} and {entries[b][0]} would write the same outputs; segment them into separate --out folders"
            )
        for i in clashing:
            full[i] = True
    jobs = []
    for i, (source, rel_file) in enumerate(entries):
        stem = rel_file.name if full[i] else rel_file.stem
        jobs.append(ImageJob(source, rel_file.parent / stem))
    return jobs


def discover_images(inputs: Sequence[str | Path], out_dir: str | Path) -> Discovery:
    """Images under `inputs` (files and folders, recursive) with their output bases under `out_dir`.

    Raises InputError for a missing input, an input inside `out_dir` or outputs that would clash.
    """
    out_dir = Path(out_dir).resolve()
    found = Discovery()
    entries: list[tuple[Path, PurePosixPath]] = []
    seen: set[Path] = set()
    for given in inputs:
        path = Path(given)
        if not path.exists():
            raise InputError(f"{given}: no such file or folder")
        if _inside(path.resolve(), out_dir):
            raise InputError(f"{given} is inside the output folder {out_dir}; choose another --out")
        if path.is_dir():
            candidates = [(f, PurePosixPath(f.relative_to(path).as_posix())) for f in _walk(path, out_dir)]
        else:
            candidates = [(path, PurePosixPath(path.name))]
        for source, rel_file in candidates:
            if not is_image_path(source):
                found.not_images.append(source)
                continue
            if not source.is_file():  # a FIFO named x.png would block the run on open
                found.special.append(source)
                continue
            key = source.resolve()
            if _inside(key, out_dir):  # a symlink into the outputs
                continue
            if key not in seen:
                seen.add(key)
                entries.append((source, rel_file))
    found.jobs = _assign_stems(entries)
    return found
