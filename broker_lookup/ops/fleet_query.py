"""The fleet query: which engine holds a prompt's prefix, asked of the ranks themselves.

One implementation behind the Python API (:class:`FleetClient`), ``broker-lookup query``
and the HTTP endpoint (``ops.query_http``). Per query:

1. the candidates become key namespaces: explicit engine ids as given; a configured id
   as every live vLLM instance of it (``<id>@<instance>``, ``keys.configured_patterns``)
   plus the id itself; no candidates, every engine on the server (both by SCAN, remembered for
   ``RESOLVE_EVERY_S``);
2. one pipeline reads each engine's ranks (``epochs``) and the heartbeats of the ranks it
   had at the last query, and XADDs the probe to each engine that had a rank
   (``protocol.probe``); a rank new to this client costs a second one (its heartbeat,
   and the probe if its engine had none);
3. each live rank answers on its own probe thread, never through its lookups' stream,
   RPUSHing to the engine's answer list in the write that carries its next read;
4. the client pops the answers with pipelined single-key BLPOPs (one per answer missing,
   the time left shared among them: each command in one engine's slot, so Redis Cluster
   serves them) until every live rank answered or the deadline passed: answers that
   arrive together take one round trip.

Per engine the answer is the minimum over its expected ranks (a heartbeat names its world
size) of what each holds, exact at the moment it answered; ``age_ms`` bounds how long
ago that was (the time since the probe was sent: no clocks compared). An engine answers
0 with a ``reason``: ``no_ranks`` (no live rank), ``dead_rank`` (an expected rank has no
heartbeat: its engine's lookups answer 0 too), ``deadline`` (a live rank did not answer
in time), ``unavailable`` (Redis failed, or a rank's engine cannot answer), ``miss`` (every
rank answered and one holds nothing). Nothing raises on request data or on Redis errors.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis

from broker_lookup.config import LookupConfig
from broker_lookup.errors import REDIS_ERRORS, BrokerLookupError, MalformedMessage
from broker_lookup.protocol.commands import Arg, Command
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import (
    PREFIX,
    KeySpace,
    configured_of,
    configured_patterns,
    engine_of,
    validate_configured_id,
    validate_engine_id,
)
from broker_lookup.protocol.probe import (
    PROBES_MAXLEN,
    PROBES_TTL_MS,
    Probe,
    Reserve,
    decode_answer,
    new_query_id,
    probe_fields,
)
from broker_lookup.ratelimit import RateLimitedLog
from broker_lookup.transport.connection import ConnectionFactory, make_factory
from broker_lookup.transport.link import Link, open_link

__all__ = ["EngineAnswer", "FleetAnswer", "FleetClient"]

logger = logging.getLogger(__name__)

#: How long a SCAN's list of engines (all, or a configured id's instances) is reused.
RESOLVE_EVERY_S = 1.0
#: The socket must outlast the longest BLPOP by this much.
SOCKET_MARGIN_MS = 500
#: Engines whose ranks a client remembers at most (then it forgets them all, once).
RANKS_REMEMBERED = 10_000
#: The shortest BLPOP timeout (Redis reads a shorter one as 0: block forever).
MIN_BLOCK_S = 0.001


@dataclass(frozen=True)
class EngineAnswer:
    """What one engine holds of the prompt (see the module docstring for ``reason``)."""

    engine_id: str
    tokens: int
    expected: tuple[int, ...]  #: the ranks whose minimum the answer is
    answered: tuple[int, ...]  #: the ranks that answered in time
    age_ms: float | None  #: at most this old when returned (None: no rank answered)
    reason: str | None  #: why ``tokens`` is 0; None when it is not
    reserved: int = 0  #: with ``reserve_ms``: the prefix every rank pinned for the request
    reserved_ms: int = 0  #: ... for at most this long


@dataclass(frozen=True)
class FleetAnswer:
    """One query's answers, best first (most tokens, then fewest ranks missing)."""

    tokens: int  #: the prompt's tokens in whole chunks: the most any engine can hold
    engines: list[EngineAnswer] = field(default_factory=list)
    elapsed_ms: float = 0.0
    problem: str | None = None  #: why nothing was asked (bad input), or Redis failed
    available: bool = True  #: False: Redis failed (every engine answered ``unavailable``)

    def best(self) -> EngineAnswer | None:
        """The engine holding the longest prefix, None if none holds any."""
        return self.engines[0] if self.engines and self.engines[0].tokens > 0 else None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able form (the CLI's ``--json`` and the HTTP endpoint's body)."""
        return {
            "tokens": self.tokens,
            "elapsed_ms": round(self.elapsed_ms, 3),
            "problem": self.problem,
            "available": self.available,
            "engines": [asdict(e) for e in self.engines],
        }


@dataclass
class _Engine:
    keys: KeySpace
    ranks: set[int] = field(default_factory=set)
    expected: tuple[int, ...] = ()
    live: set[int] = field(default_factory=set)
    world: int = 0  #: the largest world size the live ranks' heartbeats name
    got: dict[int, int] = field(default_factory=dict)
    bad: bool = False


class FleetClient:
    """Asks the ranks of many engines what they hold of a prompt (see the module).

    >>> fleet = FleetClient(LookupConfig(redis_url="redis://redis:6379"))  # doctest: +SKIP
    >>> fleet.query(token_ids, configured="llama").best()                   # doctest: +SKIP

    Args:
        config: ``redis_url`` and the hashing fields (``chunk_size``, ...) of the fleet.
        connection_factory: clients to use instead of ones made from ``config``.
        deadline_ms: default deadline of a query (capped under ``socket_timeout_ms``,
            which bounds what a query costs when Redis does not answer: set it near the
            router's own budget).
    """

    def __init__(
        self,
        config: LookupConfig,
        connection_factory: ConnectionFactory | None = None,
        deadline_ms: int = 100,
    ) -> None:
        self.config = config
        self.deadline_ms = deadline_ms
        # No redis-py retries: a held link costs one socket timeout, not several; the
        # next query connects again.
        self._factory = connection_factory or make_factory(
            config, "bl-fleet-query", own_retries=True
        )
        self._client: redis.Redis | None = None
        #: Links not in use now (a query takes one and gives it back).
        self._links: list[Link] = []
        self._lock = threading.Lock()
        self._hasher = ChunkedTokenHasher(config)
        #: Per engine, its ranks as its epochs hash named them at the last query.
        self._ranks: dict[str, set[int]] = {}
        self._resolved: dict[tuple[str, ...] | None, tuple[float, list[str]]] = {}
        self._warn = RateLimitedLog(logger, 30.0)

    def close(self) -> None:
        """Close the connections (a later query opens others)."""
        with self._lock:
            links, self._links = self._links, []
            client, self._client = self._client, None
        for link in links:
            link.close()
        if client is not None:
            client.close()

    # -- the query ------------------------------------------------------------------

    def query(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        hashes: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
        engines: Sequence[str] | None = None,
        configured: str | Sequence[str] | None = None,
        deadline_ms: int | None = None,
        request_configs: dict[str, Any] | None = None,
        reserve_ms: int = 0,
    ) -> FleetAnswer:
        """Ask the candidates (``engines``, or every instance of ``configured``, one id or
        several, or every engine) for the prefix of ``token_ids`` (or of chunk ``hashes``,
        with ``offsets`` per chunk, ``chunk_size`` each by default) they hold, waiting
        ``deadline_ms``.

        With ``reserve_ms``, the best engine's ranks are then asked to keep that prefix
        pinned until the engine's own lookup of the prompt arrives, or ``reserve_ms``
        passed (see ``workers.pipeline.reservations``): the best answer's ``reserved`` is
        the prefix every rank pinned (the reserve waits up to one more ``deadline_ms``)."""
        started = time.monotonic()
        try:
            chunk_hashes, chunk_offsets = self._chunks(token_ids, hashes, offsets)
            if not isinstance(reserve_ms, int) or reserve_ms < 0:
                raise ValueError(f"reserve_ms={reserve_ms!r}: must be an integer >= 0")
            names = [validate_engine_id(e, "engine id") for e in engines or ()]
            ids = (configured,) if isinstance(configured, str) else configured
            wanted = None if ids is None else tuple(sorted(set(ids)))
            for one in wanted or ():
                validate_configured_id(one, "configured engine id")
        except (BrokerLookupError, ValueError, TypeError) as exc:
            return FleetAnswer(0, problem=str(exc))
        total = sum(chunk_offsets)
        budget = self._budget(deadline_ms)
        link: Link | None = None
        client: redis.Redis | None = None
        try:
            client = self._connected()
            if not names:
                names = self._resolve(client, wanted)
            link = self._take_link(client)
            found = [_Engine(KeySpace(n)) for n in names]
            probe = Probe(
                query_id=new_query_id(),
                hashes=chunk_hashes,
                offsets=chunk_offsets,
                budget_ms=budget,
                request_configs=request_configs,
            )
            sent = self._send(link, found, probe)
            self._wait(link, found, probe.query_id, started + budget / 1000)
            answers = [_answer(e, _ms_since(sent)) for e in found]
            answers.sort(key=_best_first)
            if reserve_ms and answers and answers[0].tokens:
                engine = next(e for e in found if e.keys.engine_id == answers[0].engine_id)
                reserved = self._reserve(link, engine, answers[0].tokens, probe, reserve_ms)
                answers[0] = replace(answers[0], reserved=reserved, reserved_ms=reserve_ms)
        except REDIS_ERRORS as exc:
            # The link reconnects on its next use; the next query tries again.
            if link is not None:
                link.drop()
            self._warn(logging.WARNING, "fleet query: Redis failed: %s", exc)
            answers = [EngineAnswer(n, 0, (), (), None, "unavailable") for n in (names or [])]
            return FleetAnswer(
                total, answers, _ms_since(started), f"Redis failed: {exc}", available=False
            )
        finally:
            if link is not None:
                self._give_back(link, client)
        return FleetAnswer(total, answers, _ms_since(started))

    def _reserve(
        self, link: Link, engine: _Engine, tokens: int, probe: Probe, reserve_ms: int
    ) -> int:
        """Ask ``engine``'s ranks to pin the first ``tokens`` of ``probe``'s prompt; the
        prefix every rank pinned (0 if one did not answer in time)."""
        chunks, total = 0, 0
        while chunks < len(probe.offsets) and total + probe.offsets[chunks] <= tokens:
            total += probe.offsets[chunks]
            chunks += 1
        ask = Reserve(
            query_id=new_query_id(),
            hashes=probe.hashes[:chunks],
            offsets=probe.offsets[:chunks],
            budget_ms=probe.budget_ms,
            reserve_ms=reserve_ms,
            request_configs=probe.request_configs,
        )
        _call(link, _probe(engine, probe_fields(ask)))
        waiting = _Engine(engine.keys, engine.ranks, engine.expected, engine.live)
        self._wait(link, [waiting], ask.query_id, time.monotonic() + probe.budget_ms / 1000)
        if waiting.bad or not set(waiting.expected) <= set(waiting.got):
            return 0
        return min(waiting.got[r] for r in waiting.expected)

    def _chunks(
        self,
        token_ids: Sequence[int] | None,
        hashes: Sequence[int] | None,
        offsets: Sequence[int] | None,
    ) -> tuple[list[int], list[int]]:
        if (token_ids is None) == (hashes is None):
            raise ValueError("give token ids or chunk hashes, not both or neither")
        if token_ids is not None:
            chunks = list(self._hasher.process_tokens(list(token_ids)))
            return [h for _, _, h in chunks], [e - s for s, e, _ in chunks]
        assert hashes is not None
        chunk = self.config.chunk_size
        sizes = list(offsets) if offsets is not None else [chunk] * len(hashes)
        if len(sizes) != len(hashes) or any(not isinstance(s, int) or s < 0 for s in sizes):
            raise ValueError("offsets must be one non-negative token count per chunk hash")
        if any(not isinstance(h, int) or not -(2**63) <= h < 2**64 for h in hashes):
            raise ValueError("chunk hashes must be 64-bit integers")
        return list(hashes), sizes

    def _budget(self, deadline_ms: int | None) -> int:
        wanted = self.deadline_ms if deadline_ms is None else int(deadline_ms)
        ceiling = max(1, self.config.socket_timeout_ms - SOCKET_MARGIN_MS)
        return max(1, min(wanted, ceiling))

    def _take_link(self, client: redis.Redis) -> Link:
        """A link of this client's own (one per query under way: each holds a connection)."""
        with self._lock:
            if self._links:
                return self._links.pop()
        return open_link(client)

    def _give_back(self, link: Link, client: redis.Redis | None) -> None:
        with self._lock:
            if client is self._client:
                self._links.append(link)
                return
        link.close()  # its client was closed meanwhile

    def _connected(self) -> redis.Redis:
        # One client (its pool serves every thread: the HTTP endpoint queries from many).
        with self._lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def _resolve(self, client: redis.Redis, configured: tuple[str, ...] | None) -> list[str]:
        """Namespaces of every engine with ranks (``configured``: their instances and
        themselves)."""
        now = time.monotonic()
        cached = self._resolved.get(configured)
        if cached is not None and now - cached[0] < RESOLVE_EVERY_S:
            return cached[1]
        if configured is None:
            patterns = [f"{PREFIX}:{{*}}:epochs"]
        else:
            patterns = [p for one in configured for p in configured_patterns(one, "epochs")]
        names = sorted(
            {
                engine
                for pattern in patterns
                for raw in client.scan_iter(match=pattern, count=1000)
                if (engine := engine_of(raw)) is not None
            }
        )
        for one in configured or ():
            if one not in names and not any(configured_of(n) == one for n in names):
                names.append(one)  # named: shown, with no_ranks, rather than dropped
        self._resolved[configured] = (now, names)
        return names

    def _send(self, link: Link, found: list[_Engine], probe: Probe) -> float:
        """Read the engines' ranks and heartbeats and probe those with a rank, in one round
        trip while the remembered ranks still hold (a second one for an engine with ranks
        new to this client). Returns when the probes left (monotonic): an answer is no
        older than that."""
        fields = probe_fields(probe)
        if len(self._ranks) > RANKS_REMEMBERED:
            self._ranks.clear()  # engines come and go (a vLLM instance per restart)
        commands: list[Command] = []
        plan: list[tuple[_Engine, list[int], bool]] = []
        for e in found:
            known = sorted(self._ranks.get(e.keys.engine_id, ()))
            commands.append(("HKEYS", e.keys.epochs))
            commands += [("GET", e.keys.heartbeat(rank)) for rank in known]
            if known:
                commands += _probe(e, fields)
            plan.append((e, known, bool(known)))
        sent = time.monotonic()
        replies = iter(_call(link, commands))
        late: list[tuple[_Engine, list[int], bool]] = []
        for e, known, probed in plan:
            e.ranks = {int(r) for r in map(_text, next(replies)) if r.isdigit()}
            beats = {rank: next(replies) for rank in known}
            if probed:
                next(replies), next(replies)  # the XADD's id, the PEXPIRE's 1
            self._remember(e)
            new = sorted(e.ranks - set(known))
            if new or (e.ranks and not probed):
                late.append((e, new, probed))
            _live(e, beats)
        if late:  # ``sent`` stays the first round trip's: ages are upper bounds
            self._send_late(link, late, fields)
        for e in found:
            e.expected = tuple(range(e.world)) if e.world else tuple(sorted(e.live))
        return sent

    def _send_late(
        self,
        link: Link,
        late: list[tuple[_Engine, list[int], bool]],
        fields: dict[str, bytes | str | int],
    ) -> None:
        """The second round trip: the heartbeats of ranks this client had not seen, and the
        probe to an engine that had none."""
        commands: list[Command] = []
        for e, new, probed in late:
            commands += [("GET", e.keys.heartbeat(rank)) for rank in new]
            commands += [] if probed else _probe(e, fields)
        replies = iter(_call(link, commands))
        for e, new, probed in late:
            beats = {rank: next(replies) for rank in new}
            if not probed:
                next(replies), next(replies)
            _live(e, beats)

    def _remember(self, e: _Engine) -> None:
        if e.ranks:
            self._ranks[e.keys.engine_id] = e.ranks
        else:
            self._ranks.pop(e.keys.engine_id, None)

    def _wait(self, link: Link, found: list[_Engine], query_id: str, until: float) -> None:
        """Pop the answers until every live expected rank answered or ``until``.

        Each round trip is one pipeline of single-key BLPOPs, one per answer still
        missing (so each command stays in its engine's slot, as Redis Cluster needs);
        Redis serves them in order, so their timeouts share the time left: answers that
        arrive together, as a healthy fleet's do, are all taken in one round trip, and a
        silent rank cannot hold the query past ``until`` (but for 1 ms a BLPOP at least).
        """
        waiting = {
            e.keys.probe_reply(query_id): e for e in found if e.live and set(e.expected) <= e.live
        }
        while waiting:
            left = until - time.monotonic()
            if left <= 0:
                return
            missing = {key: len(set(e.expected) - set(e.got)) for key, e in waiting.items()}
            share = f"{max(left / sum(missing.values()), MIN_BLOCK_S):.3f}"
            commands: list[Command] = [
                ("BLPOP", key, share) for key, count in missing.items() for _ in range(count)
            ]
            for popped in _call(link, commands):
                if not popped:
                    continue
                key, raw = _text(popped[0]), popped[1]
                e = waiting.get(key)
                if e is None:  # the engine was settled earlier in this round
                    continue
                self._take(e, raw.encode() if isinstance(raw, str) else raw)
                if e.bad or set(e.expected) <= set(e.got):
                    del waiting[key]

    def _take(self, e: _Engine, raw: bytes) -> None:
        try:
            answer = decode_answer(raw)
        except MalformedMessage as exc:
            self._warn(logging.WARNING, "fleet query: %s", exc)
            return
        if answer.status != "ok":
            e.bad = True
        e.got[answer.rank] = answer.tokens


def _probe(e: _Engine, fields: dict[str, bytes | str | int]) -> list[Command]:
    """The probe's XADD to ``e``, and the stream's PEXPIRE (every time: the XADD may have
    just made the stream again, with no TTL)."""
    xadd: list[Arg] = ["XADD", e.keys.probes, "MAXLEN", "~", PROBES_MAXLEN, "*"]
    for name, value in fields.items():
        xadd += [name, value]
    return [xadd, ("PEXPIRE", e.keys.probes, PROBES_TTL_MS)]


def _call(link: Link, commands: list[Command]) -> list[Any]:
    """The replies of ``commands``, sent in one write; the first error reply raised."""
    replies = link.call(commands)
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return replies


def _live(e: _Engine, beats: dict[int, bytes | str | None]) -> None:
    """Note the ranks with a heartbeat among ``beats``, and the world size they name."""
    for rank, beat in beats.items():
        if beat is not None and rank in e.ranks:
            e.live.add(rank)
            e.world = max(e.world, _world_size(beat))


def _answer(e: _Engine, age_ms: float) -> EngineAnswer:
    answered = tuple(sorted(e.got))
    age = round(age_ms, 3) if answered else None
    if not e.live:
        return EngineAnswer(e.keys.engine_id, 0, e.expected, answered, age, "no_ranks")
    if not set(e.expected) <= e.live:
        return EngineAnswer(e.keys.engine_id, 0, e.expected, answered, age, "dead_rank")
    if e.bad:
        return EngineAnswer(e.keys.engine_id, 0, e.expected, answered, age, "unavailable")
    if not set(e.expected) <= set(e.got):
        return EngineAnswer(e.keys.engine_id, 0, e.expected, answered, age, "deadline")
    tokens = min(e.got[r] for r in e.expected)
    return EngineAnswer(
        e.keys.engine_id, tokens, e.expected, answered, age, None if tokens else "miss"
    )


def _best_first(a: EngineAnswer) -> tuple[int, int, str]:
    return (-a.tokens, len(a.expected) - len(a.answered), a.engine_id)


def _world_size(beat: bytes | str) -> int:
    try:
        size = json.loads(_text(beat)).get("world_size")
    except (ValueError, AttributeError):
        return 0
    return size if isinstance(size, int) and size > 0 else 0


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _ms_since(started: float) -> float:
    return (time.monotonic() - started) * 1000
