"""What ``stats()`` returns: :class:`ClientStats` (a scheduler's lookup client) and
:class:`RankStats` (a worker rank's server), for metrics, health checks, the metrics
snapshot and tests.

Frozen Structs read by attribute, so a misspelt field is a type error. Counters keyed by
data (outcomes, rejection kinds, a rank's event counts) stay mappings; whatever has a
fixed set of names is a field. Every field has a default: a client without Redis
(``BypassLookupClient``) leaves what it has no use for at zero, and a snapshot from a
process of a neighbouring version reads back with what it lacks at its default.

A metrics snapshot carries them as JSON objects (:func:`as_json_object`, field name ->
value, as ``redis-cli GET`` shows them); the exporter reads them back with
:func:`client_stats` and :func:`rank_stats`, ignoring fields it does not know.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from broker_lookup.errors import MalformedMessage

__all__ = [
    "ClientStats",
    "ConsumerStats",
    "InsightsStats",
    "Ownership",
    "RankInsightRow",
    "RankStats",
    "as_json_object",
    "client_stats",
    "rank_stats",
]


_S = TypeVar("_S", "ClientStats", "RankStats")


class Ownership(msgspec.Struct, frozen=True, kw_only=True):
    """One role's lease as this process sees it (one owner per role)."""

    owner: bool = False  #: this process holds the lease and serves the role
    epoch: int | None = None  #: the lease's epoch (None: never held)
    holder: str | None = None  #: another live holder, as a log line names it
    # Counts since start.
    conflicts: int = 0  #: times another live process was found holding the role
    lost: int = 0  #: times the lease went to another process
    claims: int = 0  #: claim round trips made


class RankInsightRow(msgspec.Struct, frozen=True, kw_only=True):
    """One expected rank's figures (``rank_insights``), over the timed lookups."""

    #: time from a lookup's submit to this rank's report, per latency bucket (+ overflow)
    report_counts: tuple[int, ...] = ()
    report_sum: float = 0.0  #: seconds, the sum of those times
    last: int = 0  #: lookups this rank completed by reporting last
    excess_lookups: int = 0  #: lookups where it reported more hits than the minimum
    excess_tokens: int = 0  #: tokens it reported above the minimum
    late: int = 0  #: lookups that reached their deadline before it reported


class InsightsStats(msgspec.Struct, frozen=True, kw_only=True):
    """Per-rank latency, last to report and disagreement (``rank_insights``)."""

    recorded: int = 0  #: completion events that carried insights (timed lookups)
    represented: int = 0  #: the lookups those stand for (the sum of their weights)
    ranks: dict[int, RankInsightRow] = {}  #: expected rank -> its figures
    #: max - min hits over the ranks of one lookup, per spread bucket (+ overflow)
    spread_counts: tuple[int, ...] = ()
    spread_sum: float = 0.0  #: tokens, the sum of those spreads
    spread_warnings: int = 0  #: WARNINGs logged for a spread over rank_spread_warn_share


class ClientStats(msgspec.Struct, frozen=True, kw_only=True):
    """A scheduler's lookup client: what it answered, what it holds, how Redis treats it.

    >>> ClientStats(outcomes={"hit": 2}).outcomes["hit"]
    2
    """

    # Answers.
    outcomes: dict[str, int] = {}  #: finished lookups by outcome (hit, miss, timeout, ...)
    hit_tokens: int = 0  #: hit tokens over finished lookups
    rejected: dict[str, int] = {}  #: requests answered 0 unserved, by kind
    truncated: int = 0  #: prompts over max_chunks_per_request, looked up by their head
    stale_events: int = 0  #: completion events of a lookup no longer tracked
    latency_counts: tuple[int, ...] = ()  #: lookup() to result, per bucket (+ overflow)
    latency_sum: float = 0.0  #: seconds, the sum of those latencies
    # What it holds.
    inflight: int = 0  #: lookups submitted and not finished
    entries: int = 0  #: lookups tracked (in flight and finished, not cleared)
    queued: int = 0  #: writes waiting for the sender thread
    # Redis and the ranks.
    breaker_open: bool = False  #: the circuit breaker is open: lookups answer 0
    breaker_openings: int = 0  #: times it opened
    send_queue_full: int = 0  #: writes dropped on a full send queue
    direct_submits: int = 0  #: submits written on the caller's thread (not queued)
    redis_errors: int = 0  #: Redis errors seen by the client's threads
    unexpected_errors: int = 0  #: bugs caught in the client's threads (logged)
    dead_ranks: tuple[int, ...] = ()  #: expected ranks without a heartbeat
    liveness_known: bool = False  #: heartbeats were read once (before: dead_ranks guessed)
    ownership: Ownership = Ownership()  #: the scheduler's lease (one per engine)
    #: per-rank figures; None: ``rank_insights`` is off
    rank_insights: InsightsStats | None = None


