"""Under torchrun: a gloo worker still running Python for this script when the script ends without closing anything.

A callback on a collective's future runs on the worker that completed it, as the release of a finished collective's
tensors does (which frees their Python objects, and needs the GIL, a moment after the caller's wait returned). Here
the callback computes for ``{"busy_s": ...}`` seconds and the script ends while it does: trainloop's atexit teardown
must let it finish before the interpreter finalises, or the worker is made to exit inside a C++ destructor and the
rank aborts. When it finishes it writes RUN_DIR/released_<rank>.json with the name of the thread it ran on.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainloop import TrainConfig, make_engine


def release(path: Path, busy_s: float) -> None:
    end = time.monotonic() + busy_s
    while time.monotonic() < end:  # computes, holding the GIL between switches
        pass
    with open("/proc/thread-self/comm") as f:
        path.write_text(json.dumps({"thread": f.read().strip()}))


def main() -> None:
    args = json.loads(sys.argv[1])
    make_engine(torch.nn.Linear(2, 2), TrainConfig(engine="torch"))  # the process group, set up by trainloop
    path = Path(args["run_dir"]) / f"released_{os.environ['RANK']}.json"
    future = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    future.then(lambda _: release(path, args["busy_s"]))
    time.sleep(0.2)  # the collective is done and its callback under way on the worker: the script ends meanwhile


if __name__ == "__main__":
    main()
