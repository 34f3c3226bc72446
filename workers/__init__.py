"""Worker side of broker-lookup: the lookup server, the reference engine, the rank runner.

``ReferenceEngine`` is imported on first use: it needs torch, which costs a rank
process over a second at start-up when its engine is another one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.server import RedisAsyncLookupServer

if TYPE_CHECKING:
    from workers.reference_engine import ReferenceEngine

__all__ = ["RedisAsyncLookupServer", "ReferenceEngine"]


def __getattr__(name: str) -> Any:
    if name == "ReferenceEngine":
        from workers.reference_engine import ReferenceEngine

        return ReferenceEngine
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
