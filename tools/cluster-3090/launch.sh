#!/usr/bin/env bash
# Start the 1.3B run on the 4 x 4 RTX 3090 cluster (or the 2.7B one on 8 x 4): one `torchrun` per node, c10d
# rendezvous on the master (first host of the hostfile), restarts on failure, every restart resuming from the
# latest checkpoint. See docs/cluster-3090.md.
#
#   tools/cluster-3090/launch.sh --data DATA_DIR --out RUN_DIR [options] [-- extra `lmtrain train` args]
#
# options:
#   --dry-run           print the command each node would run, run nothing
#   --recipe NAME       1.3b (default: config.json, ds_config.json) or 2.7b (preset 2.7b, ds_config_2.7b.json)
#   --all               start every node from here over ssh (default: only this node; run it on each)
#   --hostfile FILE     default: tools/cluster-3090/hostfile
#   --max-restarts N    torchrun restarts of the whole worker group after a failure (default 3)
#   --run-id ID         rendezvous id, the same on every node (default: the basename of RUN_DIR)
#   --join-timeout S    how long a node waits for the others at (re)rendezvous (default 900)
#   --cpu-rehearsal     rehearse the launch on CPUs: gloo, DS_ACCELERATOR=cpu, the tiny preset, and the
#                       kit's ds_config.json adapted to CPU and to the hostfile's world size
#                       (RUN_DIR/ds_config.cpu-rehearsal.json, written by cpu_rehearsal.py)
#
# Every value that reaches the node command is checked first (host names, slots=, ports, counts) or
# shell-quoted (paths, run id, extra arguments); a bad value stops here with one line and exit status 2.
#
# Exit status: torchrun's. 0 only for a finished run. A SIGTERM (a scheduler's preemption) or SIGHUP to this
# script, or a Ctrl-C, goes on to torchrun, which passes it to every rank: each saves a checkpoint and stops, and
# torchrun, signalled itself, exits 1; the run is not finished, and the same command resumes it. This node's
# launch.sh then says so in one line, when RUN_DIR/summary.json (written by the stop) names a complete checkpoint.
set -euo pipefail

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${KIT}/../.." && pwd)"
DRY_RUN=0 ALL=0 REHEARSAL=0 RECIPE=1.3b HOSTFILE="${KIT}/hostfile" MAX_RESTARTS=3 RUN_ID="" JOIN_TIMEOUT=900 DATA="" OUT=""
EXTRA=()

die() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

# Values as the user wrote them go into messages between quotes, with control characters made visible.
shown() { printf "'%s'" "$(printf '%s' "$1" | LC_ALL=C tr -c '[:print:]' '?')"; }

# A decimal integer without sign or leading zero, within [$2, $3].
is_uint_in() {
    [[ $1 =~ ^(0|[1-9][0-9]{0,8})$ ]] && [ "$1" -ge "$2" ] && [ "$1" -le "$3" ]
}

is_ipv4() {
    local octet='(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])'
    [[ $1 =~ ^${octet}(\.${octet}){3}$ ]]
}

