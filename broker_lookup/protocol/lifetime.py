"""How long an engine's keys live: none outlives its engine by more than ``engine_ttl_ms``.

Many engines share one server, and vLLM's default engine id is a fresh uuid per start,
so an engine that stops or dies must leave nothing behind (with ``noeviction`` a
leftover stream would fill the server). Every key of an engine has a TTL:

* a lookup hash: its deadline plus ``key_grace_ms`` (set by the script that writes it);
* a heartbeat: ``heartbeat_ttl_ms`` (rewritten by each beat);
* the streams (``requests``, ``done``, ``dead``) and the fingerprint hash
  (:attr:`~broker_lookup.protocol.keys.KeySpace.lasting`): ``engine_ttl_ms``. Every write
  that may create one of them sets it in the same round trip (a script's XADD tries
  ``NOMKSTREAM`` first and, only where there was no stream, creates it and sets its
  PEXPIRE in the same script, so a process that dies right after creating a stream leaves
  no key without a TTL), and every live process refreshes all of them once per
  ``heartbeat_interval_ms`` with :func:`refresh_commands` (a rank with its heartbeat, the
  scheduler's client from its listener thread), so an idle engine loses nothing.

A consumer group lives inside its stream: if the stream expired (the engine was idle
and every process paused longer than the TTL), the rank's next read fails with NOGROUP
and it creates the group again (groups are re-created on NOGROUP). ``LookupConfig`` checks that
``engine_ttl_ms`` exceeds the heartbeat's and every lookup hash's TTL, so
``engine_ttl_ms`` bounds them all.
"""

from __future__ import annotations

from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace

__all__ = ["refresh_commands"]


def refresh_commands(keys: KeySpace, ttl_ms: int) -> list[Command]:
    """The PEXPIREs that keep ``keys``' lasting keys alive for ``ttl_ms`` more (a missing
    key stays missing: PEXPIRE creates nothing)."""
    return [("PEXPIRE", key, ttl_ms) for key in keys.lasting]
