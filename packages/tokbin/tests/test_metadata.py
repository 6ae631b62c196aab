import importlib.metadata
import importlib.resources

import tokbin


def test_version_matches_distribution_metadata():
    assert tokbin.__version__ == importlib.metadata.version("lmtools-tokbin")


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires("lmtools-tokbin") or []
    assert all("@" not in r and "file:" not in r for r in requires), requires


def test_ships_py_typed_marker():
    # PEP 561: without it, type checkers treat an installed tokbin as untyped
    assert importlib.resources.files("tokbin").joinpath("py.typed").is_file()