class ConsumerStats(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's read loop on its consumer group."""

    entries: int = 0  #: stream entries read
    replayed: int = 0  #: of those, own pending entries read again
    dead_letters: int = 0  #: entries dead-lettered (undecodable or invalid)
    #: dead letters by reason, where the process counts them so (else only the total)
    dead_letter_reasons: dict[str, int] = {}
    #: own pending entries found trimmed when read again (expired unread): acked, not served
    trimmed: int = 0
    redis_errors: int = 0  #: Redis errors of the read loop
    nogroup: int = 0  #: times the group was found missing and created again
    pending: int = 0  #: entries delivered to the rank, not acked (last read)
    lag: int = 0  #: entries not yet delivered to the rank's group (last read)


class RankStats(msgspec.Struct, frozen=True, kw_only=True):
    """A worker rank's server: what it did, the lookups it holds, its loop's health."""

    rank: int = 0  #: which rank of the engine this is
    #: what the rank did and decided, by event (requests, report_<result>, watchdog, ...)
    counts: dict[str, int] = {}
    # Lookups held now, by state, and the size of every per-lookup map.
    running: int = 0  #: the engine is looking up and prefetching
    reporting: int = 0  #: reported, the report's write not yet confirmed
    held: int = 0  #: pins held after the report
    waiting: int = 0  #: requests waiting for an older generation's release
    seen: int = 0  #: (id, generation) pairs remembered against duplicates
    aborted: int = 0  #: aborts remembered for requests not read yet
    late: int = 0  #: reports that came after their lookup was released
    timers: int = 0  #: deadlines and pin TTLs scheduled
    progressed: int = 0  #: lookups with progress to report (partial_answers)
    # Engine time from dispatch to report.
    engine_seconds: tuple[int, ...] = ()  #: per latency bucket (+ overflow)
    engine_seconds_sum: float = 0.0  #: seconds
    # The loop and Redis.
    consumer: ConsumerStats = ConsumerStats()
    reporter_errors: int = 0  #: Redis errors writing reports
    unexpected_errors: int = 0  #: bugs caught in the rank's threads (logged)
    last_heartbeat: float = 0.0  #: wall clock of the last heartbeat (0: none yet)
    ready: bool = False  #: holds the lease, the group exists, the loop reads
    alive: bool = False  #: the read loop and the sweeper run
    ownership: Ownership = Ownership()  #: the rank's lease (one process per rank)


def as_json_object(stats: ClientStats | RankStats) -> dict[str, Any]:
    """``stats`` as plain values (field name -> value): what a metrics snapshot holds."""
    out: dict[str, Any] = msgspec.to_builtins(stats)
    return out


def client_stats(values: dict[str, Any]) -> ClientStats:
    """The :class:`ClientStats` of a snapshot's ``stats`` object.

    Raises:
        MalformedMessage: a field of the wrong type.
    """
    return _convert(values, ClientStats)


def rank_stats(values: dict[str, Any]) -> RankStats:
    """The :class:`RankStats` of a snapshot's ``stats`` object.

    Raises:
        MalformedMessage: a field of the wrong type.
    """
    return _convert(values, RankStats)


def _convert(values: dict[str, Any], kind: type[_S]) -> _S:
    try:
        # JSON object keys are strings: str_keys reads the insights' rank keys as ints.
        return msgspec.convert(values, kind, str_keys=True)
    except msgspec.ValidationError as exc:
        what = f"bad {kind.__name__} in a metrics snapshot"
        raise MalformedMessage(f"{what}: {exc}", values) from None
