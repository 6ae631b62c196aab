#!/usr/bin/env bash
# Start the 1.3B run on the 4 x 4 RTX 3090 cluster: one `torchrun` per node, c10d rendezvous on the
# master (first host of the hostfile), restarts on failure, every restart resuming from the latest
# checkpoint. See docs/cluster-3090.md.
#
#   tools/cluster-3090/launch.sh --data DATA_DIR --out RUN_DIR [options] [-- extra `lmtrain train` args]
#
# options:
#   --dry-run           print the command each node would run, run nothing
#   --all               start every node from here over ssh (default: only this node; run it on each)
#   --hostfile FILE     default: tools/cluster-3090/hostfile
#   --max-restarts N    torchrun restarts of the whole worker group after a failure (default 3)
#   --run-id ID         rendezvous id, the same on every node (default: the basename of RUN_DIR)
#   --join-timeout S    how long a node waits for the others at (re)rendezvous (default 900)
set -euo pipefail

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${KIT}/../.." && pwd)"
DRY_RUN=0 ALL=0 HOSTFILE="${KIT}/hostfile" MAX_RESTARTS=3 RUN_ID="" JOIN_TIMEOUT=900 DATA="" OUT=""
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --all) ALL=1; shift ;;
        --hostfile) HOSTFILE="$2"; shift 2 ;;
        --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
        --run-id) RUN_ID="$2"; shift 2 ;;
        --join-timeout) JOIN_TIMEOUT="$2"; shift 2 ;;
        --data) DATA="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ -z "${DATA}" ] || [ -z "${OUT}" ]; then
    echo "launch.sh: --data DATA_DIR and --out RUN_DIR are required (see --help)" >&2
    exit 2
fi
if [ ! -f "${HOSTFILE}" ]; then
    echo "launch.sh: hostfile ${HOSTFILE} not found" >&2
    exit 2
fi
RUN_ID="${RUN_ID:-$(basename "${OUT}")}"

# hostfile lines: "host slots=N"; comments and blank lines skipped.
mapfile -t HOSTS < <(grep -v '^\s*#' "${HOSTFILE}" | awk 'NF {print $1}')
mapfile -t SLOTS < <(grep -v '^\s*#' "${HOSTFILE}" | awk 'NF {s = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) {split($i, a, "="); s = a[2]}; print s}')
NNODES=${#HOSTS[@]}
if [ "${NNODES}" -eq 0 ]; then
    echo "launch.sh: no hosts in ${HOSTFILE}" >&2
    exit 2
fi
for s in "${SLOTS[@]}"; do
    if [ "${s}" != "${SLOTS[0]}" ]; then
        echo "launch.sh: every host needs the same slots= (torchrun starts the same number per node)" >&2
        exit 2
    fi
done
NPROC="${SLOTS[0]}"
MASTER_ADDR="${MASTER_ADDR:-${HOSTS[0]}}"
MASTER_PORT="${MASTER_PORT:-29500}"

node_command() {
    # What node $1 runs: the same on every node; c10d assigns the node ranks.
    local q_extra=""
    if [ ${#EXTRA[@]} -gt 0 ]; then q_extra=" $(printf '%q ' "${EXTRA[@]}")"; fi
    printf 'cd %q && export LMTRAIN_HOSTFILE=%q MASTER_ADDR=%q MASTER_PORT=%q && source %q && ' \
        "${REPO}" "${HOSTFILE}" "${MASTER_ADDR}" "${MASTER_PORT}" "${KIT}/env.sh"
    printf 'torchrun --nnodes=%s --nproc-per-node=%s --rdzv-backend=c10d --rdzv-endpoint=%s:%s ' \
        "${NNODES}" "${NPROC}" "${MASTER_ADDR}" "${MASTER_PORT}"
    printf -- '--rdzv-id=%q --rdzv-conf=join_timeout=%s --max-restarts=%s --monitor-interval=5 ' \
        "${RUN_ID}" "${JOIN_TIMEOUT}" "${MAX_RESTARTS}"
    # --resume on every start: a restart after a node failure continues from the latest checkpoint
    # (a first start with no checkpoint begins at step 0).
    printf -- '-m lmtrain train --data %q --out %q --model-config %q --deepspeed %q --resume%s\n' \
        "${DATA}" "${OUT}" "${KIT}/config.json" "${KIT}/ds_config.json" "${q_extra% }"
}

if [ "${DRY_RUN}" = "1" ]; then
    echo "# ${NNODES} nodes x ${NPROC} GPUs, rendezvous ${MASTER_ADDR}:${MASTER_PORT} (c10d), run id ${RUN_ID}"
    for i in "${!HOSTS[@]}"; do
        echo "[${HOSTS[$i]}] $(node_command "${HOSTS[$i]}")"
    done
    exit 0
fi

if [ "${ALL}" = "1" ]; then
    pids=()
    for host in "${HOSTS[@]}"; do
        echo "launch.sh: starting ${host}" >&2
        # -tt would tie the job to this terminal; plain ssh keeps its output streaming here.
        ssh -o BatchMode=yes "${host}" "bash -lc $(printf '%q' "$(node_command "${host}")")" 2>&1 | sed "s/^/[${host}] /" &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done
    exit "${status}"
fi

exec bash -c "$(node_command "$(hostname)")"
