"""``broker-lookup demo``: a server, N worker rank processes and four lookups, end to end.

It starts an embedded Valkey (unless given ``--redis-url``), N real ``python -m workers``
processes that preload prompts, then looks up like vLLM's scheduler (``lookup`` then
polling ``lookup_cache``): a FULL hit (cached on every rank), a PARTIAL hit (rank 0 has
all of it, the others half: the answer is the minimum), a ZERO hit and one CANCEL.
It prints what Redis holds for each and the commands to look yourself (``broker-lookup
inspect``, and ``redis-cli`` where it is installed), then stops everything in order:
client, ranks (SIGTERM), server. With ``keep``, the embedded server is a
``broker-lookup server`` of its own that keeps running, so those commands work after it.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import redis

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata, env_name, redact_url
from broker_lookup.processes import ExitCode, child_env
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.tools.local_ranks import LocalRanks, write_preload
from broker_lookup.tools.serve import start_detached
from broker_lookup.transport.connection import make_factory, redis_cli_args

__all__ = ["run_demo"]

_CHUNKS = 8  #: chunks per demo prompt
_LOAD_DELAY_MS = 300  #: per disk chunk, so the CANCEL lookup is still prefetching when cancelled


@dataclass(frozen=True)
class Case:
    """One demo lookup and the answer it must get."""

    name: str
    lookup_id: str
    tokens: list[int]
    expected: int


def _prompt(base: int, chunk_size: int) -> list[int]:
    return list(range(base, base + _CHUNKS * chunk_size))


def _beat_fields(beats: dict[int, dict[str, Any]], *fields: str) -> str:
    """``r0 running=1 held=2 r1 ...``: the given fields of each rank's heartbeat."""
    return " ".join(
        f"r{rank} " + " ".join(f"{name}={beat.get(name)}" for name in fields)
        for rank, beat in beats.items()
    )


