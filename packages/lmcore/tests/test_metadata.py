import importlib.metadata
import importlib.resources

import lmcore


def test_version_matches_distribution_metadata():
    assert lmcore.__version__ == importlib.metadata.version("lmtools-lmcore")


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires("lmtools-lmcore") or []
    assert all("@" not in r and "file:" not in r for r in requires), requires


def test_ships_py_typed_marker():
    # PEP 561: without it, type checkers treat an installed lmcore as untyped
    assert importlib.resources.files("lmcore").joinpath("py.typed").is_file()
