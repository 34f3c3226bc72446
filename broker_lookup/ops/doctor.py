"""``broker-lookup doctor``: what is wrong with a setup, on one screen.

Each check prints one line ``ok | warn | FAIL  <check>  <what it found>``: the server
answers, accepts our credentials, is recent enough and keeps our keys under memory
pressure; then, per engine on it, its ranks are alive and one process each, every
process hashes alike, and how often recent lookups hit. The exit code is 1 when a check
failed. It only reads (a heartbeat is read twice, to catch two processes writing it).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import redis

from broker_lookup.config import LookupConfig, redact_url
from broker_lookup.errors import (
    AuthFailed,
    BrokerLookupError,
    BrokerResponseError,
    MalformedMessage,
    translate_redis_errors,
)
from broker_lookup.processes import ExitCode
from broker_lookup.protocol.keys import EVERY_REQUEST_STREAM, KeySpace, engine_of
from broker_lookup.protocol.messages import decode_done
from broker_lookup.transport.connection import make_factory
from broker_lookup.transport.fingerprint import live_members

__all__ = ["Finding", "diagnose", "run_doctor"]

Status = Literal["ok", "warn", "FAIL"]
#: Completions read for the recent hit rate.
RECENT = 1000
#: Oldest servers the protocol runs on (its commands and Lua).
_MIN_REDIS = (6, 2)


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    status: Status
    check: str
    detail: str


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _server(client: redis.Redis) -> Iterator[Finding]:
    with translate_redis_errors("reading INFO server"):
        info: dict[str, Any] = client.info("server")
    redis_version = str(info.get("redis_version", "?"))
    name = f"valkey {info['valkey_version']}" if "valkey_version" in info else "redis"
    text = f"{name} (redis_version {redis_version})"
    if _version(redis_version) < _MIN_REDIS:
        yield Finding("FAIL", "server", f"{text}: Redis 6.2+ or Valkey 7.2+ is needed")
    else:
        yield Finding("ok", "server", text)
    try:
        with translate_redis_errors("reading maxmemory-policy"):
            policy = str(client.config_get("maxmemory-policy").get("maxmemory-policy", "?"))
    except BrokerResponseError as exc:  # CONFIG denied to an ACL user
        yield Finding("warn", "memory", f"maxmemory-policy unreadable here ({exc})")
        return
    if policy == "noeviction":
        yield Finding("ok", "memory", "maxmemory-policy noeviction")
    elif policy.startswith("volatile"):
        yield Finding(
            "warn",
            "memory",
            f"maxmemory-policy {policy}: under memory pressure lookup hashes and heartbeats "
            "(keys with a TTL) are evicted: lookups answer 0, ranks look dead. Prefer noeviction",
        )
    else:
        yield Finding(
            "FAIL",
            "memory",
            f"maxmemory-policy {policy} may evict the request stream and its consumer "
            "groups: set maxmemory-policy noeviction",
        )


def _engines(client: redis.Redis) -> list[str]:
    with translate_redis_errors("listing engines"):
        keys = list(client.scan_iter(match=EVERY_REQUEST_STREAM, count=1000))
    return sorted({e for e in map(engine_of, keys) if e is not None})


def _groups(client: redis.Redis, keys: KeySpace) -> list[int]:
    """Ranks with a consumer group on the engine's request stream."""
    with translate_redis_errors("reading consumer groups"):
        groups: list[dict[str, Any]] = client.xinfo_groups(keys.requests)
    ranks = []
    for group in groups:
        name = group.get("name", b"")
        text = name.decode() if isinstance(name, bytes) else str(name)
        if text.startswith("rank-") and text[5:].isdigit():
            ranks.append(int(text[5:]))
    return sorted(ranks)


def _beats(client: redis.Redis, keys: KeySpace, ranks: list[int]) -> dict[int, dict[str, Any]]:
    with translate_redis_errors("reading heartbeats"):
        raws = client.mget([keys.heartbeat(r) for r in ranks]) if ranks else []
    beats = {}
    for rank, raw in zip(ranks, raws, strict=True):
        try:
            beats[rank] = json.loads(raw) if raw is not None else None
        except ValueError:
            beats[rank] = {}
    return {r: b for r, b in beats.items() if b is not None}


def _who(beat: dict[str, Any]) -> str:
    return f"{beat.get('host', '?')}:{beat.get('pid', '?')}"


def _ranks(
    engine: str, ranks: list[int], first: dict[int, dict[str, Any]], then: dict[int, dict[str, Any]]
) -> Iterator[Finding]:
    alive = sorted(set(first) | set(then))
    dead = [r for r in ranks if r not in alive]
    where = f"{engine}: ranks {_list(alive)} alive of {len(ranks)}"
    if not alive:
        yield Finding(
            "warn", "ranks", f"{engine}: no live rank (stopped? its keys expire on their own)"
        )
    elif dead:
        yield Finding("FAIL", "ranks", f"{where}; {_list(dead)} without a heartbeat")
    else:
        yield Finding("ok", "ranks", where)
    for rank in sorted(set(first) & set(then)):
        if _who(first[rank]) != _who(then[rank]):
            yield Finding(
                "FAIL",
                "ranks",
                f"{engine}: rank {rank} is served twice ({_who(first[rank])} and "
                f"{_who(then[rank])} both write its heartbeat): stop one",
            )


