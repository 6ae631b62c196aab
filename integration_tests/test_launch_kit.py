"""tools/cluster-3090/launch.sh and `lmtrain doctor --hostfile`: a bad value stops with one line before anything runs;
valid values reach `torchrun` (and `ssh` with --all) exactly as written.

Stub `torchrun` and `ssh` commands on PATH record their arguments. The stub ssh hands the remote command to `sh -c`
with a home whose .bash_profile puts the stubs first on PATH, as a real remote login shell would run it. Every
injection attempt targets a marker file that must never appear.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

from lmtrain.doctor import HostfileError, is_host, read_hostfile

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "tools" / "cluster-3090"
LAUNCH = KIT / "launch.sh"

STUB_TORCHRUN = """#!{python}
import json, os, signal, sys, tempfile, time
from pathlib import Path
fd, _ = tempfile.mkstemp(prefix="torchrun.", suffix=".json", dir=os.environ["STUB_LOG"])
with os.fdopen(fd, "w") as f:
    json.dump({{"argv": sys.argv[1:], "cwd": os.getcwd(), "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
               "MASTER_PORT": os.environ.get("MASTER_PORT"), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR")}}, f)
if os.environ.get("STUB_UNTIL_SIGNAL"):  # a run that stops on the first signal as lmtrain's ranks do, then exits 1
    log, received = Path(os.environ["STUB_LOG"]), []
    signal.signal(signal.SIGTERM, lambda s, _: received.append(signal.Signals(s).name))
    signal.signal(signal.SIGINT, lambda s, _: received.append(signal.Signals(s).name))
    (log / "ready").write_text(str(os.getpid()))
    while not received:  # not signal.pause(): a signal between this check and the pause would leave it waiting
        time.sleep(0.05)
    (log / "received").write_text(json.dumps(received))
    if os.environ["STUB_UNTIL_SIGNAL"] == "saved":
        out = Path(sys.argv[sys.argv.index("--out") + 1])
        ckpt = out / "checkpoints" / "step_00000007"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text("{{}}")
        (out / "summary.json").write_text(json.dumps({{"stopped": received[0], "step": 7, "checkpoint": str(ckpt)}}))
    sys.exit(1)  # torchrun's status when it was signalled itself
"""

# ssh [-o OPTION]... [--] HOST COMMAND...: the remote side joins COMMAND with spaces and runs it with its shell.
STUB_SSH = """#!{python}
import json, os, sys, tempfile
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag == "--":
        break
    options += [flag, args.pop(0)] if flag == "-o" else [flag]
host, remote = args[0], " ".join(args[1:])
fd, _ = tempfile.mkstemp(prefix="ssh.", suffix=".json", dir=os.environ["STUB_LOG"])
with os.fdopen(fd, "w") as f:
    json.dump({{"options": options, "host": host, "remote": remote}}, f)
os.execvp("sh", ["sh", "-c", remote])
"""


@pytest.fixture
def kit(tmp_path):
    """(run launch.sh with the stubs, read what the stubs recorded, the marker path injections aim at)."""
    stubs, log, home = tmp_path / "stubs", tmp_path / "log", tmp_path / "home"
    for d in (stubs, log, home):
        d.mkdir()
    for name, text in (("torchrun", STUB_TORCHRUN), ("ssh", STUB_SSH)):
        (stubs / name).write_text(text.format(python=sys.executable))
        (stubs / name).chmod(0o755)
    path = os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]])
    # A login shell's /etc/profile resets PATH; a remote user's profile puts the job's commands back first.
    (home / ".bash_profile").write_text(f"export PATH={path}\n")
    marker = tmp_path / "PWNED"

    def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
        environ = child_env(PATH=path, HOME=str(home), STUB_LOG=str(log), **env)
        for name in ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME"):
            if name not in env:
                environ.pop(name, None)
        return subprocess.run(
            ["bash", str(LAUNCH), *args], capture_output=True, text=True, timeout=120, env=environ, cwd=tmp_path
        )

    def recorded(kind: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(log.glob(f"{kind}.*.json"))]

    return launch, recorded, marker


def hostfile(tmp_path: Path, text: str | bytes, name: str = "hostfile") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def torchrun_argv(nnodes, nproc, endpoint, run_id, data, out, *extra, restarts=3, join=900) -> list[str]:
    return [
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}", f"--rdzv-conf=join_timeout={join}", f"--max-restarts={restarts}",
        "--monitor-interval=5", "-m", "lmtrain", "train", "--data", data, "--out", out,
        "--model-config", str(KIT / "config.json"), "--deepspeed", str(KIT / "ds_config.json"), "--resume", *extra,
    ]  # fmt: skip


def test_dry_run_prints_each_node_command(kit, tmp_path):
    launch, recorded, _ = kit
    hf = hostfile(tmp_path, "node1 slots=4\nnode2 slots=4\n")
    result = launch("--data", "/mnt/nfs/data", "--out", "/mnt/nfs/runs/xl", "--hostfile", hf, "--dry-run")
    assert result.returncode == 0, result.stderr
    command = (
        f"cd {REPO} && export LMTRAIN_HOSTFILE={hf} MASTER_ADDR=node1 MASTER_PORT=29500 && source {KIT}/env.sh && "
        "exec torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node1:29500 --rdzv-id=xl "
        "--rdzv-conf=join_timeout=900 --max-restarts=3 --monitor-interval=5 -m lmtrain train --data /mnt/nfs/data "
        f"--out /mnt/nfs/runs/xl --model-config {KIT}/config.json --deepspeed {KIT}/ds_config.json --resume"
    )
    assert result.stdout.splitlines() == [
        "# 2 nodes x 4 processes, rendezvous node1:29500 (c10d), run id 'xl'",
        f"[node1] {command}",
        f"[node2] {command}",
    ]
    assert not recorded("torchrun") and not recorded("ssh")


VALID = {
    "names, comments, CRLF, tabs": (
        "# the cluster\r\nnode1 slots=4 # master\r\n\r\n\tgpu-02.lan\tslots=4\r\n",
        ["node1", "gpu-02.lan"],
        4,
        "node1:29500",
    ),  # fmt: skip
    "IPv4": ("10.0.0.1 slots=2\n10.0.0.2 slots=2\n", ["10.0.0.1", "10.0.0.2"], 2, "10.0.0.1:29500"),
    "IPv6": ("fd00::1 slots=2\nfd00::2 slots=2\n", ["fd00::1", "fd00::2"], 2, "[fd00::1]:29500"),
    "no slots=": ("node1\nnode2\nnode3\n", ["node1", "node2", "node3"], 1, "node1:29500"),
}


@pytest.mark.parametrize("case", VALID, ids=list(VALID))
@pytest.mark.parametrize("over_ssh", [False, True], ids=["this-node", "all-over-ssh"])
def test_valid_hostfile_reaches_torchrun_exactly(kit, tmp_path, case, over_ssh):
    launch, recorded, marker = kit
    text, hosts, slots, endpoint = VALID[case]
    # Paths, run id and extra arguments are quoted, never checked: what they hold reaches lmtrain literally.
    data = f"{tmp_path}/my data $(touch {marker})"
    out = f"{tmp_path}/runs/xl;touch {marker}"
    run_id = f"xl'`touch {marker}`"
    extra = ["--set", f"note=$(touch {marker})", "--set", "text=two\nlines 'quoted' \"double\" \\ back"]
    args = ["--data", data, "--out", out, "--hostfile", hostfile(tmp_path, text), "--run-id", run_id]
    args += ["--max-restarts", "0", "--join-timeout", "60"]
    result = launch(*args, *(["--all"] if over_ssh else []), "--", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = torchrun_argv(len(hosts), slots, endpoint, run_id, data, out, *extra, restarts=0, join=60)
    calls = recorded("torchrun")
    assert [c["argv"] for c in calls] == [expected] * (len(hosts) if over_ssh else 1)
    master = hosts[0]
    assert all((c["cwd"], c["MASTER_ADDR"], c["MASTER_PORT"]) == (str(REPO), master, "29500") for c in calls)
    ssh = recorded("ssh")
    if over_ssh:
        assert sorted(c["host"] for c in ssh) == sorted(hosts)
        assert all(c["options"] == ["-o", "BatchMode=yes"] for c in ssh)
    else:
        assert ssh == []
    assert not marker.exists()


def test_master_port_and_addr_from_the_environment(kit, tmp_path):
    launch, recorded, _ = kit
    hf = hostfile(tmp_path, "node1 slots=2\nnode2 slots=2\n")
    result = launch("--data", "/d", "--out", "/r/xl", "--hostfile", hf, MASTER_ADDR="10.1.2.3", MASTER_PORT="29777")
    assert result.returncode == 0, result.stderr
    [call] = recorded("torchrun")
    assert call["argv"] == torchrun_argv(2, 2, "10.1.2.3:29777", "xl", "/d", "/r/xl")
    assert (call["MASTER_ADDR"], call["MASTER_PORT"]) == ("10.1.2.3", "29777")


def injections(marker: Path) -> dict[str, tuple[str | bytes | None, dict[str, str], list[str]]]:
    """name -> (hostfile text or None for the default, environment, extra launch.sh arguments)."""
    touch = f"touch${{IFS}}{marker}"
    ok = "node1 slots=2\nnode2 slots=2\n"
    return {
        "host ;": (f"node1;{touch}; slots=4\n", {}, []),
        "host $()": (f"$({touch}) slots=4\n", {}, []),
        "host backticks": (f"`{touch}` slots=4\n", {}, []),
        "host |": (f"node1 slots=4\nnode2|{touch} slots=4\n", {}, []),
        "host &&": (f"node1 slots=4\nnode2&&{touch} slots=4\n", {}, []),
        "host as ssh option": (f"node1 slots=4\n-oProxyCommand={touch} slots=4\n", {}, []),
        "host newline escape": ("node1\\\n slots=4\n", {}, []),
        "slots ;": (f"node1 slots=4;{touch}\n", {}, []),
        "slots $()": (f"node1 slots=$({touch})\n", {}, []),
        "slots zero": ("node1 slots=0\n", {}, []),
        "slots leading zero": ("node1 slots=08\n", {}, []),
        "extra token": (f"node1 slots=4 $({touch})\n", {}, []),
        "duplicate host": ("node1 slots=4\nnode1 slots=4\n", {}, []),
        "binary": (b"node1 slots=4\n\x00\x01\x02" + touch.encode(), {}, []),
        "empty": ("# nothing\n\n", {}, []),
        "MASTER_PORT ;": (ok, {"MASTER_PORT": f"29500;{touch}"}, []),
        "MASTER_PORT $()": (ok, {"MASTER_PORT": f"$({touch})"}, []),
        "MASTER_PORT range": (ok, {"MASTER_PORT": "70000"}, []),
        "MASTER_ADDR ;": (ok, {"MASTER_ADDR": f"node1;{touch}"}, []),
        "--max-restarts ;": (ok, {}, ["--max-restarts", f"3;{touch}"]),
        "--max-restarts negative": (ok, {}, ["--max-restarts", "-1"]),
        "--join-timeout $()": (ok, {}, ["--join-timeout", f"$({touch})"]),
        "--join-timeout missing": (ok, {}, ["--join-timeout"]),
    }


INJECTION_NAMES = list(injections(Path("/m")))


@pytest.mark.parametrize("name", INJECTION_NAMES)
def test_injection_fails_with_one_line_and_runs_nothing(kit, tmp_path, name):
    launch, recorded, marker = kit
    text, env, extra = injections(marker)[name]
    hf = hostfile(tmp_path, text)
    for mode in (["--dry-run"], [], ["--all"]):
        result = launch("--data", "/d", "--out", "/r/xl", "--hostfile", hf, *mode, *extra, **env)
        assert result.returncode == 2, (mode, result.stdout, result.stderr)
        assert result.stdout == "", mode
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("launch.sh: error: "), (mode, result.stderr)
    assert not recorded("torchrun") and not recorded("ssh")
    assert not marker.exists()


HOSTFILE_INJECTIONS = [n for n in INJECTION_NAMES if injections(Path("/m"))[n][1:] == ({}, [])]


@pytest.mark.parametrize("name", HOSTFILE_INJECTIONS)
def test_doctor_rejects_the_same_hostfiles(tmp_path, name):
    text = injections(tmp_path / "PWNED")[name][0]
    with pytest.raises(HostfileError, match=r"^hostfile "):
        read_hostfile(hostfile(tmp_path, text))


HOSTS = {
    "node1": True, "gpu-01.cluster.example.org": True, "a" * 63: True, "localhost": True, "10.0.0.1": True,
    "255.255.255.255": True, "fd00::1": True, "::1": True, "::": True, "1:2:3:4:5:6:7:8": True,
    "::ffff:192.0.2.1": True, "FE80::1": True, "1:2:3:4:5:6:7::": True,
    "a" * 64: False, "-node": False, "node-": False, "no_de": False, "node..1": False, ".node": False,
    "10.0.0.256": False, "010.0.0.1": False, "1.2.3": False, "123": False, "fe80::1%eth0": False,
    "1:2:3:4:5:6:7:8:9": False, "1::2::3": False, "12345::1": False, "::ffff:1.2.3.04": False, "[::1]": False,
    "1:2:3:4:5:6:7:8::": False, "nœud": False,
}  # fmt: skip


def test_launch_and_doctor_accept_the_same_hosts(kit, tmp_path):
    launch, _, _ = kit
    accepted = {}
    for host in HOSTS:
        hf = hostfile(tmp_path, f"{host} slots=1\n")
        result = launch("--data", "/d", "--out", "/r", "--hostfile", hf, "--dry-run")
        assert result.returncode in (0, 2), result.stderr
        accepted[host] = result.returncode == 0
    assert accepted == HOSTS
    assert {host: is_host(host) for host in HOSTS} == HOSTS


@pytest.mark.parametrize("what", ["missing", "binary", "injection"])
def test_doctor_hostfile_errors_are_one_line(tmp_path, what):
    path = tmp_path / "hostfile"
    if what == "binary":
        path.write_bytes(bytes(range(256)))
    elif what == "injection":
        path.write_text(f"node1;touch${{IFS}}{tmp_path}/PWNED; slots=4\n")
    result = subprocess.run(
        [sys.executable, "-m", "lmtrain", "doctor", "--hostfile", str(path)],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"lmtrain doctor: error: hostfile {path}")
    assert not (tmp_path / "PWNED").exists()


def test_cpu_rehearsal_adapts_the_kit_config(kit, tmp_path):
    launch, recorded, _ = kit
    hf = hostfile(tmp_path, "localhost slots=2\n127.0.0.1 slots=2\n")
    out = tmp_path / "run"
    result = launch("--data", "/d", "--out", str(out), "--hostfile", hf, "--cpu-rehearsal", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert not out.exists(), "a dry run writes nothing"
    assert "export DS_ACCELERATOR=cpu && exec torchrun" in result.stdout

    result = launch("--data", "/d", "--out", str(out), "--hostfile", hf, "--cpu-rehearsal")
    assert result.returncode == 0, result.stderr
    [call] = recorded("torchrun")
    kit_ds = json.loads((KIT / "ds_config.json").read_text())
    rehearsal = out / "ds_config.cpu-rehearsal.json"
    micro, accum = kit_ds["train_micro_batch_size_per_gpu"], kit_ds.get("gradient_accumulation_steps", 1)
    sixteen_bit = any(kit_ds.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
    precision = "bf16" if sixteen_bit else "fp32"
    tail = ["--preset", "tiny", "--set", f"precision={precision}", "--set", f"micro_batch={micro}", "--set",
            f"grad_accum={accum}", "--deepspeed", str(rehearsal), "--resume"]  # fmt: skip
    assert call["argv"][-len(tail) :] == tail
    assert call["DS_ACCELERATOR"] == "cpu"
    adapted = json.loads(rehearsal.read_text())
    assert adapted["train_batch_size"] == micro * accum * 4
    assert "fp16" not in adapted
    assert {k: v for k, v in adapted.items() if k not in ("train_batch_size", "bf16")} == {
        k: v for k, v in kit_ds.items() if k not in ("train_batch_size", "fp16", "bf16")
    }


@pytest.mark.parametrize(
    ("how", "saved"),
    [("SIGTERM to launch.sh", "saved"), ("Ctrl-C (SIGINT to its process group)", "saved"),
     ("SIGTERM, nothing saved", "crashed")],
)  # fmt: skip
def test_a_signal_reaches_torchrun_once_and_a_preempted_run_says_it_is_not_finished(kit, tmp_path, how, saved):
    """A scheduler's SIGTERM to launch.sh, or a Ctrl-C in its terminal, reaches torchrun exactly once; torchrun's exit
    status (1: signalled, the run not finished) is launch.sh's, and launch.sh says in one line that every rank saved
    and the same command resumes, only when the stop wrote a summary naming a complete checkpoint."""
    import signal
    import time

    _, recorded, _ = kit
    launch_env = child_env(STUB_LOG=str(tmp_path / "log"), STUB_UNTIL_SIGNAL=saved, HOME=str(tmp_path / "home"))
    first = [str(tmp_path / "stubs"), str(Path(sys.executable).parent)]
    launch_env["PATH"] = os.pathsep.join([*first, launch_env["PATH"]])
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        launch_env.pop(name, None)
    out = tmp_path / "run"
    cmd = ["bash", str(LAUNCH), "--data", "/d", "--out", str(out), "--hostfile", hostfile(tmp_path, "node1 slots=2\n")]
    # As a terminal starts it: SIGINT at its default. A shell started with SIGINT ignored (a job that a non-interactive
    # shell put in the background, as a CI runner may run the tests) cannot trap it, so a Ctrl-C would never reach
    # torchrun, and the test would wait out its bound.
    proc = subprocess.Popen(cmd, env=launch_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        ready, deadline = tmp_path / "log" / "ready", time.monotonic() + 120  # a bound on a hang, not a timing
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.communicate(timeout=30)
        if how.startswith("Ctrl-C"):
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends: every process of the foreground group
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if ready.exists() and not (tmp_path / "log" / "received").exists():  # the stub never heard: end it
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(ready.read_text()), signal.SIGKILL)
    sent = "SIGINT" if how.startswith("Ctrl-C") else "SIGTERM"
    assert json.loads((tmp_path / "log" / "received").read_text()) == [sent]
    assert proc.returncode == 1 and len(recorded("torchrun")) == 1, err
    said = [ln for ln in err.splitlines() if ln.startswith("launch.sh: ")]
    if saved == "saved":
        assert said == [f"launch.sh: stopped by {sent} at step 7 with every rank's state saved in {out}/checkpoints/"
                        "step_00000007; the run is not finished (exit status 1, torchrun's): the same command "
                        "resumes it"], err  # fmt: skip
    else:
        assert said == [], err
