#!/usr/bin/env bash
# One prepared check for a lent GPU host, run from the repository root:
#
#   bash tools/gpu_check.sh --quick OUT_DIR              # every part capped; the caps sum to 570 s: one 10-minute call
#   bash tools/gpu_check.sh OUT_DIR                      # full grid and sweep, 200 training steps: caps sum to 54 min
#   bash tools/gpu_check.sh --quick --dry-run [OUT_DIR]  # any machine: the plan, then each part's CPU path
#
# Parts, in order. Each runs under a hard `timeout -k 5 LIMIT` that kills the part with its child processes, and the
# next part still runs. Limits in seconds, --quick / full:
#   env             10 /   10  nvidia-smi, torch and triton versions
#   kernel-tests   170 / 1800  alibi-kernels' gpu-marked tests (tools/gpu_check_kernels.py): Triton vs float64 in
#                              fp16/bf16 up to T=4096 (dense grid 144 / 560 cases, packed documents 16 / 24), fp32
#                              with slope gradients, the autotuned configs, the auto backend: 170 / 595 tests
#   kernel-bench   140 /  900  Triton vs SDPA (float-mask ALiBi) vs FlexAttention (ALiBi score_mod), bf16, causal,
#                              D=128, T in {1024, 4096} (full: D in {64, 128}, T 512..8192): forward and
#                              forward+backward TFLOP/s (4*B*H*T^2*D halved for causal; 3.5x that for f+b)
#   gpumon          40 /   60  tools/check_gpumon_nvml.py --load: per-call cost and refresh rate of each metric
#   gpu-tests       90 /  120  the gpu-marked tests of lmcore, tokbin and gpumon (one pytest per package)
#   prepare         40 /   60  lmtrain prepare on 400 files of this Python's standard library (no download)
#   train           80 /  300  lmtrain train: preset 125m, bf16, attention_backend=triton, 20 / 200 steps, gpumon
# The --quick limits sum to 570 s, under the 600 s of one call; the full ones to 54 minutes. Then a markdown
# summary for docs/benchmarks.md (OUT_DIR/summary.md): this command line, the GPU, each part's exit code and
# seconds, the benchmark and gpumon tables and the training figures. OUT_DIR holds 8 files: 7 logs, summary.md.
#
# --quick estimate, about 6 minutes (an estimate: nothing here has been timed on a GPU). Its basis:
# - Triton compiles one kernel per config and argument specialisation. The kernels leave lengths and head counts
#   unspecialised, so `python tools/gpu_check_kernels.py --quick --count-compiles` counts 60 compilations for the
#   160 grid cases (480 launches). The other gpu tests add 36 (autotuning: 3 head dims x 3 kernels x 4 configs),
#   8 (autotuned forward, packed and alone), about 8 more (fp32, the auto backend): about 112 in all. One
#   compilation for sm_90 costs about 5.7 CPU seconds on the 2-core build machine (tests/compile_for_cuda.py:
#   12 compilations, 67.8 s user + 1.3 s system, interpreter start-up included); the GPU host's cores are taken
#   as no slower. With 8 pytest-xdist workers, cases that share kernels grouped on one worker, that is about
#   80 s of compiling per worker; the longest group (autotuning, 12 compilations) about 70 s. Running the cases
#   adds little: the largest float64 reference (T=4096, 12 heads, D=128) is ~0.4 TFLOP and ~20 GB of memory
#   traffic, tens of milliseconds. Expected 100-130 s, with worker start-up, under the 170 s limit.
# - Benchmark, autotuning on (its figures are the tuned kernels'): its 12 compilations for bf16 D=128 are those
#   of the autotuned test, cached on disk (~/.triton/cache) by then; 4 FlexAttention graphs (forward and
#   backward at 2 lengths, torch.compile) at about 15 s each; the timings themselves a few seconds: about 90 s.
# - gpumon: 8 metric groups x 2 s, 5 s load start, 8 x 200 timed calls: about 30 s. The other packages' gpu tests
#   (10 tests; lmcore's 7 need about 10 compilations with autotuning off, on 4 workers): about 50 s. prepare:
#   3.3 CPU seconds here (28 s of wall time at load average 13). train: start-up, 3 compilations (likely cached by
#   then), 20 steps of 32k tokens (about 24 TFLOP each), a checkpoint: about 45 s.
# Tests and the training run use ALIBI_KERNELS_AUTOTUNE=0 in --quick (autotuning would multiply their
# compilations by 4); the benchmark autotunes.
#
# The host needs torch, triton, sentencepiece, safetensors, numpy, nvidia-ml-py, psutil, matplotlib, tqdm and
# pytest (pytest-xdist if there). Wheels that are missing there (prefetch_generator) are built here by
# tools/gpu_wheels.sh into .whl/ and installed from it; the six packages are used from their src/ folders.
set -u
QUICK=0
DRY=0
OUT_DIR=/tmp/gpu-check
for arg in "$@"; do
  case $arg in
    --quick) QUICK=1 ;;
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,6p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: error: unknown option $arg (expected --quick, --dry-run or -h)" >&2; exit 2 ;;
    *) OUT_DIR=$arg ;;
  esac
done
COMMAND_LINE="bash tools/gpu_check.sh $*"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
# OUT_DIR gets at most 8 files (a device call brings back 8): the 7 part logs and summary.md.
mkdir -p "$OUT_DIR" || exit 1
WORK=$(mktemp -d /tmp/gpu-check-work.XXXXXX)  # steps.txt, the corpus, the token files, the training run
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl || exit 1
  export PYTHONPATH=$WORK/site
