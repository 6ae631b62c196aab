# Environment for the 4 x 4 RTX 3090 cluster (PCIe cards, plain Ethernet, no InfiniBand).
# Sourced by launch.sh on every node; `source tools/cluster-3090/env.sh` by hand before `lmtrain doctor`.
# Each setting says why. Override any of them by exporting it before sourcing this file.

_kit_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${LMTRAIN_HOSTFILE:=${_kit_dir}/hostfile}"

# The master is the first host of the hostfile ('#' starts a comment); it serves torchrun's c10d rendezvous
# store. launch.sh checks the hostfile and exports MASTER_ADDR before sourcing this file.
if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR="$(sed 's/#.*//' "${LMTRAIN_HOSTFILE}" | awk 'NF {print $1; exit}')"
fi
export MASTER_ADDR
# 29500 is torch's default port; open it in the firewall between the nodes.
export MASTER_PORT="${MASTER_PORT:-29500}"

# No InfiniBand HCA in these workstations: without this NCCL probes the IB/RoCE verbs library first;
# disabling it makes NCCL go straight to its TCP socket transport.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"

# The network interface NCCL and gloo use between nodes. Left alone, they may pick docker0, a VPN or
# a bridge that the other nodes cannot reach, and the job hangs at the first all-reduce. Default: the
# interface that routes to the master.
if [ -z "${NCCL_SOCKET_IFNAME:-}" ]; then
    case "${MASTER_ADDR}" in
        localhost|127.0.0.1|::1)
            # Every "node" is this machine (a rehearsal on one host): loopback is the way between them.
            NCCL_SOCKET_IFNAME=lo ;;
        *)
            if command -v ip >/dev/null 2>&1 && [ -n "${MASTER_ADDR}" ]; then
                NCCL_SOCKET_IFNAME="$(ip -o route get "$(getent hosts "${MASTER_ADDR}" | awk '{print $1; exit}' || echo "${MASTER_ADDR}")" 2>/dev/null \
                    | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
                if [ "${NCCL_SOCKET_IFNAME}" = "lo" ]; then
                    # On the master itself the route to its own address is loopback, which the other nodes cannot reach.
                    NCCL_SOCKET_IFNAME="$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
                fi
            fi ;;
    esac
fi
if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
    export NCCL_SOCKET_IFNAME
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME}}"
else
    # An empty value would be passed through as "no interface"; leave it to `lmtrain doctor` to warn.
    unset NCCL_SOCKET_IFNAME
fi

# Peer-to-peer over PCIe: GeForce cards without an NVLink bridge report P2P as unsupported and NCCL
# already routes through host memory, so this is NOT set by default. Set LMTRAIN_NCCL_P2P_DISABLE=1
# only where P2P is reported available but hangs or corrupts data (some boards with PCIe ACS / IOMMU
# enabled): symptoms are a hang or NaN in the first all-reduce inside one node. Check with
# `nvidia-smi topo -p2p r`, and with nccl-tests' all_reduce_perf with and without it.
if [ "${LMTRAIN_NCCL_P2P_DISABLE:-0}" = "1" ]; then
    export NCCL_P2P_DISABLE=1
fi

# Keep asynchronous error handling ON (it is torch's default): when a rank dies, the collectives of the
# others are aborted and the job fails, so torchrun can restart it, instead of every rank hanging.
# NCCL_ASYNC_ERROR_HANDLING=0 (the deprecated name, still found in older recipes) turns it off: unset it.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
unset NCCL_ASYNC_ERROR_HANDLING

# NCCL_MIN_NRINGS (still found in older recipes) no longer exists; NCCL_MIN_NCHANNELS replaced it. Neither is set:
# NCCL's own channel count is right for 4 PCIe GPUs per node. Warn if an old setting lingers.
if [ -n "${NCCL_MIN_NRINGS:-}" ]; then
    echo "env.sh: NCCL_MIN_NRINGS is obsolete and ignored by NCCL (use NCCL_MIN_NCHANNELS); unsetting it" >&2
    unset NCCL_MIN_NRINGS
fi

# Collective timeouts belong to init_process_group(timeout=), which lmtrain sets; a socket-level timeout
# only hides where the hang is. WARN keeps NCCL quiet; INFO when diagnosing.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# 4 GPU processes per node share the CPU cores that the offloaded AdamW runs on.
if [ -z "${OMP_NUM_THREADS:-}" ] && command -v nproc >/dev/null 2>&1; then
    OMP_NUM_THREADS=$(( $(nproc) / 4 ))
    [ "${OMP_NUM_THREADS}" -ge 1 ] || OMP_NUM_THREADS=1
fi
export OMP_NUM_THREADS
unset _kit_dir
