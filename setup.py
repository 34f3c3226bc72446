"""The optional C extensions only; all metadata is in pyproject.toml.

``optional=True``: where they cannot be compiled (no compiler, no Python headers) the
package still installs; ``broker_lookup.protocol.hashing`` then hashes in pure Python,
and ``broker-lookup bench --floor`` leaves out the native floor (bench tooling only).
A worker rank is Python throughout.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "broker_lookup.protocol._chunk_hash",
            ["broker_lookup/protocol/_chunk_hash.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension(
            "broker_lookup.tools.bench._native_floor",
            ["broker_lookup/tools/bench/_native_floor.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
