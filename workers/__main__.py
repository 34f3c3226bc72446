"""``python -m workers``: run worker ranks; see :mod:`workers.runner`."""

from __future__ import annotations

import sys

from workers.runner import main

if __name__ == "__main__":
    sys.exit(main())
