"""``python -m benchmarks.build_native``: build the native floor's C extension in place.

The native floor (``bench/_native_floor.c``: the floor's rank turn in C) is benchmark
tooling, so the package's ``setup.py`` does not build it. Without it ``--floor`` and
``--paired`` leave the native side out; CI builds it, and its unit test fails there
without it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup

BENCH = Path(__file__).resolve().parent / "bench"


def main() -> None:
    """Compile ``benchmarks/bench/_native_floor.c`` next to its source."""
    # From bench/ itself: setuptools wants sources relative to the working directory, and
    # there it finds no pyproject.toml (the package's) to mix into this build.
    os.chdir(BENCH)
    with tempfile.TemporaryDirectory() as temp:  # build files: none left in the tree
        setup(
            name="broker-lookup-benchmarks",
            ext_modules=[
                Extension("_native_floor", ["_native_floor.c"], extra_compile_args=["-O2"])
            ],
            script_args=["-q", "build_ext", "--inplace", "-t", temp, "-b", temp, *sys.argv[1:]],
        )


if __name__ == "__main__":
    main()
