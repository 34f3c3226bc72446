"""The fault state of the :class:`~faultproxy.FaultProxy`: faults, counters.

:class:`FaultState` is what the public methods change and the selector thread reads,
always under its lock; :class:`LoseRule` is one pending ``lose_reply``.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from faultproxy.resp_frames import Frame

__all__ = ["FaultState", "LoseRule"]

_SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA"})
_STAT_NAMES = (
    "connections",  # client connections accepted (refused ones included)
    "refused",  # connections reset at once because refuse() was on
    "resets",  # client connections the proxy reset (any cause)
    "upstream_failures",  # connects to the server that failed (its client is reset)
    "commands",  # client commands parsed
    "replies",  # server replies parsed (RESP3 pushes are none)
    "replies_lost",  # replies discarded by lose_reply
    "bytes_up",  # bytes read from clients
    "bytes_down",  # bytes read from the server
)


@dataclass
class LoseRule:
    """A pending ``lose_reply``: ``left`` more ``name`` commands lose their reply."""

    name: str
    sha: str  # a script's sha1 prefix, lower-case; "" matches any
    left: int
    then: str

    def matches(self, frame: Frame) -> bool:
        """Whether ``frame`` (a command) is one this rule loses the reply of."""
        name = frame.name
        if not self.sha:
            return name == self.name
        # A script is the same whether called by sha or by body (redis-py falls back
        # from EVALSHA to EVAL on NOSCRIPT), so the sha picks it either way.
        if self.name not in _SCRIPT_COMMANDS or name not in _SCRIPT_COMMANDS:
            return False
        if len(frame.args) < 2:
            return False
        arg = frame.args[1]
        sha = arg.decode("latin-1").lower() if name == "EVALSHA" else _sha1(arg)
        return sha.startswith(self.sha)


def _sha1(script: bytes) -> str:
    return hashlib.sha1(script, usedforsecurity=False).hexdigest()


class FaultState:
    """The faults in force and the counters, shared by the API and the loop under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = False
        self.refusing = False
        self.delay_s = 0.0
        self.rules: list[LoseRule] = []
        self.stats = dict.fromkeys(_STAT_NAMES, 0)
        self.open_clients = 0

    def count(self, **deltas: int) -> None:
        """Add ``deltas`` to the counters."""
        with self.lock:
            for name, delta in deltas.items():
                self.stats[name] += delta

    def mark(self, frames: list[Frame]) -> list[str | None]:
        """Count ``frames`` as commands; say which lose their reply (the rule's ``then``)."""
        with self.lock:
            self.stats["commands"] += len(frames)
            if not self.rules:
                return [None] * len(frames)
            marks = [self._consume(frame) for frame in frames]
            self.rules = [rule for rule in self.rules if rule.left > 0]
            return marks

    def _consume(self, frame: Frame) -> str | None:
        for rule in self.rules:
            if rule.left > 0 and rule.matches(frame):
                rule.left -= 1
                return rule.then
        return None
