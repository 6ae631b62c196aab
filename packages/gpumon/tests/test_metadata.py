import importlib.metadata
import importlib.resources

import gpumon


def distribution_name() -> str:
    """The installed distribution that provides gpumon, found through the `gpumon` command it declares."""
    (ep,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.value == "gpumon.cli:main"]
    return ep.dist.name


def test_version_matches_distribution_metadata():
    assert gpumon.__version__ == importlib.metadata.version(distribution_name())


def test_declared_dependencies_name_no_path():
    requires = importlib.metadata.requires(distribution_name()) or []
    assert all("@" not in r and "file:" not in r for r in requires), requires


def test_ships_py_typed_marker():
    # PEP 561: without it, type checkers treat an installed gpumon as untyped
    assert importlib.resources.files("gpumon").joinpath("py.typed").is_file()
