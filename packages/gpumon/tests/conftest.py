import pytest
from nvml_driver import driver_present


def pytest_collection_modifyitems(config, items):
    # gpumon does not depend on torch; a GPU test needs a real NVIDIA driver.
    if driver_present():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA driver; NVML could not be initialised")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
