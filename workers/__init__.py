"""Worker side of broker-lookup: the lookup server, the reference engine, the rank runner.

Both names are imported on first use: ``python -m workers`` must install its signal
handlers before anything heavy loads (``ReferenceEngine`` needs torch, which takes a
rank process over a second to import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.reference.engine import ReferenceEngine
    from workers.server import RedisAsyncLookupServer

__all__ = ["RedisAsyncLookupServer", "ReferenceEngine"]

_HOMES = {"RedisAsyncLookupServer": "workers.server", "ReferenceEngine": "workers.reference.engine"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
