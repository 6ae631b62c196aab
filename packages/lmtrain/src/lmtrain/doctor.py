"""`lmtrain doctor`: preflight checks before a (multi-node) run, one line each: OK, WARN or FAIL with the fix.

The checks cover the usual ways a multi-node run on PCIe workstations fails: versions, the GPUs (through gpumon),
NCCL settings for PCIe cards without InfiniBand, the master address and port (firewalls), the token files (a `.bin`
corrupted by a concurrent writer, ids beyond the vocabulary), the memory estimate against the GPUs, free disk.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import ipaddress
import os
import platform
import re
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from lmtrain.errors import LmtrainError
from lmtrain.shell import kit_file
from trainloop.extras import install_hint

OK, WARN, FAIL = "OK", "WARN", "FAIL"
GiB = 2**30
# A ZeRO-2 checkpoint holds bf16 weights + fp32 master weights + two fp32 Adam moments (14 bytes per
# parameter, summed over the shards) plus the consolidated fp32 model (4 bytes): 18 bytes per parameter.
CHECKPOINT_BYTES_PER_PARAM = 18


@dataclass
class Check:
    """One result line: status, the thing checked, what was found, and the fix when not OK."""

    status: str
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f"  -> {self.fix}" if self.fix and self.status != OK else ""
        return f"{self.status:<4} {self.name:<18} {self.detail}{fix}"


class HostfileError(LmtrainError):
    """A hostfile that is missing, binary or has a line that is not `host slots=N` (the message names the line)."""


# What tools/cluster-3090/launch.sh accepts too (it checks the same rules before building any command line).
HOST_RULE = "a host name (RFC 1123: letters, digits, inner '-', dot-separated labels), an IPv4 or an IPv6 address"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_UINT = re.compile(r"0|[1-9][0-9]{0,8}")
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
MAX_SLOTS = 1024


def is_host(text: str) -> bool:
    """True for an RFC 1123 host name, an IPv4 or an IPv6 address (no zone index); digits and dots must be IPv4.

    Example:
        >>> [is_host(h) for h in ("node-1.lan", "10.0.0.1", "fd00::1", "10.0.0.256", "node1;reboot")]
        [True, True, True, False, False]
    """
    kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]
    if re.fullmatch(r"[0-9.]+", text):
        kind = ipaddress.IPv4Address
    elif ":" in text:
        if "%" in text:
            return False
        kind = ipaddress.IPv6Address
    else:
        return len(text) <= 253 and _HOST_NAME.fullmatch(text) is not None
    try:
        kind(text)
    except ValueError:
        return False
    return True


def parse_uint(text: str, low: int, high: int) -> int | None:
    """`text` as a decimal integer in [low, high] (no sign, no leading zero), else None."""
    if not _UINT.fullmatch(text) or not low <= int(text) <= high:
        return None
    return int(text)


def read_hostfile(path: str | os.PathLike) -> list[tuple[str, int]]:
    """Hosts and slots from a DeepSpeed-style hostfile: `host slots=N` per line (slots= defaults to 1), `#` comments.

    Raises HostfileError (one line: the file, the line, the value and what is expected) for a missing or binary
    file, a host that is not HOST_RULE, a bad slots= value, anything else on a line, or a host listed twice.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> out = tempfile.TemporaryDirectory()
        >>> hostfile = Path(out.name) / "hostfile"
        >>> _ = hostfile.write_text("# the workstations\\nnode1 slots=4\\nnode2 slots=4\\nnode3\\n")
        >>> read_hostfile(hostfile)
        [('node1', 4), ('node2', 4), ('node3', 1)]
        >>> _ = hostfile.write_text("node1 slots=four\\n")
        >>> read_hostfile(hostfile)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.doctor.HostfileError: hostfile .../hostfile line 1: 'slots=four': slots must be a whole number ...
        >>> out.cleanup()
    """
    expected = 'expected text lines of "host slots=N"'
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HostfileError(f"hostfile {path} cannot be read ({exc.strerror}): pass --hostfile FILE") from None
    if _CONTROL.search(data):
        raise HostfileError(f"hostfile {path} holds control characters (a binary file?): {expected}")
    # Bytes that are not UTF-8 may only sit in comments: a host must be ASCII, which is_host checks.
    text = data.decode("utf-8", errors="surrogateescape")
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(text.split("\n"), 1):
        fields = [f for f in re.split(r"[ \t\r]+", raw.split("#", 1)[0]) if f]
        if not fields:
            continue
        where = f"hostfile {path} line {number}"
        host = fields[0]
        if not is_host(host):
            raise HostfileError(f"{where}: host {host!r} is not {HOST_RULE}; fix that line")
        if any(host == known for known, _ in hosts):
            raise HostfileError(f"{where}: host {host!r} is listed twice; keep one line per node")
        slots = 1
        if len(fields) > 2:
            raise HostfileError(f'{where}: {fields[2]!r} after the slots: a line is "host slots=N"; remove it')
        if len(fields) == 2:
            if not fields[1].startswith("slots="):
                raise HostfileError(f'{where}: {fields[1]!r} is not slots=N: a line is "host slots=N"')
            value = parse_uint(fields[1][len("slots=") :], 1, MAX_SLOTS)
            if value is None:
                raise HostfileError(
                    f"{where}: {fields[1]!r}: slots must be a whole number 1-{MAX_SLOTS} (GPUs on that node)"
                )
            slots = value
        hosts.append((host, slots))
    if not hosts:
        raise HostfileError(f'hostfile {path} lists no host: add one "host slots=N" line per node')
    return hosts


def check_versions() -> list[Check]:
    checks = []
    py = platform.python_version()
    ok = sys.version_info >= (3, 10)
    checks.append(Check(OK if ok else FAIL, "python", py, "use Python 3.10 or newer"))
    for module, required in (("torch", True), ("deepspeed", False), ("triton", False)):
        try:
            # DeepSpeed logs to stdout while it imports ("Setting accelerator to CPU ..."): one line per check here.
            with contextlib.redirect_stdout(io.StringIO()):
                mod = importlib.import_module(module)
            checks.append(Check(OK, module, getattr(mod, "__version__", "?")))
        except Exception as exc:  # deepspeed raises more than ImportError when its accelerator is broken
            status = FAIL if required else WARN
            why = "needed for --deepspeed" if module == "deepspeed" else "needed for the fused GPU attention kernel"
            install = install_hint("deepspeed", "lmtrain") if module == "deepspeed" else f"pip install {module}"
            fix = f"{install} ({why})" if not required else "pip install torch"
            checks.append(Check(status, module, f"not importable: {str(exc).splitlines()[0][:120]}", fix))
    return checks


def check_gpus(expected_per_node: int | None) -> tuple[list[Check], list[dict]]:
    import gpumon

    try:
        gpus = gpumon.devices()
    except gpumon.NVMLUnavailable as exc:
        return [
            Check(WARN, "gpus", f"none: {exc}", "fine for CPU runs; on a GPU node install the NVIDIA driver"),
            Check(WARN, "bf16", "no GPU to check", "bf16 needs compute capability >= 8.0 (RTX 3090: 8.6)"),
        ], []
    if not gpus:
        return [Check(WARN, "gpus", "NVML sees no visible GPU", "check CUDA_VISIBLE_DEVICES")], []
    names = sorted({g["name"] for g in gpus})
    mem = min(g["memory_total"] for g in gpus) / GiB
    checks = [Check(OK, "gpus", f"{len(gpus)} x {', '.join(names)}, {mem:.1f} GiB each (smallest)")]
    if expected_per_node is not None and len(gpus) != expected_per_node:
        checks[0] = Check(
            FAIL,
            "gpus",
            f"{len(gpus)} visible but the hostfile gives slots={expected_per_node}",
            "fix the hostfile's slots= or CUDA_VISIBLE_DEVICES (a wrong world size fails the rendezvous)",
        )
    caps = [g.get("compute_capability") for g in gpus]
    low = [c for c in caps if c is None or float(c) < 8.0]
    if low:
        checks.append(Check(WARN, "bf16", f"compute capability {caps}", "bf16 needs >= 8.0: use --set precision=fp16"))
    else:
        checks.append(Check(OK, "bf16", f"supported (compute capability {', '.join(sorted({str(c) for c in caps}))})"))
    return checks, gpus


def check_nccl_env(multi_node: bool) -> list[Check]:
    env = os.environ
    checks = []
    has_ib = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    if env.get("NCCL_IB_DISABLE") == "1":
        checks.append(Check(OK, "NCCL_IB_DISABLE", "1 (no InfiniBand: sockets)"))
    elif has_ib:
        checks.append(Check(OK, "NCCL_IB_DISABLE", "unset; InfiniBand devices present"))
    else:
        checks.append(Check(WARN, "NCCL_IB_DISABLE", "unset and no InfiniBand device", f"source {kit_file('env.sh')}"))
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname:
        names = [n.lstrip("^=") for n in ifname.split(",")]
        missing = [n for n in names if not ifname.startswith("^") and not any(Path("/sys/class/net").glob(n + "*"))]
        if missing:
            checks.append(
                Check(FAIL, "NCCL_SOCKET_IFNAME", f"{ifname}: no such interface {missing}", "see `ip -br addr`")
            )
        else:
            checks.append(Check(OK, "NCCL_SOCKET_IFNAME", ifname))
    else:
        status = WARN if multi_node else OK
        checks.append(
            Check(status, "NCCL_SOCKET_IFNAME", "unset", "set it to the inter-node interface (env.sh picks it)")
        )
    legacy = env.get("NCCL_ASYNC_ERROR_HANDLING")
    modern = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if legacy == "0" or modern == "0":
        checks.append(
            Check(
                FAIL,
                "async errors",
                "asynchronous NCCL error handling is off: a dead rank hangs every other rank",
                "unset NCCL_ASYNC_ERROR_HANDLING and set TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
            )
        )
    else:
        checks.append(Check(OK, "async errors", f"TORCH_NCCL_ASYNC_ERROR_HANDLING={modern or 'default (on)'}"))
    if "NCCL_MIN_NRINGS" in env:
        checks.append(
            Check(WARN, "NCCL_MIN_NRINGS", "set but obsolete (ignored)", "unset it; NCCL_MIN_NCHANNELS replaced it")
        )
    if env.get("NCCL_P2P_DISABLE") == "1":
        checks.append(
            Check(OK, "NCCL_P2P_DISABLE", "1 (only needed where PCIe P2P is reported but broken; slower otherwise)")
        )
    return checks


def check_master(hosts: list[tuple[str, int]], timeout: float = 3.0) -> list[Check]:
    addr = os.environ.get("MASTER_ADDR") or (hosts[0][0] if hosts else None)
    port_text = os.environ.get("MASTER_PORT", "29500")
    port = parse_uint(port_text, 1, 65535)
    if port is None:
        return [Check(FAIL, "master", f"MASTER_PORT={port_text!r} is not a port number 1-65535", "fix or unset it")]
    if addr and not is_host(addr):
        return [Check(FAIL, "master", f"MASTER_ADDR={addr!r} is not {HOST_RULE}", "fix or unset it")]
    if not addr:
        return [Check(OK, "master", "single node (no hostfile, MASTER_ADDR unset)")]
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        ip = str(sockaddr[0])
    except OSError as exc:
        return [Check(FAIL, "master", f"{addr} does not resolve: {exc}", "fix /etc/hosts or use the IP address")]
    local = {"0.0.0.0", "::"}
    with contextlib.suppress(OSError):  # a host whose own name does not resolve still has loopback
        local |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    if ip in local or ipaddress.ip_address(ip).is_loopback or addr == socket.gethostname():
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("", port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return [Check(WARN, "master", f"this host; port {port} is in use", "a job already running?")]
                return [Check(FAIL, "master", f"cannot bind port {port}: {exc}", "pick another MASTER_PORT")]
        return [Check(OK, "master", f"this host ({ip}); port {port} free (open it to the other nodes)")]
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return [Check(OK, "master", f"{addr} ({ip}):{port} reachable")]
    except ConnectionRefusedError:
        return [Check(WARN, "master", f"{addr} ({ip}) reachable, nothing listens on {port} yet", "start the master")]
    except OSError as exc:
        return [
            Check(
                FAIL,
                "master",
                f"{addr} ({ip}):{port} unreachable: {exc}",
                f"open TCP {port} in the master's firewall (e.g. `sudo ufw allow {port}/tcp`)",
            )
        ]


def _cmd() -> str:
    """The `lmtrain` of a suggested command as the user's shell reaches it (lmtrain.shell.lmtrain_command)."""
    from lmtrain.shell import lmtrain_command

    return lmtrain_command()