def _wait(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> Any:
    """Poll ``predicate`` until truthy or ``timeout_s``; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


class Demo:
    """The demo's state; :meth:`run` returns the exit code."""

    def __init__(
        self, url: str, ranks: int, chunk_size: int, workdir: Path, environ: Mapping[str, str]
    ) -> None:
        self.url = url
        self.n = ranks
        self.cs = chunk_size
        self.workdir = workdir
        self.environ = environ
        self.keys = KeySpace(f"demo-{uuid.uuid4().hex[:8]}")
        self.config = LookupConfig(redis_url=url, chunk_size=chunk_size, lookup_timeout_ms=15_000)
        self.redis = make_factory(self.config, "bl-demo")()
        self.ranks: LocalRanks | None = None
        self.client: RedisAsyncLookupClient | None = None
        self.out: TextIO = sys.stdout
        full, part, cancel = (_prompt(b, chunk_size) for b in (1000, 2000, 4000))
        self.cases = [
            Case("FULL", "demo-full", full, len(full)),
            Case("PARTIAL", "demo-partial", part, len(part) // 2),
            Case("ZERO", "demo-zero", _prompt(3000, chunk_size), 0),
        ]
        self.cancel_tokens = cancel

    def say(self, text: str = "") -> None:
        """Print one line of the demo's output."""
        print(text, file=self.out, flush=True)

    # -- setup ----------------------------------------------------------------------

    def _files(self) -> tuple[Path, Path]:
        others = list(range(1, self.n)) or [0]
        prompts: list[dict[str, Any]] = [
            {"tokens": self.cases[0].tokens, "ranks": None, "fraction": 1.0},
            {"tokens": self.cases[1].tokens, "ranks": [0] if self.n > 1 else [], "fraction": 1.0},
            {"tokens": self.cases[1].tokens, "ranks": others, "fraction": 0.5},
            {"tokens": self.cancel_tokens, "ranks": None, "fraction": 1.0, "tier": "disk"},
        ]
        preload = write_preload(self.workdir / "preload.json", prompts)
        config = self.workdir / "config.yaml"
        config.write_text(f"chunk_size: {self.cs}\nlookup_timeout_ms: 15000\n")
        return preload, config

    def start_ranks(self) -> None:
        """Start one ``python -m workers`` process per rank, logging to the work dir."""
        preload, config = self._files()
        env = child_env(self.environ, {env_name("redis_url"): self.url})
        args = ["--preload", str(preload), "--config", str(config)]
        args += ["--load-delay-ms", str(_LOAD_DELAY_MS)]
        self.ranks = LocalRanks(self.keys.engine_id, [env] * self.n, self.workdir, args)
        for rank, proc in enumerate(self.ranks.start_all()):
            self.say(f"started rank {rank}: pid {proc.pid}")

    def wait_ready(self, timeout_s: float) -> bool:
        """Until every rank has a heartbeat and the client sees them all alive."""
        beats = [self.keys.heartbeat(r) for r in range(self.n)]
        ranks = self._ranks()

        def ranks_up() -> bool:
            return bool(ranks.exited()) or self.redis.exists(*beats) == self.n

        _wait(ranks_up, timeout_s)
        if self.redis.exists(*beats) != self.n:
            self.say(f"ranks did not all start within {timeout_s:.0f}s; their logs:")
            for rank in range(self.n):
                self.say(f"--- rank {rank} ---\n{ranks.log_tail(rank)}")
            return False
        self.say(f"all {self.n} ranks alive (heartbeats {self.keys.heartbeat_pattern})")
        meta = LookupMetadata(engine_id=self.keys.engine_id, world_size=self.n)
        client = self.client = RedisAsyncLookupClient(self.config, meta)
        return bool(_wait(lambda: not client.stats().dead_ranks, 30.0, 0.02))

    def _client(self) -> RedisAsyncLookupClient:
        if self.client is None:
            raise RuntimeError("the demo client is not started")
        return self.client

    def _ranks(self) -> LocalRanks:
        if self.ranks is None:
            raise RuntimeError("the demo ranks are not started")
        return self.ranks

    # -- lookups --------------------------------------------------------------------

    def per_rank(self, lookup_id: str) -> str:
        """The lookup hash as ``redis-cli HGETALL`` shows it, condensed."""
        raw: Any = self.redis.hgetall(self.keys.lookup(lookup_id))
        found = lookup_hash.decode(raw)
        hits = " ".join(
            f"{lookup_hash.rank_field(r)}={found.hits.get(r, '-')}" for r in range(self.n)
        )
        result = "-" if found.result is None else found.result
        return f"{hits}  state={found.state or '-'} result={result}"

    def lookup(self, case: Case) -> bool:
        """One scheduler-style lookup: submit, poll lookup_cache, read the hash back."""
        client = self._client()
        started = time.perf_counter()
        got = client.lookup(case.tokens, case.lookup_id)
        while got is None:
            got = client.lookup_cache(case.lookup_id)
            if got is None:
                time.sleep(0.001)  # the scheduler's step loop; lookup_cache itself never waits
        latency_ms = (time.perf_counter() - started) * 1000
        ok = got == case.expected
        self.say(
            f"{case.name:<8} {case.lookup_id}: expected {case.expected:>4}  got {got:>4}  "
            f"{'OK' if ok else 'WRONG'}  latency {latency_ms:.1f} ms"
        )
        self.say(f"{'':<9}per-rank hits (HGETALL): {self.per_rank(case.lookup_id)}")
        client.clear_lookup_status(case.lookup_id)
        return ok

    def _beats(self) -> dict[int, dict[str, Any]]:
        values = self.redis.mget([self.keys.heartbeat(r) for r in range(self.n)])
        return {r: json.loads(v) for r, v in enumerate(values) if v is not None}

    def _running(self, want: int) -> dict[int, dict[str, Any]] | None:
        beats = self._beats()
        ok = len(beats) == self.n and all(
            (b.get("running", 0) >= 1) if want else (b.get("running", 0) == 0)
            for b in beats.values()
        )
        return beats if ok else None

    def cancel(self) -> bool:
        """Start a slow (disk) lookup, cancel it mid-prefetch, show the key and pins are gone."""
        client = self._client()
        lookup_id = "demo-cancel"
        key = self.keys.lookup(lookup_id)
        client.lookup(self.cancel_tokens, lookup_id)
        before = _wait(lambda: self._running(1), 10.0, 0.05) or self._beats()
        self.say(
            f"CANCEL   {lookup_id}: prefetching from disk on every rank: "
            + _beat_fields(before, "running")
        )
        client.cancel_lookup(lookup_id)
        gone = bool(_wait(lambda: not self.redis.exists(key), 5.0, 0.01))
        cache = client.lookup_cache(lookup_id)
        self.say(f"{'':<9}cancel_lookup -> {key} exists={int(not gone)}  lookup_cache={cache}")
        after = _wait(lambda: self._running(0), 15.0, 0.05)
        released = after is not None and all(
            after[r].get("held") == before.get(r, {}).get("held") for r in after
        )
        still_gone = not self.redis.exists(key)
        self.say(
            f"{'':<9}ranks released it: "
            + _beat_fields(after or self._beats(), "running", "held")
            + f"  key still gone after their prefetch ended: {still_gone}"
        )
        ok = gone and cache == -1 and released and still_gone
        self.say(f"{'':<9}{'OK' if ok else 'WRONG'}")
        return ok

    def commands(self, server_stays: bool) -> None:
        """The commands to inspect what the demo left (the server's real host and port):
        ``broker-lookup inspect``, and ``redis-cli`` where it is installed."""
        k = self.keys
        if not server_stays:
            self.say(
                "\nThe embedded server stops with the demo. To look at what it leaves, run\n"
                "  broker-lookup demo --keep          (keeps the embedded server running)\n"
                "or pass --redis-url of a server of your own."
            )
            return
        ttl_s = (self.config.lookup_timeout_ms + self.config.key_grace_ms) // 1000
        self.say(f"\nInspect it with (each lookup hash expires about {ttl_s} s after its lookup):")
        self.say(
            f"  {_own_command()} inspect --redis-url {redact_url(self.url)} "
            f"--engine-id {k.engine_id} --world-size {self.n}"
        )
        if shutil.which("redis-cli") is None:
            self.say("  (redis-cli is not installed: with it, these hints list its commands too)")
            return
        cli = "redis-cli " + redis_cli_args(self.url)  # also cluster and sentinel URLs
        if urlsplit(self.url).password:
            self.say("  export REDISCLI_AUTH=<password>   # never on the command line")
        for line in (
            f"--scan --pattern '{k.lookup_pattern}'",
            f"HGETALL '{k.lookup('demo-full')}'",
            f"TTL '{k.lookup('demo-full')}'",
            f"XINFO GROUPS '{k.requests}'",
            f"XPENDING '{k.requests}' {k.group(0)}",
            f"XLEN '{k.requests}'",
            f"XLEN '{k.done}'",
            f"XLEN '{k.dead}'",
            f"--scan --pattern '{k.heartbeat_pattern}'",
            f"GET '{k.heartbeat(0)}'",
        ):
            self.say(f"  {cli} {line}")

    def stop_ranks(self) -> bool:
        """SIGTERM every rank, wait (bounded), report their exit codes."""
        codes = self.ranks.stop() if self.ranks is not None else []
        self.say("ranks stopped: " + " ".join(f"r{r}={c}" for r, c in enumerate(codes)))
        return all(c == 0 for c in codes)

    def close_client(self) -> None:
        """Close the client (cancels anything in flight) and the inspection connection."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self.redis.close()


def _own_command() -> str:
    """How to run ``broker-lookup`` here: the console script when it is on PATH."""
    if shutil.which("broker-lookup"):
        return "broker-lookup"
    return f"{sys.executable} -m broker_lookup.cli"


def _lookups(demo: Demo, timeout_s: float, server_stays: bool) -> bool:
    demo.start_ranks()
    if not demo.wait_ready(timeout_s):
        return False
    demo.say()
    results = [demo.lookup(case) for case in demo.cases]
    results.append(demo.cancel())
    demo.commands(server_stays)
    return all(results)


def run_demo(
    redis_url: str | None,
    ranks: int,
    chunk_size: int,
    environ: Mapping[str, str],
    startup_timeout_s: float = 180.0,
    out: TextIO | None = None,
    keep: bool = False,
) -> int:
    """Run the demo; 0 if every lookup gave the expected answer and everything stopped cleanly.

    ``keep``: the embedded server (only it) keeps running after the demo, for its hints.
    """
    kept = None
    with ExitStack() as stack:
        where = "given"
        if redis_url is None and keep:
            kept = start_detached(environ)
            redis_url = kept.url
            where = f"embedded, kept running: pid {kept.pid}"
        elif redis_url is None:
            server = stack.enter_context(EmbeddedServer(startup_timeout_s=30.0))
            redis_url = server.url
            where = f"embedded, pid {server.pid}"
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bl-demo-")))
        demo = Demo(redis_url, ranks, chunk_size, workdir, environ)
        demo.out = out or sys.stdout
        demo.say(f"redis: {redact_url(redis_url)} ({where})  engine: {demo.keys.engine_id}")
        stopped = True
        try:
            ok = _lookups(demo, startup_timeout_s, server_stays=where == "given" or keep)
        except (redis.RedisError, OSError) as exc:
            demo.say(f"demo failed: {exc}")
            ok = False
        finally:
            demo.close_client()
            stopped = demo.stop_ranks()
        if kept is not None:
            demo.say(f"\nThe embedded server keeps running (pid {kept.pid}): {kept.url}")
            demo.say(f"Stop it with: kill {kept.pid}")
        demo.say(f"\ndemo {'OK' if ok and stopped else 'FAILED'}")
        return ExitCode.OK if ok and stopped else ExitCode.FAILED
