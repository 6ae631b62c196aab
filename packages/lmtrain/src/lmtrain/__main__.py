"""`python -m lmtrain ...` is `lmtrain ...` (torchrun's `-m lmtrain` form)."""

import sys

from lmtrain.cli import main

sys.exit(main())
