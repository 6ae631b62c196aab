import pytest
import torch

# The test shapes are tiny: with several OpenMP threads on a shared 2-core machine every op waits for a
# descheduled thread (gradcheck ran 30x slower with 2 threads under load). One thread is also faster here.
torch.set_num_threads(1)


def pytest_configure(config):
    # pytest-xdist registers this mark itself; registered here as well so --strict-markers accepts it without xdist.
    config.addinivalue_line("markers", "xdist_group(name): with --dist loadgroup, run on one pytest-xdist worker")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
