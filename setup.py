"""The optional C extension only; all metadata is in pyproject.toml.

``optional=True``: where it cannot be compiled (no compiler, no Python headers) the
package still installs, and ``broker_lookup.protocol.hashing`` hashes in pure Python.
A worker rank is Python throughout. The benchmarks' native floor is not part of the
package: ``python -m benchmarks.build_native`` builds it in a checkout.
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
    ]
)
