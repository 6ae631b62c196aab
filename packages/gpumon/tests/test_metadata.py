import importlib.metadata

import gpumon


def test_version_matches_distribution_metadata():
    assert gpumon.__version__ == importlib.metadata.version("gpumon")


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires("gpumon") or []
    assert all("@" not in r and "file:" not in r for r in requires), requires
