"""``python -m benchmarks.gpu_check``: see the package docstring or ``--help``."""

import sys

from .cli import main

sys.exit(main())
