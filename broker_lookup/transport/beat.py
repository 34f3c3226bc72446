"""One process's liveness for one role: the beat, on its own thread and connection.

Liveness is a beat, not a batch. Every ``heartbeat_interval_ms`` the beat of a process
(a rank's server, the scheduler's client) does the periodic work that says it is alive,
and nothing else:

* renews the role's lease (``claim.lua``), with a rank's heartbeat in the same call;
* refreshes the TTL of the engine's lasting keys (streams, fingerprint hash: see
  :mod:`broker_lookup.protocol.lifetime`), with the metrics snapshot when one is due and
  this process holds the lease (one snapshot per role);
* beside it, on a thread and connection of their own (:class:`Checks`), the diagnostics
  that read Redis now and then: the hashing fingerprint every
  :data:`~broker_lookup.protocol.fingerprint.PUBLISH_EVERY_S`, the scheduler's split
  check. Their round trips never delay a renewal: over a 200 ms link a fingerprint's
  four round trips inside the beat made one beat outlast the lease.

It runs on a path that never waits on engine code, a batch or a blocking read: a slow
engine, a slow link under a big batch or one stalled engine call never makes a live
process look dead. What it knows is the :class:`~broker_lookup.transport.lease.Lease`'s
state: the threads that serve read it (a lapse by this process's own clock still stops
them, one owner per role) and wait on it while it is not held.

Its connection has its own socket timeout (:attr:`LookupConfig.beat_timeout_s`, within
half a lease), so a stalled server costs one beat, not the lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis
from redis.exceptions import ResponseError

from broker_lookup.config import LookupConfig
from broker_lookup.errors import (
    AuthFailed,
    BrokerLookupError,
    BrokerResponseError,
    translate_redis_errors,
)
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.lifetime import refresh_commands
from broker_lookup.protocol.snapshot import MetricsPublisher
from broker_lookup.ratelimit import RateLimitedLog
from broker_lookup.threads import LoopThread
from broker_lookup.transport.fingerprint import Publisher
from broker_lookup.transport.lease import Lease, run_claim
from broker_lookup.transport.link import Link, open_link
from broker_lookup.transport.script_runner import ScriptSet

__all__ = ["Beat", "Checks", "Heartbeat"]

logger = logging.getLogger(__name__)

#: How long the beat waits after a Redis error before it tries again (at most one interval).
ERROR_BACKOFF_S = 0.2
#: How often the diagnostics' thread gives each diagnostic a turn (each keeps its own pace).
CHECK_EVERY_S = 1.0


class Diagnostic(Protocol):
    """A periodic check the beat runs on its connection; it keeps its own pace."""

    def tick(self, client: redis.Redis) -> None:
        """Check now if due; never raises."""


class Heartbeat:
    """A rank's heartbeat (``bl:{E}:hb:<r>``): a JSON string with a PX TTL that
    ``claim.lua`` writes with the lease's renewal, only for the lease's holder.

    ``info`` gives what the rank shows besides who it is (its map sizes, counters); it is
    called on the beat's thread, so it reads state, never engine code.

    ``reading`` is set once the rank reads its consumer group: until then no heartbeat is
    written (the lease is claimed without it). A heartbeat is what tells the scheduler to
    submit, and a group made at ``$`` after a submit would never deliver that lookup.
    Once set it stays set: a rank that loses its group later keeps beating (liveness is a
    beat) and re-makes the group at ``0``, so nothing submitted meanwhile is skipped.
    """

    def __init__(
        self,
        rank: int,
        ttl_ms: int,
        info: Callable[[], dict[str, Any]],
        configured_engine_id: str | None = None,
        reading: threading.Event | None = None,
    ) -> None:
        self._rank = rank
        self._reading = reading
        self._ttl_ms = ttl_ms
        self._info = info
        #: The engine id the operator configured, where the key namespace was derived
        #: from it (a vLLM instance): shown in the heartbeat, for inspect and metrics.
        self._configured = configured_engine_id
        self._started_ms = int(time.time() * 1000)

    def body(self) -> tuple[str, int] | None:
        """The heartbeat ``claim.lua`` writes, and its TTL in ms (None: not reading yet)."""
        if self._reading is not None and not self._reading.is_set():
            return None
        body: dict[str, Any] = {
            "rank": self._rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_ms": self._started_ms,
            "ts_ms": int(time.time() * 1000),
            **self._info(),
        }
        if self._configured is not None:
            body["configured_engine_id"] = self._configured
        return json.dumps(body), self._ttl_ms


class Beat(LoopThread):
    """Renews ``lease`` (and ``heartbeat``), refreshes the engine's keys, publishes the
    metrics snapshot and the fingerprint, every heartbeat interval, on its own thread.

    Args:
        config: the process's config (``heartbeat_interval_ms``, ``engine_ttl_ms``).
        keys: the engine's key space.
        lease: the role's lease; this beat is the only thread that claims it.
        factory: the beat's own connection (see :attr:`LookupConfig.beat_timeout_s`).
        name: how the thread and its log lines name it, e.g. ``"rank 0 beat"``.
        heartbeat: a rank's heartbeat, written with each renewal (None: the scheduler).
        metrics: the process's metrics snapshot (None: none).
        fingerprint: the process's hashing fingerprint (None: none).
        diagnostics: checks that read Redis now and then on the beat's connection (the
            scheduler's split check); each keeps its own pace and never raises.
    """

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        lease: Lease,
        factory: Callable[[], redis.Redis],
        name: str,
        *,
        heartbeat: Heartbeat | None = None,
        metrics: MetricsPublisher | None = None,
        fingerprint: Publisher | None = None,
        diagnostics: Sequence[Diagnostic] = (),
    ) -> None:
        super().__init__(name, name.replace(" ", "-"))
        self.lease = lease
        self._factory = factory
        self._heartbeat = heartbeat
        #: The process's metrics snapshot (None: none), written with the keys' refresh.
        self.metrics = metrics
        #: The diagnostics' thread (None: no diagnostics), started and stopped with the beat.
        self.checks = (
            Checks(factory, f"{name} checks", fingerprint, diagnostics)
            if fingerprint is not None or diagnostics
            else None
        )
        self._interval_s = config.heartbeat_interval_ms / 1000
        self._refresh = refresh_commands(keys, config.engine_ttl_ms)
        self._scripts = ScriptSet()
        self._claiming = f"claiming the lease of {name.removesuffix(' beat')}"
        #: Wall-clock seconds of the last heartbeat written (0.0: none yet).
        self.last_beat = 0.0
        #: Beats that failed (Redis unreachable or refusing).
        self.errors = 0
        self._wake = threading.Event()
        self._warn = RateLimitedLog(logger)

    def start(self) -> None:
        """Start the beat, then its diagnostics' thread."""
        super().start()
        if self.checks is not None:
            self.checks.start()

    def wake(self) -> None:
        """Beat now rather than at the next interval (a rank that just started reading
        writes its first heartbeat at once)."""
        self._wake.set()

    def stop(self, timeout_s: float) -> bool:
        """Stop both threads within ``timeout_s`` in all; False if a join timed out."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        ok = super().stop(timeout_s)
        if self.checks is not None:
            ok = self.checks.stop(max(0.0, deadline - time.monotonic())) and ok
        return ok

    def prime(self, client: redis.Redis) -> None:
        """Claim the lease now, through ``client``, before :meth:`start` (a client that
        submits only while it holds it). A failure is left to the thread to retry."""
        try:
            self.renew(client, None)
        except BrokerLookupError as exc:
            logger.debug("%s: first claim failed (the beat retries): %s", self.guard.name, exc)

    def _run(self) -> None:
        client = self._factory()
        link = open_link(client)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                wait_s = self._beat(client, link)
                # The wake event is the stop's too (stop sets both).
                self._wake.wait(max(0.0, started + wait_s - time.monotonic()))
                self._wake.clear()
        finally:
            link.close()
            client.close()

    def _beat(self, client: redis.Redis, link: Link) -> float:
        """One beat; the seconds from its start to the next."""
        try:
            self.renew(client, link)
            self._refresh_keys(link)
        except AuthFailed as exc:
            self._on_error(exc)
            return self._interval_s
        except BrokerLookupError as exc:
            self._on_error(exc)
            return min(ERROR_BACKOFF_S, self._interval_s)
        except Exception:  # a bug: counted and logged, never a silent dead beat
            self.guard()
        return self._interval_s

    def _on_error(self, exc: BrokerLookupError) -> None:
        self.errors += 1
        self._warn(
            logging.WARNING, "%s: Redis error #%d: %s (retrying)", self.guard.name, self.errors, exc
        )

    def renew(self, client: redis.Redis, link: Link | None) -> None:
        """Claim or renew the lease, with the heartbeat (the lease logs and counts a
        conflict); once more at once if ours came back later than the lease."""
        lease = self.lease
        for _ in range(2):
            now = time.monotonic()
            lease.note_lapse(now)
            body = self._heartbeat.body() if self._heartbeat is not None else None
            with translate_redis_errors(self._claiming):
                reply = run_claim(self._scripts, client, link, lease.claim_call(body))
                if isinstance(reply, ResponseError):
                    raise reply
            try:
                held = lease.on_reply(reply, now)
            except ValueError as exc:
                raise BrokerResponseError(f"{self._claiming}: {exc}") from None
            if held and body is not None:
                self.last_beat = time.time()
            if held or lease.holder is not None:
                return

    def _refresh_keys(self, link: Link) -> None:
        """The engine's lasting keys' TTL, by any live process of the engine, holder of the
        lease or not; the metrics snapshot (the holder's only) in the same round trip."""
        now = time.monotonic()
        metrics = self.metrics
        snapshot: Command | None = None
        if metrics is not None and self.lease.held(now):
            snapshot = metrics.command(now)
        commands = [*self._refresh, *([snapshot] if snapshot is not None else [])]
        with translate_redis_errors("refreshing the engine's keys"):
            for reply in link.call(commands):
                if isinstance(reply, ResponseError):
                    raise reply


class Checks(LoopThread):
    """The diagnostics of one process (its fingerprint, the scheduler's split check), on
    their own thread and connection so that their round trips never delay the beat; each
    keeps its own pace and never raises, this loop only gives them a turn every
    :data:`CHECK_EVERY_S`."""

    def __init__(
        self,
        factory: Callable[[], redis.Redis],
        name: str,
        fingerprint: Publisher | None,
        diagnostics: Sequence[Diagnostic],
    ) -> None:
        super().__init__(name, name.replace(" ", "-"))
        self._factory = factory
        self._fingerprint = fingerprint
        self._diagnostics = tuple(diagnostics)

    def _run(self) -> None:
        client = self._factory()
        try:
            while not self._stop.is_set():
                try:
                    if self._fingerprint is not None:
                        self._fingerprint.tick(client)
                    for diagnostic in self._diagnostics:
                        diagnostic.tick(client)
                except Exception:  # a bug: counted and logged, the loop goes on
                    self.guard()
                self._stop.wait(CHECK_EVERY_S)
        finally:
            client.close()
