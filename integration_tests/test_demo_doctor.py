"""`lmtrain doctor` on this GPU-less machine (the demo runs in test_readme.py, as the README gives it)."""

from __future__ import annotations

from conftest import run_lmtrain


def test_doctor_warns_without_gpu_and_exits_cleanly(prepared):
    result = run_lmtrain("doctor", "--preset", "cpu-small", "--data", str(prepared), check=False)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    gpu = [ln for ln in lines if ln.split()[1:2] == ["gpus"]]
    assert gpu and gpu[0].startswith("WARN"), result.stdout
    assert any(ln.startswith("OK") and "data/train" in ln for ln in lines), result.stdout
    assert not any(ln.startswith("FAIL") for ln in lines), result.stdout
    assert "0 FAIL" in lines[-1]


def test_doctor_fails_on_disabled_async_error_handling():
    result = run_lmtrain("doctor", check=False, NCCL_ASYNC_ERROR_HANDLING="0")
    assert result.returncode == 1
    assert any(ln.startswith("FAIL") and "async" in ln for ln in result.stdout.splitlines()), result.stdout
