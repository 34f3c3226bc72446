"""Stub of the optional C extension (``_pack.c``); see ``workers.pipeline.reporter``."""

from collections.abc import Callable

from broker_lookup.transport.lean import Command
from workers.pipeline.reporter import Report

class Packer:
    """The bytes of one rank's write after a batch: its XACK, reports and next read."""

    def __init__(
        self,
        stream: str,
        group: str,
        sha: str,
        done_key: str,
        rank: int,
        done_maxlen: int,
        done_ttl_ms: int,
        key_of: Callable[[str], str],
        fence: tuple[str, str] | None = None,
    ) -> None: ...
    def pack(
        self, ack_ids: list[bytes], reports: list[Report], read: Command | None, /
    ) -> bytes | None:
        """hiredis' packing of the XACK of ``ack_ids`` (none if empty), one report.lua
        EVALSHA per report and ``read``; None if a report or argument is not a plain one (a
        float, a progress report, past 64 bits, not UTF-8)."""