is_ipv6() {
    local a=$1 part n=0 colons hex='^[0-9A-Fa-f]{1,4}(:[0-9A-Fa-f]{1,4})*$'
    [[ $a == *:* && $a =~ ^[0-9A-Fa-f:.]+$ && ${#a} -le 45 ]] || return 1
    if [[ $a == *.* ]]; then
        # An IPv4 tail (::ffff:192.0.2.1) stands for the last two groups.
        is_ipv4 "${a##*:}" || return 1
        a="${a%:*}:0:0"
    fi
    case $a in *::*::*) return 1 ;; esac
    if [[ $a == *::* ]]; then
        for part in "${a%%::*}" "${a#*::}"; do
            [ -z "${part}" ] && continue
            [[ $part =~ $hex ]] || return 1
            colons=${part//[^:]/}
            n=$((n + ${#colons} + 1))
        done
        [ "${n}" -le 7 ]
    else
        [[ $a =~ $hex ]] || return 1
        colons=${a//[^:]/}
        [ "${#colons}" -eq 7 ]
    fi
}

# RFC 1123 host name (labels of letters, digits and inner hyphens, 63 characters at most, 253 in all),
# an IPv4 address or an IPv6 address. A name of digits and dots must be a valid IPv4 address.
is_host() {
    local label='[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?'
    if [[ $1 =~ ^[0-9.]+$ ]]; then
        is_ipv4 "$1"
    elif [[ $1 == *:* ]]; then
        is_ipv6 "$1"
    else
        [[ ${#1} -le 253 && $1 =~ ^${label}(\.${label})*$ ]]
    fi
}

HOST_RULE="a host name (RFC 1123: letters, digits, inner '-', dot-separated labels), an IPv4 or an IPv6 address"

need_value() {
    [ "$2" -ge 2 ] || die "$1 needs a value (see --help)"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --all) ALL=1; shift ;;
        --cpu-rehearsal) REHEARSAL=1; shift ;;
        --hostfile) need_value "$1" $#; HOSTFILE="$2"; shift 2 ;;
        --recipe) need_value "$1" $#; RECIPE="$2"; shift 2 ;;
        --max-restarts) need_value "$1" $#; MAX_RESTARTS="$2"; shift 2 ;;
        --run-id) need_value "$1" $#; RUN_ID="$2"; shift 2 ;;
        --join-timeout) need_value "$1" $#; JOIN_TIMEOUT="$2"; shift 2 ;;
        --data) need_value "$1" $#; DATA="$2"; shift 2 ;;
        --out) need_value "$1" $#; OUT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $(shown "$1") (see --help)" ;;
    esac
done
[ -n "${DATA}" ] && [ -n "${OUT}" ] || die "--data DATA_DIR and --out RUN_DIR are required (see --help)"
is_uint_in "${MAX_RESTARTS}" 0 1000 || die "--max-restarts $(shown "${MAX_RESTARTS}") must be a whole number 0-1000"
is_uint_in "${JOIN_TIMEOUT}" 1 86400 || die "--join-timeout $(shown "${JOIN_TIMEOUT}") must be whole seconds 1-86400"
# Every node changes to the repository first, and --all runs elsewhere: relative paths are made absolute here.
absolute() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "${PWD}" "$1" ;; esac; }
DATA="$(absolute "${DATA}")" OUT="$(absolute "${OUT}")" HOSTFILE="$(absolute "${HOSTFILE}")"
RUN_ID="${RUN_ID:-$(basename "${OUT}")}"

# The hostfile: one "host slots=N" per line (DeepSpeed's format; slots= defaults to 1), '#' starts a comment.
[ -f "${HOSTFILE}" ] && [ -r "${HOSTFILE}" ] || die "hostfile ${HOSTFILE} cannot be read (no such file?): pass --hostfile FILE"
# Counted, not captured: a command substitution would drop a NUL byte.
if [ "$(LC_ALL=C tr -d '\t\n\r\040-\176\200-\377' < "${HOSTFILE}" | head -c 1 | wc -c)" -ne 0 ]; then
    die "hostfile ${HOSTFILE} holds control characters (a binary file?): expected text lines of \"host slots=N\""
fi
HOSTS=() SLOTS=()
lineno=0
while IFS= read -r line || [ -n "${line}" ]; do
    lineno=$((lineno + 1))
    line="${line%%#*}"
    line="${line//$'\r'/ }"
    read -r -a fields <<< "${line}"
    [ ${#fields[@]} -gt 0 ] || continue
    where="hostfile ${HOSTFILE} line ${lineno}"
    host="${fields[0]}"
    is_host "${host}" || die "${where}: host $(shown "${host}") is not ${HOST_RULE}; fix that line"
    for known in "${HOSTS[@]}"; do
        [ "${known}" != "${host}" ] || die "${where}: host $(shown "${host}") is listed twice; keep one line per node"
    done
    slots=1
    if [ ${#fields[@]} -gt 2 ]; then
        die "${where}: $(shown "${fields[2]}") after the slots: a line is \"host slots=N\"; remove it"
    elif [ ${#fields[@]} -eq 2 ]; then
        [[ ${fields[1]} == slots=* ]] || die "${where}: $(shown "${fields[1]}") is not slots=N: a line is \"host slots=N\""
        slots="${fields[1]#slots=}"
        is_uint_in "${slots}" 1 1024 || die "${where}: slots=$(shown "${slots}") must be a whole number 1-1024 (GPUs on that node)"
    fi
    HOSTS+=("${host}")
    SLOTS+=("${slots}")
done < "${HOSTFILE}"
NNODES=${#HOSTS[@]}
[ "${NNODES}" -gt 0 ] || die "hostfile ${HOSTFILE} lists no host: add one \"host slots=N\" line per node"
for s in "${SLOTS[@]}"; do
    [ "${s}" = "${SLOTS[0]}" ] || die "${HOSTFILE}: slots=${s} and slots=${SLOTS[0]}: every host needs the same slots= (torchrun starts the same number per node)"
done
NPROC="${SLOTS[0]}"
MASTER_ADDR="${MASTER_ADDR:-${HOSTS[0]}}"
MASTER_PORT="${MASTER_PORT:-29500}"
is_host "${MASTER_ADDR}" || die "MASTER_ADDR $(shown "${MASTER_ADDR}") is not ${HOST_RULE}; unset it to use the hostfile's first host"
is_uint_in "${MASTER_PORT}" 1 65535 || die "MASTER_PORT $(shown "${MASTER_PORT}") must be a port number 1-65535"
ENDPOINT="${MASTER_ADDR}:${MASTER_PORT}"
[[ ${MASTER_ADDR} != *:* ]] || ENDPOINT="[${MASTER_ADDR}]:${MASTER_PORT}"

case "${RECIPE}" in
    1.3b) MODEL=(--model-config "${KIT}/config.json") KIT_DS="${KIT}/ds_config.json" ;;
    2.7b) MODEL=(--preset 2.7b) KIT_DS="${KIT}/ds_config_2.7b.json" ;;
    *) die "--recipe $(shown "${RECIPE}") must be 1.3b or 2.7b (the kit's two recipes)" ;;
esac
DS_CONFIG="${KIT_DS}"
SETUP=()
if [ "${REHEARSAL}" = "1" ]; then
    DS_CONFIG="${OUT}/ds_config.cpu-rehearsal.json"
    MODEL=(--preset tiny)
    SETUP=(export DS_ACCELERATOR=cpu)
    write=()
    [ "${DRY_RUN}" = "1" ] || write=(--write "${DS_CONFIG}")
    flags="$(python3 "${KIT}/cpu_rehearsal.py" "${KIT_DS}" "$((NNODES * NPROC))" "${write[@]}")" \
        || die "cpu_rehearsal.py could not adapt ${KIT_DS} (its message is above)"
    mapfile -t rehearsal_flags <<< "${flags}"
    MODEL+=("${rehearsal_flags[@]}")
fi

# The command every node runs (the same on each: c10d assigns the node ranks), for `bash -c`: every
# value either checked above or quoted with %q.
node_command() {
    printf 'cd %q && export LMTRAIN_HOSTFILE=%q MASTER_ADDR=%q MASTER_PORT=%q && source %q && ' \
        "${REPO}" "${HOSTFILE}" "${MASTER_ADDR}" "${MASTER_PORT}" "${KIT}/env.sh"
    if [ ${#SETUP[@]} -gt 0 ]; then printf '%s && ' "${SETUP[*]}"; fi
    # exec: the shell becomes torchrun, so that a signal sent to it reaches torchrun.
    printf 'exec torchrun --nnodes=%s --nproc-per-node=%s --rdzv-backend=c10d --rdzv-endpoint=%q ' \
        "${NNODES}" "${NPROC}" "${ENDPOINT}"
    printf -- '--rdzv-id=%q --rdzv-conf=join_timeout=%s --max-restarts=%s --monitor-interval=5 ' \
        "${RUN_ID}" "${JOIN_TIMEOUT}" "${MAX_RESTARTS}"
    # --resume on every start: a restart after a node failure continues from the latest checkpoint
    # (a first start with no checkpoint begins at step 0).
    printf -- '-m lmtrain train --data %q --out %q' "${DATA}" "${OUT}"
    printf ' %q' "${MODEL[@]}" --deepspeed "${DS_CONFIG}" --resume "${EXTRA[@]}"
    printf '\n'
}

# POSIX single quotes for the remote login shell, whatever it is (sh, bash, zsh): %q may use bash's $'...'.
sh_quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

COMMAND="$(node_command)"
if [ "${DRY_RUN}" = "1" ]; then
    echo "# ${NNODES} nodes x ${NPROC} processes, rendezvous ${ENDPOINT} (c10d), run id $(shown "${RUN_ID}")"
    for host in "${HOSTS[@]}"; do
        echo "[${host}] ${COMMAND}"
    done
    exit 0
fi

if [ "${ALL}" = "1" ]; then
    pids=()
    for host in "${HOSTS[@]}"; do
        echo "launch.sh: starting ${host}" >&2
        # -tt would tie the job to this terminal; plain ssh keeps its output streaming here. `--` ends
        # ssh's options: a host name never becomes one.
        ssh -o BatchMode=yes -- "${host}" "bash -lc $(sh_quote "${COMMAND}")" 2>&1 | sed "s/^/[${host}] /" &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done
    exit "${status}"
fi

# After torchrun exits non-zero: one line when this launch's run stopped on a signal with a complete checkpoint
# (RUN_DIR/summary.json, written by rank 0 when every rank has saved and stopped, newer than this launch).
report_stop() {
    [ "$1" -ne 0 ] || return 0
    python3 - "${OUT}" "${STARTED}" "$1" <<'PY' >&2 || true
import json, os, sys
from pathlib import Path
run, started, status = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
try:
    summary = json.loads((run / "summary.json").read_text())
    fresh = (run / "summary.json").stat().st_mtime >= started
except (OSError, ValueError):
    sys.exit(0)
ckpt = summary.get("checkpoint") if isinstance(summary, dict) else None
if fresh and summary.get("stopped") and ckpt and (Path(ckpt) / "manifest.json").is_file():
    print(f"launch.sh: stopped by {summary['stopped']} at step {summary.get('step')} with every rank's state saved "
          f"in {ckpt}; the run is not finished (exit status {status}, torchrun's): the same command resumes it")
PY
}

# torchrun runs as a job of its own (set -m: its own process group, so a Ctrl-C in this terminal reaches it once,
# through the trap, not twice), and this script waits for it, passing on the signals a scheduler or a user sends.
# The traps come first: a signal that arrives before torchrun's pid is known is held, and sent once it is (with the
# traps set after the start, a scheduler's SIGTERM in between ended this script and left torchrun running alone).
STARTED="$(date +%s)"
AGENT="" HELD=""
pass_on() { if [ -n "${AGENT}" ]; then kill "-$1" "${AGENT}" 2>/dev/null || true; else HELD="$1"; fi; }
trap 'pass_on TERM' TERM HUP
trap 'pass_on INT' INT
set -m
bash -c "${COMMAND}" &
AGENT=$!
set +m
[ -z "${HELD}" ] || kill "-${HELD}" "${AGENT}" 2>/dev/null || true
while :; do
    status=0
    wait "${AGENT}" || status=$?
    kill -0 "${AGENT}" 2>/dev/null || break  # still running: a trapped signal ended the wait, not torchrun
done
trap - TERM HUP INT
report_stop "${status}"
exit "${status}"