def check_data(data_dir: str | None) -> list[Check]:
    if not data_dir:
        return [Check(WARN, "data", "no --data given: token files not verified", f"{_cmd()} doctor --data DATA_DIR")]
    import tokbin
    from lmtrain.errors import LmtrainError
    from lmtrain.run_files import read_meta

    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        return [Check(FAIL, "data", f"{meta_path} missing", f"{_cmd()} prepare --out {shlex.quote(data_dir)} ...")]
    try:
        meta = read_meta(data_dir)  # what `train` reads: the same checks, the same one-line reasons
    except LmtrainError as exc:
        return [Check(FAIL, "data", str(exc).splitlines()[0], f"{_cmd()} prepare --out {shlex.quote(data_dir)} ...")]
    checks = []
    for split in ("train", "val"):
        path = Path(meta[f"{split}_path"])
        try:
            tokens = tokbin.open_tokens(path).verify(meta["tokenizer_path"])["n_tokens"]
            checks.append(Check(OK, f"data/{split}", f"{path} verified ({tokens:,} tokens)"))
        except (tokbin.TokenFileError, OSError) as exc:
            checks.append(Check(FAIL, f"data/{split}", str(exc).splitlines()[0], "re-run lmtrain prepare"))
    return checks


def check_memory(preset: str | None, gpus: list[dict], world_size: int) -> tuple[list[Check], int | None]:
    """The preset's memory per GPU under each engine layout (ENGINE_LAYOUTS), and which of them fit the smallest
    GPU seen; FAIL when none does."""
    if not preset:
        return [Check(OK, "memory", "no --preset given: memory estimate skipped")], None
    from lmtrain.errors import LmtrainError
    from lmtrain.model_setup import ENGINE_LAYOUTS, estimate_run_memory

    try:
        per_engine = {
            engine: estimate_run_memory(preset, n_gpus=world_size, engine=engine) for engine in ENGINE_LAYOUTS
        }
    except (ValueError, LmtrainError) as exc:
        return [Check(FAIL, "memory", str(exc), f"{_cmd()} doctor --preset with a known preset")], None
    n_params = per_engine[ENGINE_LAYOUTS[0]][0]
    need = (
        f"{preset} ({n_params / 1e6:.0f}M parameters, the preset's micro batch and accumulation) per GPU over "
        f"{world_size} GPUs: " + ", ".join(f"{e} {b / GiB:.1f} GiB" for e, (_, b) in per_engine.items())
    )
    if not gpus:
        return [Check(WARN, "memory", f"{need}; no GPU to compare", "")], n_params
    have = min(g["memory_total"] for g in gpus)
    fits = [e for e, (_, b) in per_engine.items() if b <= have]
    if not fits:
        fix = "activation checkpointing (--set checkpointing=block) or a smaller micro_batch"
        return [Check(FAIL, "memory", f"{need}; none fits {have / GiB:.1f} GiB", fix)], n_params
    roomy = [e for e in fits if per_engine[e][1] <= 0.9 * have]
    status = OK if roomy else WARN
    advice = {"torch": "--engine torch", "fsdp": "--engine fsdp",
              "fsdp + CPU offload": "--engine fsdp --set fsdp_cpu_offload=true",
              "deepspeed ZeRO-2 + offload": "--deepspeed with the cluster kit's ds_config"}  # fmt: skip
    detail = f"{need}; fits {have / GiB:.1f} GiB with: " + ", ".join(f"{e} ({advice[e]})" for e in fits)
    return [Check(status, "memory", detail, "" if roomy else "little headroom: lower micro_batch")], n_params


