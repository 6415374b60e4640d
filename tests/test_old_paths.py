"""The module paths of the previous release still import for one release, each with a DeprecationWarning."""

from __future__ import annotations

import json
import subprocess
import sys

import clipseg_sparse

# names users and the previous README imported from the old paths
OLD_NAMES = {
    "inference": ["Segmenter", "InferenceSettings", "to_pixels", "resized_shape", "SegmentationResult"],
    "model": ["load_clip", "DenseCLIP"],
    "regions": ["RegionFolder", "open_regions"],
    "accel": ["attention_backend"],
    "normalizers": ["entmax", "normalize", "Normalizer"],
    "evaluate": ["evaluate"],
    "explain": ["explain"],
    "bench_ttfm": ["bench_ttfm"],
    "models.towers": ["model_family", "Family", "TimmTower", "TowerBlock", "TowerAttention"],
}

CHECK = """
import importlib, json, sys, warnings
problems = {}
for old, names in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module = importlib.import_module(f"clipseg_sparse.{old}")
        except Exception as e:
            problems[old] = repr(e)
            continue
    if not any(issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message) for w in caught):
        problems[old] = "no DeprecationWarning"
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        problems[old] = f"missing {missing}"
print(json.dumps(problems))
"""


def test_every_old_path_imports_with_a_deprecation_warning():
    """In a fresh interpreter (nothing imported yet), every entry of `_MOVED`: it imports, warns, and keeps
    the names the previous release's README used."""
    wanted = {old: OLD_NAMES.get(old, []) for old in clipseg_sparse._MOVED}
    assert set(OLD_NAMES) <= set(wanted)
    run = subprocess.run([sys.executable, "-c", CHECK, json.dumps(wanted)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == {}
