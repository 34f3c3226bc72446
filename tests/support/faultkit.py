"""Helpers of the protocol and system tests: fast configs, rank processes, answers to judge."""

from __future__ import annotations

import heapq
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import pytest
import redis
from helpers import Backend, Made, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.processes import child_env, long_options
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer

E = TypeVar("E")

#: Small chunks and short timers: every fault resolves in a second or two. The heartbeat
#: TTL is generous: a rank thread starved of CPU on a loaded CI box must not look dead.
FAST: dict[str, Any] = {
    "lookup_timeout_ms": 1500,
    "block_ms": 50,
    "heartbeat_interval_ms": 100,
    "heartbeat_ttl_ms": 1500,
    "chunk_size": 4,
    "key_grace_ms": 2000,
}
CHUNK = FAST["chunk_size"]


def prompt(base: int, chunks: int = 8) -> list[int]:
    """A prompt of ``chunks`` full chunks whose tokens start at ``base``."""
    return list(range(base, base + chunks * CHUNK))


def config(url: str | None = None, **overrides: Any) -> LookupConfig:
    """FAST, plus ``overrides``, on ``url`` when given."""
    values = {**FAST, **overrides}
    if url is not None:
        values["redis_url"] = url
    return LookupConfig(**values)


class RankProcess:
    """One ``python -m workers`` rank; its log is kept for the assertions."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log_path = argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        """SIGKILL and reap, as a crash."""
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        """Kill it if it still runs (stopped or not), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process ignores SIGKILL's exit
            self.proc.kill()
            self.proc.wait(10)


class LoneRank(NamedTuple):
    """What :meth:`MakeServer.lone` made: a ready rank and no client; the test writes the
    requests stream itself, on ``conn``."""

    engine: StubEngine
    server: RedisAsyncLookupServer
    keys: KeySpace
    conn: redis.Redis


class MakeServer(Made):
    """The ``make_server`` fixture: in-process ranks on the test's backend, :data:`FAST`
    plus ``overrides`` (config fields), closed after the test."""

    def __init__(self, backend: Backend, engine_id: str) -> None:
        super().__init__()
        self._backend, self._engine_id = backend, engine_id

    def __call__(
        self, engine: Any, rank: int = 0, world_size: int = 1, **overrides: Any
    ) -> RedisAsyncLookupServer:
        meta = LookupMetadata(engine_id=self._engine_id, world_size=world_size, worker_id=rank)
        factory = self._backend.factory
        return self.keep(
            RedisAsyncLookupServer(engine, meta, config(**overrides), connection_factory=factory)
        )

    def lone(self, rank: int = 0, world_size: int = 1, **overrides: Any) -> LoneRank:
        """A ready rank of a ``manual`` :class:`StubEngine`, its keys and a connection."""
        engine = StubEngine()
        server = self(engine, rank, world_size, **overrides)
        ready(server)
        return LoneRank(engine, server, KeySpace(self._engine_id), self._backend.factory())


class MakeClient(Made):
    """The ``make_client`` fixture: clients (``cls``) on the test's backend, :data:`FAST`
    plus ``overrides``, closed after the test."""

    def __init__(self, backend: Backend, engine_id: str) -> None:
        super().__init__()
        self._backend, self._engine_id = backend, engine_id

    def __call__(
        self,
        world_size: int = 1,
        cls: type[RedisAsyncLookupClient] = RedisAsyncLookupClient,
        **overrides: Any,
    ) -> RedisAsyncLookupClient:
        meta = LookupMetadata(engine_id=self._engine_id, world_size=world_size)
        factory = self._backend.factory
        return self.keep(cls(config(**overrides), meta, connection_factory=factory))


