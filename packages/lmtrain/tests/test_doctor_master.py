"""`lmtrain doctor`'s master check: MASTER_ADDR and MASTER_PORT are checked like the hostfile, IPv6 resolves."""

from __future__ import annotations

import socket

import pytest

from lmtrain.doctor import FAIL, check_master


@pytest.mark.parametrize("port", ["29500;reboot", "0", "65536", "029500", ""])
def test_bad_master_port_fails_naming_it(monkeypatch, port):
    monkeypatch.setenv("MASTER_PORT", port)
    [check] = check_master([("node1", 4)])
    assert check.status == FAIL and repr(port) in check.detail


def test_bad_master_addr_fails_naming_it(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node1;reboot")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    [check] = check_master([])
    assert check.status == FAIL and "'node1;reboot'" in check.detail


def test_ipv6_loopback_master_is_this_host(monkeypatch):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback address on this machine")
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    [check] = check_master([("::1", 2)])
    assert check.status != FAIL and "this host" in check.detail, check.line()


def test_every_line_doctor_prints_is_a_check():
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed then logs which it picked
    result = subprocess.run([sys.executable, "-m", "lmtrain", "doctor"], capture_output=True, text=True, timeout=300,
                            env=env)  # fmt: skip
    lines = result.stdout.splitlines()
    assert lines and all(line.split()[0] in ("OK", "WARN", "FAIL", "doctor:") for line in lines), result.stdout


def test_doctor_names_a_stale_extension_build_lock(tmp_path, monkeypatch, capsys):
    from lmtrain.doctor import FAIL, OK, check_extension_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert [c.status for c in check_extension_locks()] == [OK]
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()  # a build killed half way: nobody holds it
    (check,) = check_extension_locks()
    assert check.status == FAIL and str(tmp_path / "deepspeed_shm_comm" / "lock") in check.line()


def test_the_kit_file_doctor_suggests_is_found_from_any_directory(tmp_path, monkeypatch):
    import shlex
    from pathlib import Path

    from lmtrain import shell
    from lmtrain.doctor import WARN, check_nccl_env

    if Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()):
        pytest.skip("this machine has InfiniBand: no warning to check")
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    # lmtrain as run from a checkout (an editable install), whichever way this test's lmtrain is installed
    checkout = tmp_path / "checkout"
    (checkout / "tools" / "cluster-3090").mkdir(parents=True)
    (checkout / "tools" / "cluster-3090" / "env.sh").write_text("export NCCL_IB_DISABLE=1\n")
    monkeypatch.setattr(shell, "__file__", str(checkout / "packages" / "lmtrain" / "src" / "lmtrain" / "shell.py"))
    for where in (tmp_path, checkout, checkout / "tools"):  # outside the checkout, at its top, below it
        monkeypatch.chdir(where)
        [check] = [c for c in check_nccl_env(False) if c.name == "NCCL_IB_DISABLE"]
        assert check.status == WARN and check.fix.startswith("source ")
        script = Path(shlex.split(check.fix.removeprefix("source "))[0])
        assert script.is_file() and script.resolve() == (checkout / "tools" / "cluster-3090" / "env.sh"), check.fix


def test_an_installed_wheel_names_the_kit_file_inside_the_repository(tmp_path, monkeypatch):
    from lmtrain import shell

    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "lmtrain" / "shell.py"
    monkeypatch.setattr(shell, "__file__", str(site))  # no checkout around it
    assert shell.kit_file("env.sh") == "tools/cluster-3090/env.sh of the repository"


def test_the_commands_doctor_suggests_name_the_lmtrain_the_shell_reaches(tmp_path, monkeypatch):
    from lmtrain import shell
    from lmtrain.doctor import check_data

    monkeypatch.setattr(shell, "lmtrain_command", lambda: "/venv/bin/lmtrain")  # not on PATH: named by its path
    [no_data] = check_data(None)
    [missing] = check_data(str(tmp_path / "my data"))
    assert no_data.fix == "/venv/bin/lmtrain doctor --data DATA_DIR"
    assert missing.fix == f"/venv/bin/lmtrain prepare --out '{tmp_path / 'my data'}' ..."
