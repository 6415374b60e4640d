"""Benchmark readers (a registry), their class names, and dataset conversion.

    from clipseg_sparse.datasets import DATASETS
    bench = DATASETS.get("ade20k")
    for sample in bench.samples("/data/ade"):          # Sample(id, image, label)
        labels = bench.load_label(sample.label)        # H x W int64, 0..149 and 255 = ignore
"""

from .benchmarks import DATASETS, IGNORE_INDEX, Benchmark, Sample
from .classnames import NAME_SETS, class_vocabulary, display_labels
from .errors import DatasetError

__all__ = ["DATASETS", "IGNORE_INDEX", "Benchmark", "Sample", "NAME_SETS", "class_vocabulary", "display_labels", "DatasetError"]
