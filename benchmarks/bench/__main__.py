"""``python -m benchmarks.bench ARGS`` from a checkout (``--help`` lists them)."""

import logging
import sys

from benchmarks.bench.command import main

logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(main())
