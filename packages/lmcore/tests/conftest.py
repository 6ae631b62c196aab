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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
