"""FG-OVD (fine-grained open-vocabulary detection) region-caption evaluation.

    from clipseg_sparse.evaluation.fgovd import evaluate_fgovd
    result = evaluate_fgovd(clip, [Path("transparency.json")], Path("coco"), "sclip", region="pool")
    result["metrics"]["transparency.top1@5"]
"""

from .data import (
    DIFFICULTY_SPLITS,
    SPLITS,
    Benchmark,
    BenchmarkFile,
    BenchmarkFormatError,
    MissingImageError,
    RegionAnnotation,
    read_benchmark,
    split_name,
)
from .evaluate import DEFAULT_NEGATIVES, REGIONS, evaluate_fgovd, region_embeddings
from .metrics import fgovd_metrics, positive_rank, rank_metrics

__all__ = [
    "DEFAULT_NEGATIVES",
    "DIFFICULTY_SPLITS",
    "REGIONS",
    "SPLITS",
    "Benchmark",  # old name of BenchmarkFile, one release
    "BenchmarkFile",
    "BenchmarkFormatError",
    "MissingImageError",
    "RegionAnnotation",
    "evaluate_fgovd",
    "fgovd_metrics",
    "positive_rank",
    "rank_metrics",
    "read_benchmark",
    "region_embeddings",
    "split_name",
]
