#!/usr/bin/env bash
# One prepared check for a lent GPU host (an H200 image: Python 3.12, torch 2.11+cu130, Triton 3.6, pytest-xdist,
# transformers, no package registry), run from the repository root:
#
#   bash tools/gpu_check.sh OUT_DIR              # one 600 s call: the parts' limits and the summary sum to 490 s
#   bash tools/gpu_check.sh --full OUT_DIR       # full grids and sweep, 200 training steps: limits sum to 49 min
#   bash tools/gpu_check.sh --dry-run [OUT_DIR]  # any machine: the plan, the time budget, which parts can run here
#
# Nothing is installed. The six packages run from their src/ folders; pure-Python modules the image lacks
# (prefetch_generator, nvidia-ml-py) come from .gpu-site/ when it was carried (tools/gpu_wheels.sh builds it; it
# is put on PYTHONPATH, not installed). A part whose modules are missing is skipped with a one-line reason.
#
# Parts, in order, limits in seconds (default / --full). Each part runs in its own session and process group
# (setsid); when it ends, or at its limit (SIGTERM, then SIGKILL 5 s later), its whole process group is killed, so
# no pytest-xdist worker or compile process outlives its part and skews the next one. An interrupt of this script
# kills the running part's group too.
#   env            10 /   10  nvidia-smi, Python, torch, triton
#   kernel-tests  190 / 1500  alibi-kernels' gpu-marked tests, ALIBI_KERNELS_AUTOTUNE=0, pytest-xdist where there:
#                             the fp16/bf16 grid up to T=4096 and packed documents (quick / full grid), the
#                             long-range case (slopes 2^-0.5, 2^-4, 2^-8, 0; 1024 of 8192 keys; full: 8192 queries
#                             too) with slope gradients, every launchable config per dtype and head dim, fp32 with
#                             slope gradients, the autotuned configs, the auto backend
#   kernel-bench  130 /  900  Triton vs SDPA (float-mask ALiBi) vs FlexAttention, bf16, causal: TFLOP/s of the forward
#                             and forward+backward, each beside its max error vs float64 (output and gradients)
#   gpumon         45 /   60  tools/check_gpumon_nvml.py --load (needs pynvml from nvidia-ml-py; 32.6 s on the H200
#                             host, its 25 s limit killed it the first time)
#   gpu-tests      45 /  120  the gpu- and triton-marked tests of lmcore, tokbin and gpumon (one pytest per package);
#                             lmcore's include tracing the model with fullgraph=True on the Triton path, dense and
#                             with documents (about 7 s there before the Triton path became custom operators)
#   train          60 /  360  lmtrain prepare (400 files of this Python's standard library) then lmtrain train,
#                             preset 125m, bf16, Triton attention, 20 / 200 steps (needs sentencepiece)
#   summary        10 /   10  OUT_DIR/summary.md for docs/benchmarks.md
# A part stops at most 6 s after its limit (1 s polling, 5 s between SIGTERM and SIGKILL): 490 + 6 x 6 = 526 s at
# worst. OUT_DIR gets one log per part and summary.md.
#
# Estimate for kernel-tests (never timed on a GPU): about 180 compilations (60 for the dense and packed grids,
# `python tools/gpu_check_kernels.py --quick --count-compiles`; up to 81 for the 27 per-config cases; 27 for
# autotuning; about 12 for the rest), at the 5.7 CPU seconds one sm_90 compile took on the 2-core build machine
# under load, over 12 pytest-xdist workers: about 90 s, plus worker start-up and the float64 references
# (the largest, 4 heads x 1024 x 8192, is a few hundred MB): 100-150 s against its 190 s.
set -u
FULL=0
DRY=0
OUT_DIR=/tmp/gpu-check
for arg in "$@"; do
  case $arg in
    --full) FULL=1 ;;
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,9p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: error: unknown option $arg (expected --full, --dry-run or -h)" >&2; exit 2 ;;
    *) OUT_DIR=$arg ;;
  esac
done
COMMAND_LINE="bash tools/gpu_check.sh $*"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR" || exit 1
WORK=$(mktemp -d /tmp/gpu-check-work.XXXXXX)  # steps.txt, the corpus, the token files, the training run
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
SITE=""
[ -d "$ROOT/.gpu-site" ] && SITE="$ROOT/.gpu-site"
for pkg in alibi-kernels tokbin lmcore trainloop gpumon lmtrain; do
  SITE="$ROOT/packages/$pkg/src${SITE:+:$SITE}"
