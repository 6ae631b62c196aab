"""The six wheels install together: every package imports and every command starts."""

import importlib
import importlib.metadata
import shutil
import subprocess

import pytest

PACKAGES = {
    "alibi-kernels": "alibi_kernels",
    "tokbin": "tokbin",
    "lmcore": "lmcore",
    "trainloop": "trainloop",
    "gpumon": "gpumon",
    "lmtrain": "lmtrain",
}


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_imports_at_its_metadata_version(dist):
    module = importlib.import_module(PACKAGES[dist])
    assert module.__version__ == importlib.metadata.version(dist)


@pytest.mark.parametrize("command", ["tokbin", "gpumon", "lmcore-estimate", "lmtrain"])
def test_command_prints_help(command):
    exe = shutil.which(command)
    assert exe is not None, f"{command} is not on PATH after installing the wheels"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
