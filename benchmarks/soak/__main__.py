"""``python -m benchmarks.soak ARGS`` from a checkout (``--help`` lists them)."""

import logging
import sys

from benchmarks.soak.command import main

logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(main())
