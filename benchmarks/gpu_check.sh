#!/usr/bin/env bash
# One-shot GPU check (< 10 minutes on one modern GPU): CUDA exactness tests, then the benchmarks in
# fp16 / bf16 / fp32, then the precision suite (fp16 and bf16 against fp32: speed, roofline, accuracy). Run from the repository root:   bash benchmarks/gpu_check.sh
# Results go to $OUT/gpu_check.txt when $OUT is set (the device tool's output folder), else to
# benchmarks/results/gpu_check-<date>.txt.
#
# The GPU machine may be offline: it needs torch with CUDA (and triton for AdaSplash) already installed.
# Pure-python dependencies that are missing are installed from benchmarks/wheels/ if that folder exists;
# fill it beforehand on a connected machine with
#   pip download --no-deps -d benchmarks/wheels adasplash entmax open_clip_torch ftfy wcwidth typer rich \
#       shellingham markdown-it-py mdurl pygments safetensors huggingface_hub timm
set -uo pipefail
PY=${PYTHON:-python3}
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
LOG="$DEST/gpu_check.txt"
[ -z "${OUT:-}" ] && LOG="$DEST/gpu_check-$(date +%Y%m%d-%H%M).txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
exec > >(tee "$LOG") 2>&1

step() { echo; echo "=== $* ($(date +%T))"; }

step environment
nvidia-smi -L 2>/dev/null || echo "nvidia-smi not found"
if [ -d benchmarks/wheels ]; then
  $PY -m pip install -q --no-index --find-links benchmarks/wheels --no-deps benchmarks/wheels/*.whl 2>&1 | tail -3
fi
$PY - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported())
for name in ("triton", "adasplash", "entmax", "open_clip", "typer", "rich", "pytest"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "installed"))
    except Exception as e:
        print(name, "MISSING:", e)
PY

step "exactness tests on CUDA (tests/runtime/test_accel.py) and the normalizer suite"
timeout 150 $PY -m pytest -q -rs tests/runtime/test_accel.py tests/attention/test_normalizers.py

for prec in fp16 bf16 fp32; do
  step "(a) normalizers on cuda $prec"
  timeout 90 $PY benchmarks/normalizers.py --device cuda --precision $prec --sizes 224 448 --repeat 5
done
for prec in fp16 bf16; do
  step "(b) forward ViT-B-16 448 px batch 8 on cuda $prec"
  timeout 60 $PY benchmarks/forward.py --device cuda --precision $prec --batch 8 --repeat 5
done
step "(c) segment vs bare model, ViT-B-16, 150 classes, cuda fp16"
timeout 60 $PY benchmarks/segment.py --device cuda --precision fp16 --images 8
step "(c) ViT-L-14 at 448 px, 150 classes, cuda bf16"
timeout 60 $PY benchmarks/segment.py --model ViT-L-14 --resolution 448 --device cuda --precision bf16 --images 4
step "precision suite on cuda: fp16 and bf16 against fp32 (forward at 448 px with roofline lines, accuracy, text, segment)"
for low in fp16 bf16; do
  step "(p) benchmarks/precision.py --device cuda --low $low, ViT-B-16 and ViT-L-14"
  timeout 180 $PY benchmarks/precision.py --device cuda --low $low --models ViT-B-16 ViT-L-14 --repeat 5 --prompts 960 --images 4
done
step "done; log in $LOG"
