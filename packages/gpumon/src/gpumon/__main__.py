"""`python -m gpumon` is the `gpumon` command."""

import sys

from gpumon.cli import main

sys.exit(main())
