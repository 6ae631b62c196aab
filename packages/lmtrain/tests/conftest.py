import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Loading an export with trust_remote_code copies its modeling code into HF_MODULES_CACHE (by default under
# ~/.cache/huggingface): the tests' copies go to a directory of their own, removed at exit. transformers reads the
# variable when it is first imported, which is after this file.
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
# The harness tests load local task files through `datasets`, which caches what it reads (by default under
# ~/.cache/huggingface) and would try the network for anything else.
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="hf-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The machine's probe answers (lmtrain.probes) go to a file of the test session's own, not the user's cache.
if "LMTRAIN_PROBE_CACHE" not in os.environ:
    _probes = tempfile.mkdtemp(prefix="lmtrain-probes-")
    os.environ["LMTRAIN_PROBE_CACHE"] = os.path.join(_probes, "probes.json")
    atexit.register(shutil.rmtree, _probes, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
