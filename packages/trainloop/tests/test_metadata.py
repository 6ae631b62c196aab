import importlib.metadata

import trainloop


def test_version_matches_distribution_metadata():
    assert trainloop.__version__ == importlib.metadata.version("lmtools-trainloop")


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires("lmtools-trainloop") or []
    assert all("@" not in r and "file:" not in r for r in requires), requires
