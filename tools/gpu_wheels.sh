#!/usr/bin/env bash
# Unpack, on this machine, the pure-Python modules tools/gpu_check.sh needs and the GPU host's image lacks
# (prefetch_generator for tokbin, nvidia-ml-py's pynvml for gpumon) into .gpu-site/. The folder ignores itself
# (.gpu-site/.gitignore: "*"), so no git configuration changes; carry it to the device run (carry: [".gpu-site"]),
# where gpu_check.sh puts it on PYTHONPATH: nothing is installed there. Compiled modules cannot travel this way
# (sentencepiece would need a wheel for the host's Python 3.12): the parts that need them are skipped there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-site
python3 -m pip install -q --no-deps --no-compile --target .gpu-site "prefetch_generator==1.0.3" "nvidia-ml-py>=12.535"
echo '*' >.gpu-site/.gitignore
ls .gpu-site
