#!/usr/bin/env bash
# One prepared check for a lent GPU host, run from the repository root:
#
#   bash tools/gpu_check.sh OUT_DIR
#
# 1. alibi-kernels: gpu-marked tests (Triton vs float64 reference, fp16/bf16, T up to 4096),
#    then the benchmark against PyTorch SDPA and FlexAttention (tools/gpu_check_kernels.py).
# 2. gpumon against the real driver: per-call cost and which metrics refresh at 100 Hz.
# 3. lmcore and tokbin gpu-marked tests (Triton inside the model, cached decoding, pinned loader).
# 4. A short training run with lmtrain on the GPU (bf16, torch engine), recorded by gpumon.
#
# The host needs torch, triton, sentencepiece, safetensors, numpy, nvidia-ml-py, psutil, matplotlib
# and tqdm. Wheels that are missing there (prefetch_generator) are built here by tools/gpu_wheels.sh
# into .whl/ and installed from it; the six packages are used from their src/ folders.
# Each step has its own time limit so one slow step cannot eat the whole lease.
set -u
OUT_DIR=${1:-/tmp/gpu-check}
mkdir -p "$OUT_DIR"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-check-site
fi
for pkg in alibi-kernels tokbin lmcore trainloop gpumon lmtrain; do
  PYTHONPATH="$ROOT/packages/$pkg/src:${PYTHONPATH:-}"
done
export PYTHONPATH

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  echo "$name $rc $((SECONDS - start))" >>"$OUT_DIR/steps.txt"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT_DIR/gpu.txt"

# The step limits add up to under 600 s: one device call.
step kernel-tests 150 python3 tools/gpu_check_kernels.py --quick --skip-bench
step kernel-bench 200 python3 tools/gpu_check_kernels.py --skip-tests
step gpumon 45 python3 tools/check_gpumon_nvml.py --load --seconds 3
step gpu-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider packages/lmcore/tests packages/tokbin/tests

# A real corpus with no download: the standard library source of this Python.
python3 - "$OUT_DIR/corpus.txt" <<'PY'
import pathlib, sys, sysconfig
lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
files = sorted(p for p in lib.rglob("*.py") if "test" not in p.parts)
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for p in files[:400]:
        out.write(p.read_text(encoding="utf-8", errors="replace") + "\n")
PY
step prepare 40 python3 -m lmtrain prepare --text "$OUT_DIR/corpus.txt" --out /tmp/gpu-check-data --vocab-size 4000
step train 90 python3 -m lmtrain train --data /tmp/gpu-check-data --out /tmp/gpu-check-run --preset 125m \
  --max-steps 40 --gpumon --set precision=bf16 --set log_every=5 --set eval_every=0 --set save_every=0
cp /tmp/gpu-check-run/metrics.jsonl "$OUT_DIR/train-metrics.jsonl" 2>/dev/null
python3 -m gpumon summary /tmp/gpu-check-run/gpumon.csv 2>&1 | tee "$OUT_DIR/train-gpumon-summary.txt"
cat "$OUT_DIR/steps.txt"
