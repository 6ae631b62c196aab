import pytest


def pytest_collection_modifyitems(config, items):
    # gpumon does not depend on torch; a GPU test needs a real NVIDIA driver.
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return
    except Exception:
        pass
    skip = pytest.mark.skip(reason="needs an NVIDIA driver; NVML could not be initialised")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
