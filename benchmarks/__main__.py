"""`python -m benchmarks FAMILY ...`: see benchmarks/runner.py."""

import sys

from benchmarks.runner import main

sys.exit(main())
