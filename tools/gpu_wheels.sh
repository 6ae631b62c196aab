#!/usr/bin/env bash
# Build, on this machine, the pure-Python wheels that tools/gpu_check.sh needs and a GPU host lacks.
# They land in .whl/ (ignored by git); the device run carries that folder.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip wheel -q --no-deps -w .whl "prefetch_generator==1.0.3"
ls -l .whl
