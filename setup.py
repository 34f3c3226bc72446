"""The optional C extensions only; all metadata is in pyproject.toml.

``optional=True``: where they cannot be compiled (no compiler, no Python headers) the
package still installs; ``broker_lookup.protocol.hashing`` then hashes in pure Python, a
rank reads every batch, packs every write, makes every lifecycle transition and serves
every request, report and answer in Python (``workers.pipeline.reader``, ``reporter``,
``lifecycle``, ``dispatch``), and ``broker-lookup bench --floor`` leaves out the native
floor (bench tooling only).
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
            "workers.pipeline._scan",
            ["workers/pipeline/_scan.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "workers.pipeline._pack",
            ["workers/pipeline/_pack.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "workers.pipeline._transitions",
            ["workers/pipeline/_transitions.c"],
            depends=["workers/pipeline/_held.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "workers.pipeline._dispatch",
            ["workers/pipeline/_dispatch.c"],
            depends=["workers/pipeline/_held.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "broker_lookup.tools.bench._native_floor",
            ["broker_lookup/tools/bench/_native_floor.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
