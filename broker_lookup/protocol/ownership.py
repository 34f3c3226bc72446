"""Who holds a role of an engine: the identity of a process and the lease record.

A role is one rank (``"0"``, ``"1"``, ...) or the scheduler (``"sched"``). Its lease key
(``bl:{E}:owner:<role>``, see ``keys``) holds ``<token> <identity>``, written by
``claim.lua``:

* ``<token>`` is ``<epoch>.<nonce>``: the epoch is the engine's per-role counter
  (``bl:{E}:epochs``), so each new owner's epoch is larger; the nonce is the claiming
  process's own, so two claims never share a token even if the counter was lost.
  ``report.lua`` records nothing unless the lease holds the caller's token (fencing).
* ``<identity>`` is compact JSON, ``{"host":..,"pid":..,"started_ms":..,"nonce":..}``:
  what ``redis-cli GET`` and ``inspect`` show, and how a process recognizes its own
  lease (a claim retried after a lost reply finds itself and keeps its token).

Plain ASCII throughout, so ``redis-cli`` reads it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ClaimReply", "Holder", "Identity", "parse_claim_reply", "parse_holder"]

#: What ``claim.lua`` answers: ``claimed`` (a new token), ``renewed`` (the caller held it),
#: ``held`` (another process does), ``released`` / ``absent`` (a release's answers).
ClaimStatus = Literal["claimed", "renewed", "held", "released", "absent"]
_STATUSES: tuple[ClaimStatus, ...] = ("claimed", "renewed", "held", "released", "absent")


@dataclass(frozen=True)
class Identity:
    """One process as a lease names it: host, pid, start time (epoch ms) and a nonce."""

    host: str
    pid: int
    started_ms: int
    nonce: str

    @classmethod
    def mine(cls) -> Identity:
        """This process, now, with a fresh random nonce (one per lease holder object)."""
        return cls(socket.gethostname(), os.getpid(), int(time.time() * 1000), secrets.token_hex(4))

    def encode(self) -> str:
        """The compact JSON ``claim.lua`` stores and compares."""
        body = {"host": self.host, "pid": self.pid, "started_ms": self.started_ms}
        return json.dumps({**body, "nonce": self.nonce}, separators=(",", ":"))

    def describe(self) -> str:
        """``host h pid 12 started 2025-01-01 12:00:00`` for a log line."""
        return describe(self.host, self.pid, self.started_ms)


def describe(host: object, pid: object, started_ms: object) -> str:
    """A process as a log line or ``inspect`` names it."""
    when = "?"
    if isinstance(started_ms, int):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started_ms / 1000))
    return f"host {host} pid {pid} started {when}"


@dataclass(frozen=True)
class Holder:
    """A lease record as read back: its token, epoch and the holder's identity fields."""

    token: str
    epoch: int | None
    info: dict[str, Any]

    def describe(self) -> str:
        """The holder as a log line names it."""
        i = self.info
        return describe(i.get("host", "?"), i.get("pid", "?"), i.get("started_ms"))


def parse_holder(value: str | bytes | None) -> Holder | None:
    """A lease key's value as a :class:`Holder`; None for no value. Never raises."""
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    token, _, rest = text.partition(" ")
    try:
        info = json.loads(rest)
    except ValueError:
        info = {"raw": rest}
    if not isinstance(info, dict):
        info = {"raw": rest}
    head = token.split(".", 1)[0]
    return Holder(token, int(head) if head.isdigit() else None, info)


@dataclass(frozen=True)
class ClaimReply:
    """``claim.lua``'s answer: the status, our token (claimed, renewed, released) or the
    other holder (held)."""

    status: ClaimStatus
    token: str | None = None
    holder: Holder | None = None


def parse_claim_reply(reply: Any) -> ClaimReply:
    """``claim.lua``'s raw ``[status, value]`` reply.

    Raises:
        ValueError: The reply is not one ``claim.lua`` gives (a server error, a bug).
    """
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        raise ValueError(f"unexpected claim.lua reply {reply!r}")
    raw_status, raw_value = (v.decode() if isinstance(v, bytes) else str(v) for v in reply)
    status = next((s for s in _STATUSES if s == raw_status), None)
    if status is None:
        raise ValueError(f"unexpected claim.lua status {raw_status!r}")
    if status == "held":
        return ClaimReply(status, holder=parse_holder(raw_value))
    return ClaimReply(status, token=raw_value or None)