fi
for pkg in alibi-kernels tokbin lmcore trainloop gpumon lmtrain; do
  PYTHONPATH="$ROOT/packages/$pkg/src:${PYTHONPATH:-}"
done
export PYTHONPATH

if [ "$QUICK" = 1 ]; then
  GRID=--quick STEPS=20 AUTOTUNE=0 KT=170 KB=140 GM=40 GT=90 PR=40 TR=80
else
  GRID= STEPS=200 AUTOTUNE=1 KT=1800 KB=900 GM=60 GT=120 PR=60 TR=300
fi
XDIST=()  # lmcore's gpu tests (about 10 compilations) in 4 processes where pytest-xdist is installed
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)

step() {  # step NAME LIMIT CMD...: CMD under a hard limit, logged to OUT_DIR/NAME.log; records NAME EXIT SECONDS LIMIT
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  if [ "$DRY" = 1 ]; then
    echo "$name - - $limit" >>"$WORK/steps.txt"
    return
  fi
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  echo "$name $rc $((SECONDS - start)) $limit" >>"$WORK/steps.txt"
}

VERSIONS="import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, end=' ')"
VERSIONS+="; print('triton', triton.__version__)"
SMI="nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv"
step env 10 bash -c "$SMI && $PY -c \"$VERSIONS\""
step kernel-tests "$KT" "$PY" tools/gpu_check_kernels.py $GRID --skip-bench --timeout $((KT - 10))
step kernel-bench "$KB" "$PY" tools/gpu_check_kernels.py $GRID --skip-tests --timeout $((KB - 10))
step gpumon "$GM" "$PY" tools/check_gpumon_nvml.py --load --seconds 2
# One pytest per package: each reads its own pytest settings, and test file names repeat across packages.
GPU_TESTS='rc=0; for p in lmcore tokbin gpumon; do w=(); [ "$p" = lmcore ] && w=("$@")
  (cd "packages/$p" && "$0" -m pytest tests -q -m gpu -rfE -p no:cacheprovider "${w[@]}") || rc=1; done; exit $rc'
step gpu-tests "$GT" env ALIBI_KERNELS_AUTOTUNE=$AUTOTUNE bash -c "$GPU_TESTS" "$PY" "${XDIST[@]}"

# A real corpus with no download: the standard library source of this Python.
"$PY" - "$WORK/corpus.txt" <<'PY'
import pathlib, sys, sysconfig
lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
files = sorted(p for p in lib.rglob("*.py") if "test" not in p.parts)
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for p in files[:400]:
        out.write(p.read_text(encoding="utf-8", errors="replace") + "\n")
PY
step prepare "$PR" "$PY" -m lmtrain prepare --text "$WORK/corpus.txt" --out "$WORK/data" --vocab-size 4000
step train "$TR" env ALIBI_KERNELS_AUTOTUNE=$AUTOTUNE "$PY" -m lmtrain train --data "$WORK/data" --out "$WORK/run" \
  --preset 125m --max-steps "$STEPS" --gpumon --set precision=bf16 --set attention_backend=triton --set log_every=5 \
  --set eval_every=0 --set save_every=0

if [ "$DRY" = 1 ]; then
  awk '{ s += $4 } END { print "sum of the limits: " s " s" }' "$WORK/steps.txt"
  echo "=== CPU paths (no GPU here): each ends in a plan or its one-line no-GPU message"
  bash -n "$0" && echo "bash -n tools/gpu_check.sh: ok"
  "$PY" tools/gpu_check_kernels.py $GRID --dry-run --timeout $((KT - 10))
  "$PY" tools/gpu_check_kernels.py $GRID --skip-bench
  echo "gpu_check_kernels.py without CUDA: exit $?"
  "$PY" tools/check_gpumon_nvml.py --load --seconds 2
  echo "check_gpumon_nvml.py without a driver: exit $?"
  "$PY" -m lmtrain prepare --text "$WORK/corpus.txt" --out "$WORK/data" --vocab-size 4000 2>/dev/null
  echo "lmtrain prepare (the same command, on CPU): exit $?"
  "$PY" -m lmtrain train --help >/dev/null && echo "lmtrain train --help: ok (training itself needs the GPU)"
  rm -rf "$WORK"
  exit 0
fi

{
  echo "## GPU check: \`$COMMAND_LINE\`"
  echo
  echo "$(date -u +'%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  cat "$OUT_DIR/env.log"
  echo
  echo "| part | exit | seconds | limit |"
  echo "| --- | --- | --- | --- |"
  awk '{ print "| " $1 " | " $2 " | " $3 " | " $4 " |" }' "$WORK/steps.txt"
  echo
  grep -E '^(\||command:|GPU |D=)' "$OUT_DIR/kernel-bench.log"
  echo
  grep -E '^(\||GPU 0)' "$OUT_DIR/gpumon.log"
  echo
  echo "Training, \`lmtrain train --preset 125m --max-steps $STEPS\`, bf16, Triton attention:"
  echo
  "$PY" - "$WORK/run/metrics.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
except OSError as exc:
    sys.exit(f"no training figures ({exc.strerror}: {sys.argv[1]})")
print("| step | loss | tokens/s | MFU | max memory GiB |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    if "tokens_per_s" in r:
        mfu = f"{r['mfu']:.3f}" if "mfu" in r else "-"
        mem = f"{r['memory_bytes'] / 2**30:.1f}" if r.get("memory_bytes") else "-"
        print(f"| {r['step']} | {r['loss']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | {mem} |")
PY
  echo
  "$PY" -m gpumon summary "$WORK/run/gpumon.csv"
} 2>&1 | tee "$OUT_DIR/summary.md"
awk '$2 != 0 { bad = 1 } END { exit bad }' "$WORK/steps.txt"
