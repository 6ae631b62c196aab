#!/usr/bin/env bash
# The GPU paths gpu_check.sh leaves out, in one short call on a lent GPU host (run from the repository root):
#
#   bash tools/gpu_check_paths.sh OUT_DIR     # parts' limits sum to 350 s
#
# Parts (each in its own process group, killed at its limit; a part whose modules the image lacks is skipped):
#   base    120  a tiny random Qwen2 base written by transformers: lmtrain finetune --from DIR (LoRA, bf16, cuda),
#                export --merge-lora (Qwen2ForCausalLM, logits against transformers on cuda), generate --chat,
#                eval --text --device cuda --dtype bf16
#   fsdp     90  lmtrain finetune --engine fsdp under torchrun on one GPU (NCCL), LoRA on that base
#   compile 100  lmtrain train --preset 125m --compile (torch attention path, one graph), 10 bf16 steps
#   eval     40  lmtrain eval --device cuda --dtype bf16 and generate on the compile part's run; the device-side
#                check of an out-of-range token id (its message)
# The first run (docs/benchmarks.md, GPU figures) hit limits of 60, 50 and 70 s in the first three parts; these are
# wider. Nothing is installed: the packages run from src/, prefetch_generator and nvidia-ml-py from a carried .gpu-site/.
set -u
OUT_DIR=${1:-/tmp/gpu-check-paths}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR" || exit 1
WORK=$(mktemp -d /tmp/gpu-paths.XXXXXX)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 LMTRAIN_PROBE_CACHE="$WORK/probes.json"
SITE=""
[ -d "$ROOT/.gpu-site" ] && SITE="$ROOT/.gpu-site"
for pkg in alibi-kernels tokbin lmcore trainloop gpumon lmtrain; do
  SITE="$ROOT/packages/$pkg/src${SITE:+:$SITE}"
done
export PYTHONPATH="$ROOT/packages/lmtrain/tests:$SITE${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part NAME LIMIT CMD...: CMD in its own session under LIMIT; one row of the summary
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "=== $name (limit ${limit}s)"
  setsid "$@" >"$OUT_DIR/$name.log" 2>&1 &
  local pgid=$!
  while kill -0 "$pgid" 2>/dev/null && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 1; done
  if kill -0 "$pgid" 2>/dev/null; then
    kill -TERM -- "-$pgid" 2>/dev/null; sleep 3; kill -KILL -- "-$pgid" 2>/dev/null
    wait "$pgid" 2>/dev/null
    rc=124
  else
    wait "$pgid"
    rc=$?
  fi
  tail -n 15 "$OUT_DIR/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  echo "| $name | $rc | $((SECONDS - start)) | $limit |" >>"$WORK/rows.md"
}

BASE='set -e; "$0" - "$1" <<PYEOF
import json, sys
from pathlib import Path
from hf_base import write_qwen2_base
root = Path(sys.argv[1])
write_qwen2_base(root / "qwen", layers=4)
rows = [{"messages": [{"role": "user", "content": f"What is {i} times two?"},
                      {"role": "assistant", "content": f"It is {2 * i}."}], "group": f"g{i}"} for i in range(64)]
(root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(root / "text.txt").write_text("It is 6. It is 8.\n" * 200)
PYEOF
"$0" -m lmtrain finetune --from "$1/qwen" --data "$1/chat.jsonl" --out "$1/ft" --max-steps 20 --seq-len 64 \
  --set micro_batch=8 --set precision=bf16 --set lr=5e-3 --no-progress
"$0" -m lmtrain export --run "$1/ft" --out "$1/merged" --merge-lora
"$0" - "$1" <<PYEOF
import sys, torch
from transformers import AutoModelForCausalLM
from lmcore import merge_lora
from lmtrain.run_files import load_trained_model
model, _, _ = load_trained_model(sys.argv[1] + "/ft", "cuda")
merge_lora(model)
hf = AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/merged").cuda().eval()
ids = torch.randint(0, model.config.vocab_size, (2, 48), device="cuda")
torch.backends.cuda.matmul.allow_tf32 = False
with torch.no_grad():
    diff = (model(ids).logits - hf(ids).logits).abs().max().item()
print(f"merged export vs lmcore on cuda, fp32: max |logit difference| {diff:.3g}")
assert diff < 1e-4, diff
PYEOF
"$0" -m lmtrain generate --run "$1/ft" --chat --prompt "What is 7 times two?" --temperature 0 --max-new-tokens 8
"$0" -m lmtrain eval --run "$1/ft" --text "$1/text.txt" --device cuda --dtype bf16 --context 64'
part base 120 bash -c "$BASE" "$PY" "$WORK"

FSDP='"$0" -m torch.distributed.run --nproc_per_node 1 -m lmtrain finetune --from "$1/qwen" --data "$1/chat.jsonl" \
  --out "$1/ft-fsdp" --engine fsdp --max-steps 10 --seq-len 64 --set micro_batch=8 --set precision=bf16 --no-progress'
part fsdp 90 bash -c "$FSDP" "$PY" "$WORK"

COMPILE='set -e; "$0" - "$1/corpus.txt" <<PYEOF
from pathlib import Path
import sys
from lmtrain.corpus import build_corpus
build_corpus(Path(sys.argv[1]), 2_000_000)
PYEOF
"$0" -m lmtrain prepare --text "$1/corpus.txt" --out "$1/data" --vocab-size 4000 --quiet
"$0" -m lmtrain train --data "$1/data" --out "$1/run" --preset 125m --max-steps 10 --compile --no-progress \
  --set precision=bf16 --set attention_backend=torch --set log_every=2 --set eval_every=0 --set save_every=10'
part compile 100 bash -c "$COMPILE" "$PY" "$WORK"

EVAL='set -e; head -c 50000 "$1/corpus.txt" > "$1/val.txt"
"$0" -m lmtrain eval --run "$1/run" --text "$1/val.txt" --device cuda --dtype bf16
"$0" -m lmtrain generate --run "$1/run" --prompt "def main():" --device cuda --seed 0 --max-new-tokens 16
"$0" - <<PYEOF
import torch
from lmcore import GPT, ModelConfig
model = GPT(ModelConfig.from_preset("tiny")).cuda()
try:
    model(torch.tensor([[1, 500]], device="cuda")).logits.sum().item()
    print("out-of-range id: no error")
except Exception as exc:
    print("out-of-range id:", type(exc).__name__, str(exc).splitlines()[0][:300])
PYEOF'
part eval 40 bash -c "$EVAL" "$PY" "$WORK"

{
  echo "## GPU paths: \`bash tools/gpu_check_paths.sh\`"
  echo
  echo "$(date -u +'%Y-%m-%d %H:%M UTC'); $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| part | exit | seconds | limit |"
  echo "| --- | --- | --- | --- |"
  cat "$WORK/rows.md"
} | tee "$OUT_DIR/summary.md"
rm -rf "$WORK"