done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if [ "$FULL" = 1 ]; then
  GRID=full STEPS=200 LIMITS=(10 1500 900 60 120 360 10) BENCH=()
else
  GRID=quick STEPS=20 LIMITS=(10 190 130 45 45 60 10) BENCH=(--quick)
fi
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 12 --dist loadgroup)  # compiles are CPU-bound: 12 of 16 cores

CURRENT_PGID=""
kill_group() {  # the whole process group of the running part: SIGTERM, then SIGKILL after 5 s
  local pgid=$1
  kill -TERM -- "-$pgid" 2>/dev/null || return 0
  for _ in 1 2 3 4 5; do
    kill -0 -- "-$pgid" 2>/dev/null || return 0
    sleep 1
  done
  kill -KILL -- "-$pgid" 2>/dev/null
  return 0
}
trap '[ -n "$CURRENT_PGID" ] && kill_group "$CURRENT_PGID"; rm -rf "$WORK"; exit 130' INT TERM

missing() {  # missing MODULE...: prints the modules this Python cannot import
  "$PY" - "$@" <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
}

part() {  # part NAME LIMIT "MODULES" CMD...: CMD in its own session under LIMIT; records NAME EXIT SECONDS LIMIT
  local name=$1 limit=$2 needs=$3
  shift 3
  local absent command="$*"
  absent=$(missing $needs)
  echo "=== $name (limit ${limit}s): ${command:0:160}$([ ${#command} -gt 160 ] && echo ...)"
  if [ -n "$absent" ]; then
    echo "=== $name: skipped, this Python lacks: $absent"
    echo "$name skipped - $limit missing:${absent// /,}" >>"$WORK/steps.txt"
    return
  fi
  if [ "$DRY" = 1 ]; then
    echo "$name planned - $limit" >>"$WORK/steps.txt"
    return
  fi
  local start=$SECONDS rc
  setsid "$@" >"$OUT_DIR/$name.log" 2>&1 &
  CURRENT_PGID=$!
  while kill -0 "$CURRENT_PGID" 2>/dev/null && [ $((SECONDS - start)) -lt "$limit" ]; do
    sleep 1
  done
  if kill -0 "$CURRENT_PGID" 2>/dev/null; then
    kill_group "$CURRENT_PGID"
    wait "$CURRENT_PGID" 2>/dev/null
    rc=124
    echo "=== $name: killed at its limit (process group $CURRENT_PGID)" | tee -a "$OUT_DIR/$name.log"
  else
    wait "$CURRENT_PGID"
    rc=$?
    kill -KILL -- "-$CURRENT_PGID" 2>/dev/null  # anything the part left behind in its group
  fi
  CURRENT_PGID=""
  tail -n 25 "$OUT_DIR/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  echo "$name $rc $((SECONDS - start)) $limit" >>"$WORK/steps.txt"
}

TORCH="import torch, triton, sys; print('Python', sys.version.split()[0], 'torch', torch.__version__, "
TORCH+="'CUDA', torch.version.cuda, 'triton', triton.__version__)"
SMI="nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv"
part env "${LIMITS[0]}" "torch triton" bash -c "$SMI; $PY -c \"$TORCH\""
part kernel-tests "${LIMITS[1]}" "torch triton pytest numpy" env ALIBI_KERNELS_AUTOTUNE=0 ALIBI_KERNELS_GPU_GRID=$GRID \
  "$PY" -m pytest packages/alibi-kernels/tests -m gpu -q -p no:cacheprovider -rfE --durations=10 "${XDIST[@]}"
part kernel-bench "${LIMITS[2]}" "torch triton" "$PY" packages/alibi-kernels/benchmarks/bench_attention.py "${BENCH[@]}"
part gpumon "${LIMITS[3]}" "torch pynvml psutil" "$PY" tools/check_gpumon_nvml.py --load --seconds 2
# One pytest per package: each reads its own pytest settings, and test file names repeat across packages.
GPU_TESTS='rc=0; for p in lmcore tokbin gpumon; do (cd "packages/$p" && "$0" -m pytest tests -q -m "gpu or triton" -rfE \
  -p no:cacheprovider) || rc=1; done; exit $rc'