class StartRank(Made):
    """The ``rank_procs`` fixture: start ``python -m workers`` ranks, killed after the test.

    ``prompts`` is the runner's ``--preload`` list; ``overrides`` are config fields, sent
    as ``BROKER_LOOKUP_*`` variables on top of :data:`FAST`; ``options`` are more flags of
    ``python -m workers`` (``{"claim-timeout": 5}``). Two processes for one rank of one
    engine get their own preload file, disk directory and log, under ``tmp_path``.
    """

    def __init__(self, tmp_path: Path) -> None:
        super().__init__()
        self._tmp_path = tmp_path
        self._started: list[tuple[str, int]] = []

    def __call__(
        self,
        url: str,
        engine_id: str,
        world_size: int,
        rank: int,
        prompts: list[dict[str, Any]],
        load_delay_ms: float = 0.0,
        options: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> RankProcess:
        seen = self._started.count((engine_id, rank))
        self._started.append((engine_id, rank))
        tag = f"{engine_id}-{rank}" + (f"-{seen}" if seen else "")
        preload = self._tmp_path / f"preload-{tag}.json"
        preload.write_text(json.dumps({"prompts": prompts}))
        values = {**FAST, **overrides, "redis_url": url}
        extra = {env_name(k): str(v) for k, v in values.items()}
        flags = {
            "engine-id": engine_id,
            "world-size": world_size,
            "rank": rank,
            "metrics-port": 0,
            "preload": preload,
            "load-delay-ms": load_delay_ms,
            "disk-dir": self._tmp_path / f"disk-{tag}",
            "connect-timeout": 30,
            "log-level": "INFO",
            **(options or {}),
        }
        argv = [sys.executable, "-m", "workers", *long_options(flags)]
        log = self._tmp_path / f"rank-{tag}.log"
        return self.keep(RankProcess(argv, child_env(os.environ, extra), log))


class MakeLookupClient(Made):
    """The ``clients`` fixture: a client of ``cls`` on ``cfg``, closed after the test."""

    def __call__(
        self,
        cfg: LookupConfig,
        engine_id: str,
        world_size: int = 1,
        cls: type[RedisAsyncLookupClient] = RedisAsyncLookupClient,
    ) -> RedisAsyncLookupClient:
        return self.keep(cls(cfg, LookupMetadata(engine_id=engine_id, world_size=world_size)))


def second_scheduler(client: RedisAsyncLookupClient) -> RedisAsyncLookupClient:
    """Let ``client`` submit although another client holds its engine id's scheduler lease.

    Only for tests that need two deadlines on the same ranks: one engine id has one
    scheduler, and a second one answers 0 without submitting (its conflict is still logged
    and counted).
    """
    client.lease.held = lambda now=None: True  # type: ignore[method-assign]
    return client


def alive(client: RedisAsyncLookupClient, timeout: float = 60.0) -> None:
    """Until the client sees every rank's heartbeat (rank processes start in seconds)."""
    wait_until(lambda: not client.stats().dead_ranks, timeout=timeout, message="every rank alive")


def answer(client: RedisAsyncLookupClient, lookup_id: str, timeout: float) -> int:
    """Poll ``lookup_cache`` as the scheduler does; fail if it is still None after ``timeout``."""
    value = wait_until(
        lambda: client.lookup_cache(lookup_id) is not None,
        timeout=timeout,
        message=f"lookup {lookup_id} answered (a hang otherwise)",
    )
    assert value
    result = client.lookup_cache(lookup_id)
    assert isinstance(result, int)
    return result


def beat(conn: Any, key: str) -> dict[str, Any]:
    """The heartbeat JSON of a rank (empty if it has none)."""
    raw = conn.get(key)
    return json.loads(raw) if raw else {}


def elapsed_since(started: float) -> float:
    return time.monotonic() - started


def settle(client: RedisAsyncLookupClient, expected: dict[str, int], timeout: float) -> list[int]:
    """Wait until every lookup of ``expected`` is answered; each answer must be 0 or right.

    A lookup still None after ``timeout`` is a hang and fails the test.
    """
    wait_until(
        lambda: all(client.lookup_cache(i) is not None for i in expected),
        timeout=timeout,
        message="every lookup answered (none hangs)",
    )
    results = []
    for lookup_id, right in expected.items():
        got = client.lookup_cache(lookup_id)
        assert got in (0, right), f"{lookup_id}: wrong result {got}, expected 0 or {right}"
        assert isinstance(got, int)
        results.append(got)
        client.clear_lookup_status(lookup_id)
    return results


def eventually_right(
    client: RedisAsyncLookupClient, tokens: list[int], right: int, timeout: float, tag: str
) -> int:
    """Look up ``tokens`` again and again until the answer is ``right``; return the attempts."""
    attempts = 0

    def once() -> bool:
        nonlocal attempts
        attempts += 1
        lookup_id = f"{tag}-{attempts}"
        client.lookup(tokens, lookup_id)
        got = wait_until(lambda: client.lookup_cache(lookup_id) is not None, timeout=30)
        assert got
        value = client.lookup_cache(lookup_id)
        client.clear_lookup_status(lookup_id)
        assert value in (0, right), f"wrong result {value}"
        return value == right

    wait_until(once, timeout=timeout, interval=0.05, message=f"a right answer again ({tag})")
    return attempts


def ready(*servers: Any) -> None:
    """Until every in-process rank reads its group and has written a heartbeat."""
    wait_until(
        lambda: all(s.ready and s.stats().last_heartbeat for s in servers),
        message="ranks ready and beating",
    )


def hold_reports(
    server: RedisAsyncLookupServer, monkeypatch: pytest.MonkeyPatch
) -> threading.Event:
    """Hold every report batch of ``server`` between its engine and Redis, as a Redis
    that does not answer would, until the returned event is set (at most 20 s)."""
    gate, send = threading.Event(), server._reporter._send_batch

    def gated(link: Any, client: Any, batch: Any) -> None:
        wait_until(gate.is_set, timeout=20, message="the gate opened")
        send(link, client, batch)

    monkeypatch.setattr(server._reporter, "_send_batch", gated)
    return gate


class Served(NamedTuple, Generic[E]):
    """What :class:`Serve` made: a ready rank, and a client that sees it alive."""

    engine: E
    rank: RedisAsyncLookupServer
    client: RedisAsyncLookupClient


class ServedRanks(NamedTuple, Generic[E]):
    """What :meth:`Serve.ranks` made: ready ranks (rank ``r`` runs ``engines[r]``) and a
    client that sees every one alive."""

    engines: list[E]
    ranks: list[RedisAsyncLookupServer]
    client: RedisAsyncLookupClient


class Serve:
    """The ``serve`` fixture: in-process ranks on the test's backend that read their group
    and beat (:func:`ready`), then a client that sees every one alive (:func:`alive`).

    ``overrides`` are the client's config fields, ``rank_config`` the ranks'. The
    ``make_server`` and ``make_client`` fixtures close what this made.
    """

    def __init__(self, make_server: MakeServer, make_client: MakeClient) -> None:
        self._make_server = make_server
        self._make_client = make_client

    def __call__(
        self,
        engine: E,
        *,
        rank_config: Mapping[str, Any] | None = None,
        cls: type[RedisAsyncLookupClient] = RedisAsyncLookupClient,
        **overrides: Any,
    ) -> Served[E]:
        """One rank running ``engine``, and a client of ``cls``."""
        engines, ranks, client = self.ranks([engine], rank_config, cls, **overrides)
        return Served(engines[0], ranks[0], client)

    def ranks(
        self,
        engines: Sequence[E],
        rank_config: Mapping[str, Any] | None = None,
        cls: type[RedisAsyncLookupClient] = RedisAsyncLookupClient,
        **overrides: Any,
    ) -> ServedRanks[E]:
        """One rank per engine (``world_size`` is their number), and a client of ``cls``."""
        world = len(engines)
        ranks = [
            self._make_server(e, rank=r, world_size=world, **(rank_config or {}))
            for r, e in enumerate(engines)
        ]
        ready(*ranks)
        client = self._make_client(world_size=world, cls=cls, **overrides)
        alive(client)
        return ServedRanks(list(engines), ranks, client)


class LateEngine:
    """An engine whose final report races the deadline's partial answer.

    It confirms its first chunk at once (progress), then reports the whole prompt
    ``after_s`` (give or take ``jitter_s``) after it was asked, from its own thread, as an
    engine on a slow tier does; with ``after_s`` None, when the test calls
    :meth:`report_now`. It records every keep and release, to judge the promises a
    partial answer makes (:meth:`broken`). :meth:`close` stops its thread.
    """

    def __init__(self, after_s: float | None, jitter_s: float = 0.0, seed: int = 0) -> None:
        self.server: Any = None
        self._after_s = after_s
        self._jitter_s = jitter_s
        self._rng = random.Random(seed)
        self._lock = threading.Condition()
        self._due: list[tuple[float, str, int]] = []  # (when, id, hits), soonest first
        self._stopping = False
        #: ``cleanup_memory_objs`` calls per id.
        self.released: Counter[str] = Counter()
        #: The smallest prefix a keep trimmed each id to.
        self.kept: dict[str, int] = {}
        self._tokens: dict[str, int] = {}  # the prompt of each lookup asked
        self._thread = threading.Thread(target=self._run, name="late engine")
        self._thread.start()

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
        self.server.send_progress_to_scheduler(lookup_id, offsets[0])
        with self._lock:
            self._tokens[lookup_id] = sum(offsets)
            if self._after_s is None:
                return
            when = time.monotonic() + self._after_s + self._rng.uniform(-1, 1) * self._jitter_s
            heapq.heappush(self._due, (when, lookup_id, sum(offsets)))
            self._lock.notify()

    def report_now(self, lookup_id: str) -> None:
        """Report the whole prompt of ``lookup_id`` now (``after_s`` None)."""
        with self._lock:
            hits = self._tokens[lookup_id]
        self.server.send_response_to_scheduler(lookup_id, hits)

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        with self._lock:
            self.released[lookup_id] += 1

    def keep_memory_objs(self, lookup_id: str, tokens: int) -> None:
        with self._lock:
            self.kept[lookup_id] = min(tokens, self.kept.get(lookup_id, tokens))

    def broken(self, answers: dict[str, int]) -> list[str]:
        """The ids answered a prefix above 0 that this rank released or trimmed below it:
        the broken promises (call it before anything is cancelled or cleared)."""
        with self._lock:
            return [
                lookup_id
                for lookup_id, tokens in answers.items()
                if tokens > 0
                and (self.released[lookup_id] or self.kept.get(lookup_id, tokens) < tokens)
            ]

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=5)
        assert not self._thread.is_alive(), "the late engine's thread did not stop"

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and (not self._due or self._due[0][0] > time.monotonic()):
                    wait = self._due[0][0] - time.monotonic() if self._due else None
                    self._lock.wait(wait)
                if self._stopping:
                    return
                _, lookup_id, hits = heapq.heappop(self._due)
            self.server.send_response_to_scheduler(lookup_id, hits)
