"""Which LMCache this process runs, for heartbeats, metrics and log lines.

Imports nothing of LMCache: a process that has not imported it runs none
(:func:`running_lmcache_version` is None), so a reference-engine rank says so too.
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["running_lmcache_version"]


def running_lmcache_version() -> str | None:
    """The version of the LMCache this process has imported; None when it has not.

    The imported package's ``__version__`` where it has one, else the installed
    distribution's version, else ``"unknown"``.
    """
    module = sys.modules.get("lmcache")
    if module is None:
        return None
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version and version != "unknown":
        return version
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
