import importlib.metadata

import alibi_kernels


def test_version_matches_distribution_metadata():
    assert alibi_kernels.__version__ == importlib.metadata.version("alibi-kernels")


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires("alibi-kernels") or []
    assert all("@" not in r and "file:" not in r for r in requires), requires
