"""The fleet-wide readers (``inspect``, ``doctor``, the exporter) on fakeredis and a real
server: a split engine is named by all three, a configured id selects its vLLM instances,
a role claimed twice fails ``doctor``, ids are printed whole and escaped, and one engine's
bad keys cost the other engines nothing."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from faultkit import config, prompt, ready
from helpers import Backend, Made, wait_until
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.ops import doctor, inspect
from broker_lookup.ops.doctor import Finding, diagnose, render
from broker_lookup.ops.exporter import FleetCollector, render_once
from broker_lookup.ops.fleet import fleet_snapshot, render_fleet
from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace, instance_engine_id
from broker_lookup.protocol.snapshot import MetricsPublisher
from broker_lookup.protocol.stats import ClientStats
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer

#: Snapshots every 200 ms, so the exporter sees every process soon.
QUICK: dict[str, Any] = {"metrics_interval_ms": 200}
#: The tools' own config: its URL is never dialled (their factory is the backend's).
TOOLS = LookupConfig(redis_url="redis://127.0.0.1:1/0", heartbeat_interval_ms=100)


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(factory: Callable[[], Any], engine_id: str | None) -> Series:
    """One exporter scrape, as {(sample name, labels): value}."""
    collector = FleetCollector(factory, engine_id)
    try:
        text = render_once(collector).decode()
    finally:
        collector.close()
    families = text_string_to_metric_families(text)
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def value(series: Series, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` whose labels include ``labels`` (None: none)."""
    found = [v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0] if found else None