def check_disk(n_params: int | None, where: str | os.PathLike) -> list[Check]:
    where = Path(where).resolve()
    while not where.exists():  # the run directory may not exist yet: its filesystem is the parent's
        where = where.parent
    usage = shutil.disk_usage(where)
    free = usage.free / GiB
    if n_params is None:
        status = WARN if free < 10 else OK
        return [Check(status, "disk", f"{free:.1f} GiB free at {where}", "free space for checkpoints")]
    per_ckpt = n_params * CHECKPOINT_BYTES_PER_PARAM / GiB
    need = 3 * per_ckpt  # keep_last=2 plus the one being written
    status = FAIL if free < per_ckpt else WARN if free < need else OK
    return [
        Check(
            status,
            "disk",
            f"{free:.1f} GiB free at {where}; a checkpoint is about {per_ckpt:.1f} GiB",
            f"free at least {need:.0f} GiB or lower keep_last",
        )
    ]


def check_extension_locks() -> list[Check]:
    """A build lock of torch's extension cache that no process holds (a build killed half way, e.g. DeepSpeed's first
    JIT build of its ops), which would make every later build wait for ever (trainloop.extension_locks)."""
    from trainloop.extension_locks import stale_extension_lock_message

    line = stale_extension_lock_message()
    if line is None:
        return [Check(OK, "torch extensions", "no stale build lock")]
    return [Check(FAIL, "torch extensions", line)]