def _list(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) or "none"


def _hashing(client: redis.Redis, keys: KeySpace) -> Finding:
    members = live_members(client, keys)
    kinds: dict[str, list[str]] = {}
    for name, fingerprint in members.items():
        kinds.setdefault(json.dumps(fingerprint, sort_keys=True), []).append(name)
    engine = keys.engine_id
    if len(kinds) <= 1:
        return Finding("ok", "hashing", f"{engine}: {len(members)} processes hash alike")
    shown = "; ".join(f"{', '.join(sorted(n))} hash with {fp}" for fp, n in sorted(kinds.items()))
    return Finding(
        "FAIL",
        "hashing",
        f"{engine}: processes hash differently, so their lookups never hit: {shown}. Use "
        "the same chunk_size, save_unfull_chunk, pre_caching_hash_algorithm, PYTHONHASHSEED",
    )


def _hit_rate(client: redis.Redis, keys: KeySpace) -> Finding:
    with translate_redis_errors("reading recent completions"):
        entries: Any = client.xrevrange(keys.done, count=RECENT)
    results = []
    for _entry_id, fields in entries or []:
        try:
            results.append(decode_done(fields or {}).result)
        except MalformedMessage:
            continue
    if not results:
        return Finding("ok", "hit rate", f"{keys.engine_id}: no completed lookup recorded")
    hits = sum(1 for r in results if r > 0)
    return Finding(
        "ok",
        "hit rate",
        f"{keys.engine_id}: {hits / len(results):.0%} of the last {len(results)} completed "
        f"lookups hit (mean {sum(results) / len(results):.0f} tokens)",
    )


def diagnose(
    config: LookupConfig,
    engine_id: str | None = None,
    wait: Callable[[float], None] = time.sleep,
) -> list[Finding]:
    """Every check, in order; stops after the first failed connection or authentication.

    ``wait`` sleeps between the two heartbeat reads (tests pass their own).
    """
    client = make_factory(config, "bl-doctor")()
    try:
        try:
            started = time.perf_counter()
            with translate_redis_errors("sending PING"):
                client.ping()
        except AuthFailed as exc:
            return [
                Finding("ok", "connect", "the server answered"),
                Finding("FAIL", "auth", str(exc)),
            ]
        except BrokerLookupError as exc:
            return [Finding("FAIL", "connect", str(exc))]
        ms = (time.perf_counter() - started) * 1000
        found = [Finding("ok", "connect", f"PING answered in {ms:.1f} ms")]
        found.append(Finding("ok", "auth", "accepted"))
        found += _server(client)
        found += _fleet(client, config, engine_id, wait)
        return found
    finally:
        client.close()


def _fleet(
    client: redis.Redis, config: LookupConfig, engine_id: str | None, wait: Callable[[float], None]
) -> list[Finding]:
    engines = [engine_id] if engine_id else _engines(client)
    if not engines:
        return [Finding("warn", "engines", "none on this server yet: start worker ranks")]
    found = [Finding("ok", "engines", f"{len(engines)}: {', '.join(engines)}")]
    spaces = [KeySpace(e) for e in engines]
    groups = {k.engine_id: _groups(client, k) if client.exists(k.requests) else [] for k in spaces}
    first = {k.engine_id: _beats(client, k, groups[k.engine_id]) for k in spaces}
    # Two heartbeat intervals: a second process serving a rank rewrites its heartbeat.
    wait(2 * config.heartbeat_interval_ms / 1000)
    for keys in spaces:
        engine = keys.engine_id
        then = _beats(client, keys, groups[engine])
        found += _ranks(engine, groups[engine], first[engine], then)
        found.append(_hashing(client, keys))
        found.append(_hit_rate(client, keys))
    return found


def render(findings: list[Finding], url: str) -> str:
    """The report as text: one line per finding, then the verdict."""
    width = max((len(f.check) for f in findings), default=0)
    lines = [f"broker-lookup doctor: {redact_url(url)}"]
    lines += [f"  {f.status:<5} {f.check:<{width}}  {f.detail}" for f in findings]
    failed = sum(1 for f in findings if f.status == "FAIL")
    warned = sum(1 for f in findings if f.status == "warn")
    verdict = f"{failed} check(s) failed" if failed else "every check passed"
    lines.append(verdict + (f", {warned} warning(s)" if warned else ""))
    return "\n".join(lines)


def run_doctor(
    config: LookupConfig, engine_id: str | None = None, out: TextIO | None = None
) -> int:
    """Print the report; 0 if no check failed, else 1."""
    try:
        findings = diagnose(config, engine_id)
    except BrokerLookupError as exc:  # the server went away between two checks
        findings = [Finding("FAIL", "connect", str(exc))]
    print(render(findings, config.redis_url), file=out or sys.stdout, flush=True)
    return ExitCode.FAILED if any(f.status == "FAIL" for f in findings) else ExitCode.OK