part gpu-tests "${LIMITS[4]}" "torch pytest numpy sentencepiece prefetch_generator pynvml psutil" \
  env ALIBI_KERNELS_AUTOTUNE=0 bash -c "$GPU_TESTS" "$PY"
# A real corpus with no download: the standard library source of this Python.
TRAIN='set -e; "$0" - "$1/corpus.txt" <<PYEOF
import pathlib, sys, sysconfig
lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
files = sorted(p for p in lib.rglob("*.py") if "test" not in p.parts)
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for p in files[:400]:
        out.write(p.read_text(encoding="utf-8", errors="replace") + "\n")
PYEOF
"$0" -m lmtrain prepare --text "$1/corpus.txt" --out "$1/data" --vocab-size 4000
ALIBI_KERNELS_AUTOTUNE=0 "$0" -m lmtrain train --data "$1/data" --out "$1/run" --preset 125m --max-steps "$2" \
  --gpumon --set precision=bf16 --set attention_backend=triton --set log_every=5 --set eval_every=0 --set save_every=0'
part train "${LIMITS[5]}" "torch numpy sentencepiece prefetch_generator pynvml psutil safetensors tqdm" \
  bash -c "$TRAIN" "$PY" "$WORK" "$STEPS"

summary() {
  echo "## GPU check: \`$COMMAND_LINE\`"
  echo
  echo "$(date -u +'%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  grep -v '^===' "$OUT_DIR/env.log" 2>/dev/null
  echo
  echo "| part | exit | seconds | limit |"
  echo "| --- | --- | --- | --- |"
  awk '{ print "| " $1 " | " $2 " | " $3 " | " $4 " |" }' "$WORK/steps.txt"
  echo
  grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT_DIR/kernel-tests.log" 2>/dev/null | tail -n 3
  echo
  grep -E '^(\||command:|GPU |D=)' "$OUT_DIR/kernel-bench.log" 2>/dev/null
  echo
  grep -E '^(\||GPU 0)' "$OUT_DIR/gpumon.log" 2>/dev/null
  if [ -f "$WORK/run/metrics.jsonl" ]; then
    echo
    echo "Training, \`lmtrain train --preset 125m --max-steps $STEPS\`, bf16, Triton attention:"
    echo
    "$PY" - "$WORK/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
print("| step | loss | tokens/s | MFU | max memory GiB |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    if "tokens_per_s" in r:
        mfu = f"{r['mfu']:.3f}" if "mfu" in r else "-"
        mem = f"{r['memory_bytes'] / 2**30:.1f}" if r.get("memory_bytes") else "-"
        print(f"| {r['step']} | {r['loss']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | {mem} |")
PY
  fi
}

if [ "$DRY" = 1 ]; then
  echo
  echo "plan ($([ "$FULL" = 1 ] && echo full || echo default)): part, state here, limit (s)"
  awk '{ printf "  %-13s %-8s %5s %s\n", $1, $2, $4, $5 }' "$WORK/steps.txt"
  awk -v summary="${LIMITS[6]}" '{ s += $4; n += 1 } END {
    print "sum of the limits: " s " s + summary " summary " s = " s + summary " s; at worst " s + summary + 6 * n \
      " s with 6 s of polling and kill grace per part (one device call: 600 s)" }' "$WORK/steps.txt"
  echo "pytest-xdist here: $([ ${#XDIST[@]} -gt 0 ] && echo "yes (${XDIST[*]})" || echo "no (kernel tests in one process)")"
  echo ".gpu-site (carried pure-Python modules): $([ -d "$ROOT/.gpu-site" ] && echo present || echo absent)"
  bash -n "$0" && echo "bash -n tools/gpu_check.sh: ok"
  "$PY" tools/gpu_check_kernels.py --dry-run $([ "$FULL" = 1 ] || echo --quick)
  rm -rf "$WORK"
  exit 0
fi

start=$SECONDS
summary 2>&1 | tee "$OUT_DIR/summary.md"  # text processing of the logs: seconds, within its budgeted limit
echo "=== summary: $((SECONDS - start)) s (limit ${LIMITS[6]} s); total $SECONDS s"
bad=$(awk '$2 != 0 && $2 != "skipped" { bad = 1 } END { print bad + 0 }' "$WORK/steps.txt")
rm -rf "$WORK"
exit "$bad"