@pytest.fixture
def tools_on(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """``inspect`` and ``doctor`` read the test's backend."""
    for module in (doctor, inspect):
        monkeypatch.setattr(module, "make_factory", lambda _config, _name, **_kw: backend.factory)
    return backend


def _no_wait(_s: float) -> None:
    return None


def _rank(backend: Backend, made: Made, engine_id: str, rank: int, world_size: int) -> Any:
    meta = LookupMetadata(engine_id=engine_id, world_size=world_size, worker_id=rank)
    server = RedisAsyncLookupServer(
        StubEngine(), meta, config(**QUICK), connection_factory=backend.factory
    )
    return made.keep(server)


def _scheduler(
    backend: Backend, made: Made, engine_id: str, world_size: int
) -> RedisAsyncLookupClient:
    meta = LookupMetadata(engine_id=engine_id, world_size=world_size)
    client = RedisAsyncLookupClient(config(**QUICK), meta, connection_factory=backend.factory)
    return made.keep(client)


def _inspect(engine_id: str | None, check: bool = True, as_json: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = inspect.run_inspect(TOOLS, engine_id, check=check, as_json=as_json, out=out)
    return code, out.getvalue()


def _status(findings: list[Finding], check: str) -> list[str]:
    return [f"{f.status} {f.detail}" for f in findings if f.check == check]


def test_a_split_engine_is_named_by_inspect_doctor_and_the_exporter(
    tools_on: Backend, made: Made, engine_id: str
) -> None:
    """A multi-node launch whose nodes drew different instance ids: the scheduler and rank 0
    under one namespace, rank 1 under another of the same configured id."""
    backend = tools_on
    head, other = (
        instance_engine_id(engine_id, "17966112"),
        instance_engine_id(engine_id, "17966115"),
    )
    ranks = [_rank(backend, made, head, 0, 2), _rank(backend, made, other, 1, 2)]
    _scheduler(backend, made, head, 2)
    ready(*ranks)
    conn = backend.factory()
    wait_until(lambda: conn.exists(KeySpace(head).owner(SCHEDULER_ROLE)), message="scheduler")
    wait_until(lambda: conn.exists(KeySpace(head).metrics(SCHEDULER_ROLE)), message="snapshot")
    wait_until(lambda: conn.exists(KeySpace(other).metrics("1")), message="rank 1's snapshot")

    snap = fleet_snapshot(conn, int(time.time() * 1000))
    (split,) = [s for s in snap["splits"] if head in s]
    assert f"engine {engine_id} is split" in split and other in split and "rank(s) 1" in split
    assert "instance ids" in split and "explicit engine id" in split
    assert "SPLITS (" in render_fleet(snap, "redis://x") and split in render_fleet(snap, "x")

    code, text = _inspect(engine_id)
    assert code == 1 and "CHECK FAILED" in text and split in text, text
    code, text = _inspect(None)  # the fleet's check fails on it too
    assert code == 1 and split in text
    code, text = _inspect(engine_id, as_json=True)
    body = json.loads(text)
    assert [i["engine_id"] for i in body["instances"]] == [head, other]
    assert body["splits"] == [split] and split in body["check"]["reasons"]

    findings = diagnose(TOOLS, engine_id, _no_wait)
    assert _status(findings, "split") == [f"FAIL {split}"]
    assert "check(s) failed" in render(findings, "redis://x")

    series = scrape(backend.factory, engine_id)
    assert value(series, "broker_lookup_engine_split", engine=head) == 1
    assert value(series, "broker_lookup_engine_split", engine=other) == 1
    labels = {"engine": head, "configured_engine_id": engine_id}
    assert value(series, "broker_lookup_engine_split", **labels) == 1


def test_a_configured_id_selects_every_instance_and_two_whole_replicas_are_no_split(
    tools_on: Backend, made: Made, engine_id: str
) -> None:
    """What the chart's ``helm test`` runs on a vLLM fleet: ``inspect --engine-id`` of the
    configured id, two replicas (``<id>@<instance>``) each with its scheduler and rank."""
    backend = tools_on
    replicas = [instance_engine_id(engine_id, i) for i in ("a1b2c", "d3e4f")]
    ranks = [_rank(backend, made, r, 0, 1) for r in replicas]
    for replica in replicas:
        _scheduler(backend, made, replica, 1)
    ready(*ranks)
    conn = backend.factory()
    snapshots = [KeySpace(replica).metrics(SCHEDULER_ROLE) for replica in replicas]
    wait_until(lambda: conn.exists(*snapshots) == 2, message="the schedulers' snapshots")

    code, text = _inspect(engine_id)
    assert code == 0 and "CHECK OK" in text, text
    assert f"2 namespace(s) of engine {engine_id}: {', '.join(replicas)}" in text
    assert all(f"engine {r}" in text for r in replicas)
    findings = diagnose(TOOLS, engine_id, _no_wait)
    assert _status(findings, "engines") == [f"ok 2: {', '.join(replicas)}"]
    assert _status(findings, "split") == ["ok every engine's processes share one namespace"]
    assert not [f for f in findings if f.status == "FAIL"], findings
    series = scrape(backend.factory, engine_id)
    assert [value(series, "broker_lookup_engine_split", engine=r) for r in replicas] == [0, 0]
    code, text = _inspect(engine_id + "-none")
    assert code == 1 and text == ""


def test_doctor_fails_on_a_role_claimed_twice(
    tools_on: Backend, made: Made, engine_id: str
) -> None:
    backend = tools_on
    owner = _rank(backend, made, engine_id, 0, 1)
    ready(owner)
    newcomer = _rank(backend, made, engine_id, 0, 1)
    wait_until(lambda: newcomer.lease.counts["conflicts"] >= 1, message="a conflict")
    findings = diagnose(TOOLS, engine_id, _no_wait)
    (owners,) = _status(findings, "owners")
    assert owners.startswith(f"FAIL engine {engine_id} rank 0: served by ")
    assert owner.lease.identity.describe() in owners
    assert newcomer.lease.identity.describe() in owners
    assert "every check passed" not in render(findings, "redis://x")
    newcomer.close()  # its contender key goes with it
    findings = diagnose(TOOLS, engine_id, _no_wait)
    assert _status(findings, "owners") == [f"ok {engine_id}: no role claimed twice"]


#: An id from an HTTP client: a screen clear, an OSC 52 clipboard write, a forged log line.
HOSTILE = "req\x1b[2J\x1b]52;c;cm0gLXJmIC8=\x07\nrank 0: engine reported 999 hits\u202e"


def test_ids_are_printed_whole_and_escaped(backend: Backend, made: Made, engine_id: str) -> None:
    long_id = f"{engine_id}@1796611533336466837-" + "x" * 30  # well past any column
    rank = _rank(backend, made, long_id, 0, 1)
    ready(rank)
    client = _scheduler(backend, made, long_id, 1)
    wait_until(lambda: client.stats().liveness_known, message="liveness")
    client.lookup(prompt(0), HOSTILE)  # the manual stub engine never answers it
    wait_until(lambda: rank.engine.started_ids() == [HOSTILE], message="started")
    conn = backend.factory()
    fleet = render_fleet(fleet_snapshot(conn, int(time.time() * 1000)), "redis://x")
    assert f"  {long_id}  " in fleet
    snap = inspect.snapshot(conn, KeySpace(long_id), 1, 50)
    assert [item["id"] for item in snap["lookups"]["shown"]] == [HOSTILE]
    text = inspect.render(snap, "redis://x", [])
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\nrank 0: engine reported" not in text
    (line,) = [line for line in text.splitlines() if "52;c;" in line]
    assert line.endswith(
        r"req\x1b[2J\x1b]52;c;cm0gLXJmIC8=\x07\nrank 0: engine reported 999 hits\u202e"
    )


def _snapshot_of(engine_id: str, **stats: Any) -> tuple[str, str]:
    """A scheduler's metrics snapshot (key, body) with ``stats`` overriding its counters."""
    publisher = MetricsPublisher(
        KeySpace(engine_id), SCHEDULER_ROLE, "client", ClientStats, interval_ms=1, ttl_ms=60_000
    )
    command = publisher.command(time.monotonic() + 1)
    assert command is not None
    assert isinstance(command[2], bytes | str)
    body = json.loads(command[2])
    body["stats"].update(stats)
    return str(command[1]), json.dumps(body)


def test_one_engines_bad_keys_cost_the_other_engines_nothing(
    tools_on: Backend, engine_id: str
) -> None:
    """A snapshot beyond float range, a metrics key of another type, a heartbeat that is JSON
    but no object, a lookup key that is no hash: each skipped and counted, the rest served."""
    conn = tools_on.factory()
    good, huge, typed, odd = (f"{engine_id}-{n}" for n in ("good", "huge", "typed", "odd"))
    key, body = _snapshot_of(good, hit_tokens=7)
    conn.set(key, body, px=60_000)
    key, body = _snapshot_of(huge, hit_tokens=10**400)
    conn.set(key, body, px=60_000)
    conn.hset(KeySpace(typed).metrics(SCHEDULER_ROLE), "not", "a snapshot")
    odd_keys = KeySpace(odd)
    conn.xgroup_create(odd_keys.requests, odd_keys.group(0), id="0", mkstream=True)
    conn.set(odd_keys.heartbeat(0), "[1, 2]", px=60_000)
    conn.set(KeySpace(typed).lookup("x"), "a string, not the lookup hash", px=60_000)
    conn.set(KeySpace(typed).requests, "a string, not the request stream", px=60_000)

    series = scrape(tools_on.factory, None)
    assert value(series, "broker_lookup_client_hit_tokens_total", engine=good) == 7
    assert value(series, "broker_lookup_client_hit_tokens_total", engine=huge) is None
    assert (value(series, "broker_lookup_exporter_snapshots", state="malformed") or 0) >= 2

    findings = diagnose(TOOLS, odd, _no_wait)
    assert _status(findings, "ranks") == [f"ok {odd}: ranks 0 alive of 1"]
    snap = inspect.snapshot(conn, odd_keys, 1, 50)
    assert snap["ranks"][0]["raw"] == "[1, 2]" and not inspect.check(snap, odd_keys)

    fleet = fleet_snapshot(conn, int(time.time() * 1000))
    mine = {e["engine_id"] for e in fleet["engines"]}
    assert {good, huge, odd} <= mine and typed not in mine
    (skipped,) = [s for s in fleet["skipped"] if typed in s]
    assert "WRONGTYPE" in skipped and "skipped" in skipped
    # doctor: that engine's checks say so and the others still run.
    findings = diagnose(TOOLS, None, _no_wait)
    ranks = _status(findings, "ranks")
    assert f"ok {odd}: ranks 0 alive of 1" in ranks
    (warned,) = [r for r in ranks if typed in r]
    assert warned.startswith(f"warn cannot read the keys of engine {typed}: a key is not")
    assert "WRONGTYPE" in warned


def test_a_ranks_log_line_escapes_the_callers_id(
    backend: Backend, made: Made, engine_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An id with a newline cannot forge a rank's log line of its own."""
    rank = _rank(backend, made, engine_id, 0, 1)
    ready(rank)
    client = _scheduler(backend, made, engine_id, 1)
    wait_until(lambda: client.stats().liveness_known, message="liveness")
    client.lookup(prompt(0), HOSTILE)
    wait_until(lambda: rank.engine.started_ids() == [HOSTILE], message="started")
    with caplog.at_level(logging.ERROR, logger="workers.pipeline.dispatch"):
        rank.engine.report(HOSTILE, 10**6)  # more hits than tokens: logged, reported 0
        wait_until(lambda: "hits for" in caplog.text, message="the rank's log line")
    (line,) = [r.getMessage() for r in caplog.records if "hits for" in r.getMessage()]
    assert "\n" not in line and "\x1b" not in line and "\x07" not in line
    assert r"for req\x1b[2J\x1b]52;c;cm0gLXJmIC8=\x07\nrank 0: engine reported 999" in line
