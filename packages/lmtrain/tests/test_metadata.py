import importlib.metadata

import lmtrain


def test_version_matches_distribution_metadata():
    assert lmtrain.__version__ == importlib.metadata.version("lmtrain")


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires("lmtrain") or []
    assert all("@" not in r and "file:" not in r for r in requires), requires