def _guarded(name: str, check, *args):
    """Run one check; a check that crashes is reported as WARN (a doctor bug must not hide the other checks)."""
    try:
        return check(*args)
    except Exception as exc:
        return [Check(WARN, name, f"could not check: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")]


def run_doctor(args: argparse.Namespace) -> int:
    """Run every check, print one line each, return 1 if any FAILed; with ``--world``, print which configuration
    fits instead (:func:`run_plan`); with ``--from DIR``, which fine-tuning method fits (:func:`run_from`)."""
    if getattr(args, "source", None) is not None:
        from lmtrain.doctor_from import run_from

        return run_from(args)
    if getattr(args, "seq_len", None) is not None:
        raise LmtrainError("--seq-len is for the fine-tuning table: add --from DIR (a Hugging Face model directory)")
    if getattr(args, "world", None) is not None:
        from lmtrain.doctor_plan import run_plan

        return run_plan(args)
    if getattr(args, "micro_batch", None) is not None:
        raise LmtrainError("--micro-batch is for the configuration table: add --world N (and --preset), or --from DIR")
    hosts = read_hostfile(args.hostfile) if args.hostfile else []
    data_dir = getattr(args, "data", None)
    checks = _guarded("versions", check_versions)
    gpus: list[dict] = []
    result = _guarded("gpus", check_gpus, hosts[0][1] if hosts else None)
    if isinstance(result, tuple):
        result, gpus = result
    checks += result
    checks += _guarded("nccl", check_nccl_env, len(hosts) > 1)
    checks += _guarded("master", check_master, hosts)
    checks += _guarded("data", check_data, data_dir)
    n_params = None
    world_size = sum(slots for _, slots in hosts) if hosts else max(1, len(gpus))
    result = _guarded("memory", check_memory, args.preset, gpus, world_size)
    if isinstance(result, tuple):
        result, n_params = result
    checks += result
    checks += _guarded("disk", check_disk, n_params, data_dir or ".")
    checks += _guarded("torch extensions", check_extension_locks)
    for check in checks:
        print(check.line())
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    print(f"doctor: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL")
    return 1 if counts[FAIL] else 0
