"""Segmenting many images into an output folder: plan (what is done, what conflicts), run, summarise.

A run is resumable: an image whose record (`c.json`) was made with the same settings and whose files all
exist is skipped, so re-running an interrupted command finishes the rest. A bad image is reported and
the run goes on; so does an image too large for the memory left (one failed item).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..runtime.atomic import claim, claim_tag
from ..runtime.distributed import barrier, gather, rank_and_world, shard
from .inputs import ImageJob, safe_output_base
from ..segment.images import ImageReadError, load_image
from ..segment.labels import NonFiniteScores
from ..segment.segmenter import Segmenter
from .outputs import ClaimConflictError, OutputOptions, Status, prediction_key, read_record, write_outputs


@dataclass
class Plan:
    """The jobs of a run, split by what their output files say. `conflicts` holds (job, reason)."""

    out_dir: Path
    todo: list[ImageJob] = field(default_factory=list)
    done: list[ImageJob] = field(default_factory=list)
    conflicts: list[tuple[ImageJob, str]] = field(default_factory=list)

    def base(self, job: ImageJob) -> Path:
        return safe_output_base(self.out_dir, job.rel)


def plan_run(jobs: Sequence[ImageJob], out_dir: str | Path, options: OutputOptions, settings: dict) -> Plan:
    """Classify each job by the state of its outputs; images to resume count as to do."""
    plan = Plan(Path(out_dir))
    for job in jobs:
        status, reason = options.status(plan.base(job), settings)
        if status is Status.done:
            plan.done.append(job)
        elif status is Status.conflict:
            plan.conflicts.append((job, reason))
        else:
            plan.todo.append(job)
    return plan


@dataclass
class RunReport:
    """records: the JSON record of every image now complete (segmented now or before); failed: (file, reason);
    elsewhere: images another run on the same output folder was segmenting (it writes them)."""

    segmented: int = 0
    skipped: int = 0
    elsewhere: int = 0
    failed: list[tuple[Path, str]] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    @classmethod
    def merged(cls, reports: Sequence["RunReport"]) -> "RunReport":
        """One report of the reports of several ranks."""
        return cls(
            segmented=sum(r.segmented for r in reports),
            skipped=sum(r.skipped for r in reports),
            elsewhere=sum(r.elsewhere for r in reports),
            failed=[f for r in reports for f in r.failed],
            records=[rec for r in reports for rec in r.records],
        )

    def class_fractions(self, class_names: Sequence[str]) -> dict[str, float]:
        """Mean over complete images of each class's pixel fraction (0 where absent), largest first."""
        totals = dict.fromkeys(class_names, 0.0)
        for record in self.records:
            for entry in record["classes_present"]:
                totals[entry["name"]] = totals.get(entry["name"], 0.0) + entry["fraction"]
        n = max(len(self.records), 1)
        return dict(sorted(((k, v / n) for k, v in totals.items()), key=lambda kv: -kv[1]))


def run_plan(
    segmenter: Segmenter,
    plan: Plan,
    options: OutputOptions,
    on_image: Callable[[ImageJob, str | None], None] = lambda job, error: None,
) -> RunReport:
    """Segment every job to do and write its outputs; call `on_image(job, error_or_None)` after each.

    Under torchrun (every rank planned the same run) each rank segments every world-th image to do,
    rank 0 counts the images done before, and every rank returns the report of all ranks.
    """
    barrier()  # every rank has planned before any rank claims an image
    rank, world = rank_and_world()
    done = plan.done if rank == 0 else []
    report = RunReport(skipped=len(done))
    report.records = [read_record(plan.base(job)) for job in done]
    settings = segmenter.config()

    def one(job: ImageJob) -> bool:
        """Segment a claimed image unless another run finished it since the plan (True; with other settings:
        a conflict)."""
        status, reason = options.status(plan.base(job), settings)
        if status is Status.conflict:  # a run with other settings wrote it since this one planned
            raise ClaimConflictError(reason)
        if status is Status.done:  # another run with these settings finished it since the plan
            report.records.append(read_record(plan.base(job)))
            on_image(job, None)
            return True
        try:
            rgb = load_image(job.source)
        except (ImageReadError, OSError) as e:
            report.failed.append((job.source, str(e)))
            on_image(job, str(e))
            return False
        try:
            result = segmenter.predict(rgb, str(job.rel))
            report.records.append(write_outputs(plan.base(job), job.source, rgb, result, options))
        except NonFiniteScores as e:  # a spec with no finite score: this image fails, nothing is written
            report.failed.append((job.source, f"{job.source}: {e}"))
            on_image(job, f"{job.source}: {e}")
            return False
        except (MemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            height, width = rgb.shape[:2]
            reason = f"{job.source}: out of memory on this {width}x{height} image ({str(e).strip().splitlines()[0][:200]})"
            report.failed.append((job.source, reason))
            on_image(job, reason)
            return False
        report.segmented += 1
        on_image(job, None)
        return False

    held = []  # images another run with these settings was segmenting: checked once it is done with each
    tag = prediction_key(settings)
    for job in shard(plan.todo, rank, world):
        with claim(plan.base(job), tag) as mine:
            if mine:
                report.skipped += one(job)
                continue
            if claim_tag(plan.base(job)) not in ("", tag):  # the first run on the folder goes on, this one stops
                raise ClaimConflictError(f"{job.source}: another run on this --out with other settings is segmenting it")
            held.append(job)
    for job in held:
        with claim(plan.base(job), tag, wait=True):
            report.elsewhere += one(job)  # the other run wrote it, with these settings
    return RunReport.merged(gather(report)) if world > 1 else report


def out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: numpy's MemoryError, torch's CPU allocator or a GPU running out of memory."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "out of memory" in text or "can't allocate memory" in text
