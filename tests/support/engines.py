"""A controllable engine for protocol tests: the test decides when and what each rank reports.

It is a test double for the engine seam, not a stand-in for the real engine
(``workers.ReferenceEngine``), which the end-to-end tests use.
"""

from __future__ import annotations

import threading
from typing import Any


class ManualEngine:
    """Records every call; reports only when the test calls :meth:`report`."""

    def __init__(self) -> None:
        self.server: Any = None
        self.started: list[tuple[str, list[int], list[int], dict[str, Any] | None]] = []
        self.released: list[str] = []
        self.fail_start = False
        self._lock = threading.Lock()

    def post_init(self, async_lookup_server: Any = None) -> None:
        self.server = async_lookup_server

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        if self.fail_start:
            raise RuntimeError("engine exploded")
        with self._lock:
            self.started.append((lookup_id, hashes, offsets, request_configs))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        with self._lock:
            self.released.append(lookup_id)

    def report(self, lookup_id: str, hits: int) -> None:
        self.server.send_response_to_scheduler(lookup_id, hits)

    def started_ids(self) -> list[str]:
        with self._lock:
            return [s[0] for s in self.started]


class InstantEngine(ManualEngine):
    """Reports ``hits`` (capped to the request's tokens) as soon as a lookup starts."""

    def __init__(self, hits: int) -> None:
        super().__init__()
        self.hits = hits

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        super().async_lookup_and_prefetch(lookup_id, hashes, offsets, pin, request_configs)
        self.server.send_response_to_scheduler(lookup_id, min(self.hits, sum(offsets)))
