"""The scheduler's lookup clients over Redis: async and synchronous.

Hot path: ``lookup_cache`` is a dict read (no I/O, no sleep, no lock);
``lookup`` hashes the tokens and appends to a queue. A sender thread pipelines
the writes and a listener thread turns completion events into table entries.

vLLM calls these methods inside ``Scheduler.schedule()`` with ids taken from a
client's ``X-Request-Id`` header, so none of them raises on request data: a request
the protocol cannot carry is answered 0 (recompute), counted in ``stats()`` and logged
once per kind (see :mod:`broker_lookup.client.guard`). :meth:`RedisAsyncLookupClient.validate`
is the strict, raising check for callers that want it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from broker_lookup.client.admission import Admission, Rejected
from broker_lookup.client.breaker import Breaker
from broker_lookup.client.guard import Guard
from broker_lookup.client.insights import RankInsights
from broker_lookup.client.listener import Listener
from broker_lookup.client.sender import Sender
from broker_lookup.client.split import SplitWatch
from broker_lookup.client.table import Entry, LookupTable, Outcome
from broker_lookup.config import LookupConfig, LookupMetadata, expected_ranks
from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.interface import LookupClientInterface
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace
from broker_lookup.protocol.messages import LookupRequest
from broker_lookup.protocol.snapshot import MetricsPublisher
from broker_lookup.protocol.stats import ClientStats
from broker_lookup.transport.beat import Beat
from broker_lookup.transport.connection import ConnectionFactory, close_factory, make_factory
from broker_lookup.transport.fingerprint import Publisher
from broker_lookup.transport.lease import Lease
from broker_lookup.transport.script_runner import ScriptSet

if TYPE_CHECKING:
    import torch

__all__ = ["RedisAsyncLookupClient", "RedisLookupClient"]

logger = logging.getLogger(__name__)


class RedisAsyncLookupClient(LookupClientInterface):
    """LMCache's ``LMCacheAsyncLookupClient`` contract, brokered by Redis.

    >>> client = RedisAsyncLookupClient(config, metadata)    # doctest: +SKIP
    >>> client.lookup(token_ids, "req-1")                     # None: in flight
    >>> client.lookup_cache("req-1")                          # None ... then hit tokens
    """

    def __init__(
        self,
        config: LookupConfig,
        metadata: LookupMetadata,
        *,
        connection_factory: ConnectionFactory | None = None,
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.keys = KeySpace(metadata.engine_id)
        self.expected = expected_ranks(config, metadata)
        # One list for every request: nothing mutates it, and one per lookup would be a
        # tracked object alive for the lookup (see table.Entry).
        self._expected_ranks = list(self.expected)
        self.hasher = ChunkedTokenHasher(config)
        self._gens = itertools.count(time.time_ns() // 1000)
        self._deadline_rule = config.deadline_rule()
        #: Keeps the contract path from raising: what it could not serve, by kind.
        self._guard = Guard()
        self._admission = Admission(config, self.hasher, self._guard)
        self._breaker = Breaker(config.breaker_open_ms / 1000, ("sender", "listener"))
        self._factories: list[ConnectionFactory] = []
        if connection_factory is None:
            name = f"bl-client-{metadata.engine_id}"
            # The sender retries a batch itself, and not once past close()'s grace.
            writer = make_factory(config, name, own_retries=True)
            # A stalled server must cost the listener at most BLOCK plus the breaker's
            # threshold, so its timeout sweeps never pause for a full socket timeout.
            reader = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
            beat = make_factory(config, name + "-beat", socket_timeout_s=config.beat_timeout_s)
            self._factories = [writer, reader, beat]
        else:
            writer = reader = beat = connection_factory
        self._retention_s = config.retention_ms / 1000
        self._table = LookupTable(
            self._cancel_gen,
            config.max_pending,
            self._retention_s,
            deadline=self._at_deadline,
            partial=config.partial_answers,
            wait_s=config.wait_ms / 1000,
        )
        #: Per-rank latency, stragglers and disagreement (``rank_insights``; None: off).
        self.insights = (
            RankInsights(
                self.expected,
                config.rank_spread_warn_share,
                max_per_s=config.rank_insights_max_per_s,
            )
            if config.rank_insights
            else None
        )
        self._sender = Sender(
            config,
            self.keys,
            self._table,
            writer,
            ScriptSet(),
            self._breaker,
            self.insights,
            expected=",".join(map(str, self.expected)),
        )
        #: One scheduler per engine: this client submits only while it holds this lease
        #: (claimed now, renewed by the beat; never on the hot path).
        self.lease = Lease(
            self.keys, SCHEDULER_ROLE, "the scheduler", config.lease_ms, config.epochs_ttl_ms
        )
        self._writer = writer
        #: Publishes our hashing fingerprint and lists processes that hash differently.
        self.fingerprint = Publisher(self.keys, "client", self.hasher, ttl_ms=config.engine_ttl_ms)
        #: Logs a split engine: missing ranks alive under another namespace of our id.
        self.split = SplitWatch(self.keys, self.expected, self._missing_ranks)
        self._listener = Listener(
            config, self.keys, self._table, reader, self.expected, self._breaker, self.insights
        )
        #: The scheduler's liveness: its lease, the engine keys' refresh, its metrics
        #: snapshot and fingerprint, on a thread of its own.
        self._beat = Beat(
            config,
            self.keys,
            self.lease,
            beat,
            "scheduler beat",
            metrics=MetricsPublisher(
                self.keys,
                SCHEDULER_ROLE,
                "client",
                self.stats,
                interval_ms=config.metrics_period_ms,
                ttl_ms=config.metrics_ttl_ms,
                configured_engine_id=metadata.configured_engine_id,
            ),
            fingerprint=self.fingerprint,
            diagnostics=(self.split,),
        )
        self._closed = False
        self._sender.start()
        probe = reader()
        try:
            self._listener.prime(probe)
            self._beat.prime(probe)
            self.fingerprint.run(probe)
            self._listener.start()
            self._beat.start()
        finally:
            probe.close()

    def _missing_ranks(self) -> frozenset[int] | None:
        listener = self._listener
        return listener.dead if listener.checked else None

    # -- hot path -------------------------------------------------------------------

    def lookup_cache(self, lookup_id: str) -> int | None:
        """-1 unknown, None in flight, else hit tokens (0 after a timeout, until cleared),
        for ``result_retention_ms`` after the answer; -1 again after that."""
        try:
            entry = self._table.entries.get(lookup_id)
        except TypeError:  # an unhashable id: nothing was ever recorded under it
            self._guard.rejected("bad_id", lookup_id, "lookup_id is unhashable")
            return -1
        if entry is None:
            return -1
        result = entry.result
        now = time.monotonic()
        if result is not None:
            # Past its retention the ranks may have released the pins this result stands
            # for: ask again (-1) rather than promise them. The listener evicts it later.
            return result if now - entry.finished < self._retention_s else -1
        if now >= entry.deadline:
            return self._table.on_deadline(lookup_id, entry, now)
        if not entry.sent and self._breaker.is_open(now):
            # Queued behind a stalled server: answer 0 now, not at the timeout.
            return self._table.expire(lookup_id, entry, "unavailable")
        return None

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        """Start a lookup; None while in flight, or an int when answered without Redis.

        Never raises on request data: what cannot be looked up is answered 0.
        """
        # A bug of ours must not kill the scheduler's engine: answered 0 and counted.
        entry = self._guard.call(
            "internal_error",
            lookup_id,
            0,
            self._submit,
            token_ids,
            lookup_id,
            request_configs,
            with_event=False,
        )
        return entry if isinstance(entry, int) else None

    def validate(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        """Strict check, for callers that want one: raise InvalidRequest naming the limit a
        request breaks (``lookup`` itself answers such a request 0 instead)."""
        self._admission.check(token_ids, lookup_id, request_configs)

    def _submit(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
        with_event: bool,
    ) -> Entry | int:
        """Admit the lookup and hand it to the sender (``Sender.submit``): its entry, or
        the answer given without Redis (0). ``with_event``: the caller waits on it."""
        admitted = self._admission.admit(token_ids, lookup_id, request_configs)
        if isinstance(admitted, Rejected):
            if isinstance(lookup_id, str):
                self._record(lookup_id, with_event, "rejected")
            return 0
        hashes, offsets = admitted
        if not hashes:  # shorter than one chunk: nothing to ask (LMCache D17)
            self._record(lookup_id, with_event, "miss")
            return 0
        now = time.monotonic()
        tokens = sum(offsets)
        budget_ms = self._deadline_rule.budget_ms(tokens)
        event = threading.Event() if with_event else None
        entry = Entry(next(self._gens), now, now + budget_ms / 1000, tokens, self.expected, event)
        # Unavailable before dead_rank: while Redis fails, or before its first heartbeat
        # read, "dead" ranks are only a guess, and the fix is Redis's, not the ranks'.
        if self._breaker.is_open(now) or not self._listener.checked:
            self._table.add(lookup_id, entry, finished="unavailable")
            return 0
        if not self.lease.held(now):
            # Another scheduler serves this engine id (the lease logged it, once), or ours
            # lapsed: submitting would share its ranks and its done stream.
            outcome: Outcome = "duplicate_scheduler" if self.lease.holder else "unavailable"
            self._table.add(lookup_id, entry, finished=outcome)
            return 0
        if self._listener.dead.intersection(self.expected):
            self._table.add(lookup_id, entry, finished="dead_rank")
            return 0
        if not self._table.add(lookup_id, entry):
            self._guard.rejected("table_full", lookup_id, f"max_pending={self.config.max_pending}")
            return 0
        request = LookupRequest(
            lookup_id=lookup_id,
            gen=entry.gen,
            hashes=hashes,
            offsets=offsets,
            expected=self._expected_ranks,
            deadline_ms=int(time.time() * 1000) + budget_ms,
            request_configs=request_configs,
            tokens=tokens,
            budget_ms=budget_ms,
        )
        if not self._sender.submit(entry, request):
            self._table.expire(lookup_id, entry, "unavailable")
            return 0
        return entry

    def _record(self, lookup_id: str, with_event: bool, outcome: Outcome) -> None:
        """Record an answer given without Redis, so lookup_cache returns it until cleared."""
        now = time.monotonic()
        event = threading.Event() if with_event else None
        entry = Entry(next(self._gens), now, now, 0, self.expected, event)
        self._table.add(lookup_id, entry, finished=outcome)

    # -- lifecycle of one id ----------------------------------------------------------

    def clear_lookup_status(self, lookup_id: str) -> None:
        """Forget the result; a lookup still in flight is cancelled so ranks release it."""
        self._guard.call("bad_clear", lookup_id, None, self._table.pop, lookup_id, None)

    def cancel_lookup(self, lookup_id: str) -> None:
        """Abort: delete the lookup's key and tell every rank to release its memory.

        Works after ``clear_lookup_status`` too (vLLM clears on allocation and cancels
        on abort): the cleared generation is remembered so its pins are released.
        """
        self._guard.call("bad_cancel", lookup_id, None, self._table.pop, lookup_id, "cancelled")

    def _cancel_gen(self, lookup_id: str, gen: int) -> None:
        self._sender.cancel(lookup_id, gen)

    def _at_deadline(self, lookup_id: str, entry: Entry, answer: bool) -> None:
        self._sender.deadline(lookup_id, entry, answer)

    def supports_producer_reuse(self) -> bool:
        """True, as LMCache's async client."""
        return True

    # -- observability and shutdown ---------------------------------------------------

    def stats(self) -> ClientStats:
        """Counters for metrics and tests; cheap, takes no lock."""
        t = self._table
        insights = self.insights
        return ClientStats(
            outcomes=dict(t.counts),
            hit_tokens=t.hit_tokens,
            rejected=dict(self._guard.counts),
            truncated=self._admission.truncated,
            stale_events=t.stale_events,
            latency_counts=tuple(t.latency.counts),
            latency_sum=t.latency.total,
            inflight=len(t.inflight),
            entries=len(t.entries),
            queued=self._sender.queued,
            breaker_open=self._breaker.is_open(),
            breaker_openings=self._breaker.openings,
            send_queue_full=self._sender.dropped,
            direct_submits=self._sender.direct_submits,
            redis_errors=self._sender.errors + self._listener.errors,
            unexpected_errors=(
                self._sender.guard.count + self._listener.guard.count + self._beat.guard.count
            ),
            dead_ranks=tuple(sorted(self._listener.dead)),
            liveness_known=self._listener.checked,
            ownership=self.lease.state(),
            rank_insights=insights.snapshot() if insights is not None else None,
        )

    def close(self) -> None:
        """Cancel what is in flight, flush the queue, stop both threads (bounded), and
        close every connection this client opened. Never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            for lookup_id, entry in self._table.drain_inflight():
                self._sender.cancel(lookup_id, entry.gen)
            # One grace for both threads, not one each. Past it the sender makes no
            # attempt (nor reconnects) and the pools below are closed under whatever
            # round trip still waits on a stalled server.
            grace = self.config.loop_timeout_s + 2.0
            deadline = time.monotonic() + grace
            self._listener.stop(0.0)  # it ends its read while the sender drains
            self._beat.stop(0.0)  # before the release: it would claim again
            ok = self._sender.stop(grace)
            ok = self._listener.stop(max(0.0, deadline - time.monotonic())) and ok
            ok = self._beat.stop(max(0.0, deadline - time.monotonic())) and ok
            if not ok:
                logger.error("lookup client threads did not stop within %.1fs", grace)
            # Released only where Redis answers: the release's round trip has no grace left
            # to wait on a stalled server, and an unreleased lease expires by itself.
            if ok and self._listener.connected and not self._breaker.is_open(time.monotonic()):
                self._release_lease()
        except Exception:
            logger.exception("lookup client close failed; connections are closed anyway")
        finally:
            for factory in self._factories:
                close_factory(factory)

    def _release_lease(self) -> None:
        """Give the scheduler's lease up (the next scheduler takes over at once); a
        failure is logged: the lease then expires by itself."""
        client = self._writer()
        try:
            with translate_redis_errors("releasing the scheduler's lease"):
                ScriptSet().call(client, self.lease.release_call(rank=False))
        except BrokerLookupError as exc:
            logger.warning("scheduler's lease not released at close (it expires): %s", exc)
        finally:
            client.close()

    def __enter__(self) -> RedisAsyncLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisLookupClient(RedisAsyncLookupClient):
    """Synchronous variant: ``lookup`` waits (at most ``lookup_timeout_ms``) and returns the int."""

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """Hit tokens on every expected rank (min), or 0 on timeout, miss or error."""
        # A bug of ours must not kill the scheduler's engine: answered 0 and counted.
        entry = self._guard.call(
            "internal_error",
            lookup_id,
            0,
            self._submit,
            token_ids,
            lookup_id,
            request_configs,
            with_event=True,
        )
        if isinstance(entry, int):
            return entry
        assert entry.event is not None  # created with_event=True above
        entry.event.wait(max(0.0, entry.deadline - time.monotonic()))
        if entry.result is not None:
            return entry.result
        answer = self._table.on_deadline(lookup_id, entry, time.monotonic())
        if answer is not None:
            return answer
        # Its partial answer was asked for: wait for it, at most partial_answer_wait_ms.
        entry.event.wait(max(0.0, entry.deadline + self.config.wait_ms / 1000 - time.monotonic()))
        if entry.result is None:
            return self._table.expire(lookup_id, entry)
        return entry.result

    def lookup_cache(self, lookup_id: str) -> int | None:
        """-1 unknown, else the result (the sync client never reports 'in flight')."""
        result = super().lookup_cache(lookup_id)
        return -1 if result is None else result

    def supports_producer_reuse(self) -> bool:
        """False, as LMCache's sync client."""
        return False
