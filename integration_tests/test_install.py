"""The six packages install together: every package imports, every command starts, no stranger's distribution."""

import importlib
import importlib.metadata
import shutil
import subprocess

import pytest

# Distribution -> import name. Four import names belong to unrelated projects on PyPI: ours carry `lmtools-`.
PACKAGES = {
    "alibi-kernels": "alibi_kernels",
    "lmtools-tokbin": "tokbin",
    "lmtools-lmcore": "lmcore",
    "lmtools-trainloop": "trainloop",
    "lmtools-gpumon": "gpumon",
    "lmtrain": "lmtrain",
}


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_imports_at_its_metadata_version(dist):
    module = importlib.import_module(PACKAGES[dist])
    assert module.__version__ == importlib.metadata.version(dist)


def test_no_other_distribution_provides_our_import_names():
    providers = importlib.metadata.packages_distributions()  # editable installs list no modules: then only ours
    for dist, module in PACKAGES.items():
        assert set(providers.get(module, [])) <= {dist}, f"{module} is provided by {providers[module]}"
    for module in ("tokbin", "lmcore", "trainloop", "gpumon"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(module)  # the unrelated project's distribution of that name


@pytest.mark.parametrize("command", ["tokbin", "gpumon", "lmcore-estimate", "lmtrain"])
def test_command_prints_help(command):
    exe = shutil.which(command)
    assert exe is not None, f"{command} is not on PATH after installing the wheels"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
