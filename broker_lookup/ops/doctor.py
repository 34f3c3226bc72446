"""``broker-lookup doctor``: what is wrong with a setup, on one screen.

Each check prints one line ``ok | warn | FAIL  <check>  <what it found>``: the server
answers, accepts our credentials, is recent enough and keeps our keys under memory
pressure; then, per engine on it, its ranks are alive and one process each, no second
process waits for a role another holds (a conflict), every process hashes alike, how
often recent lookups hit, and no engine is split across two namespaces of one configured
id. The exit code is 1 when a check failed. It only reads (a heartbeat is read twice, to
catch two processes writing it), with the commands of the read-only ``operator`` ACL
user: a check the user may not run is ``skip``, naming the user, the command or key and
the fix, and does not fail the run; nor does one engine's unreadable key stop the others.
"""

from __future__ import annotations

import json
import logging
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
    ConfigError,
    translate_redis_errors,
)
from broker_lookup.ops.access import acting_user, denial, denied_line
from broker_lookup.ops.fleet import conflicts, engine_roles
from broker_lookup.ops.split import EVERY_SCHEDULER_LEASE, View, find_splits
from broker_lookup.printable import shown
from broker_lookup.processes import ExitCode
from broker_lookup.protocol.keys import (
    EVERY_REQUEST_STREAM,
    SCHEDULER_ROLE,
    KeySpace,
    engine_of,
    selected_patterns,
    validate_engine_id,
)
from broker_lookup.protocol.messages import decode_completions
from broker_lookup.transport.connection import make_factory
from broker_lookup.transport.fingerprint import live_members

__all__ = ["Finding", "diagnose", "run_doctor"]

#: ``skip``: the check could not run (the ACL user may not read what it needs).
Status = Literal["ok", "warn", "FAIL", "skip"]
#: Completions read for the recent hit rate.
RECENT = 1000
#: Oldest servers the protocol runs on (its commands and Lua).
_MIN_REDIS = (6, 2)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    status: Status
    check: str
    detail: str


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _server(client: redis.Redis, user: str | None) -> Iterator[Finding]:
    try:
        with translate_redis_errors("reading INFO server"):
            info: dict[str, Any] = client.info("server")
            # INFO memory carries the policy: no CONFIG GET, which no shipped user may run.
            memory: dict[str, Any] = client.info("memory")
    except BrokerResponseError as exc:
        if denial(exc) is not None:
            yield _skip("server", "read INFO", exc, user)
        else:  # a server without INFO (renamed away by a managed service)
            yield Finding("warn", "server", f"version and memory policy unknown: {exc}")
        return
    redis_version = str(info.get("redis_version", "?"))
    name = f"valkey {info['valkey_version']}" if "valkey_version" in info else "redis"
    text = f"{name} (redis_version {redis_version})"
    if _version(redis_version) < _MIN_REDIS:
        yield Finding("FAIL", "server", f"{text}: Redis 6.2+ or Valkey 7.2+ is needed")
    else:
        yield Finding("ok", "server", text)
    policy = str(memory.get("maxmemory_policy", "?"))
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


def _skip(check: str, what: str, exc: BrokerResponseError, user: str | None) -> Finding:
    """A check that could not run: the user may not ``what``, or a key is not what the
    protocol writes (one engine's key: the other engines are still checked).

    Raises:
        BrokerResponseError: ``exc``, when it is neither.
    """
    refusal = denial(exc)
    if refusal is not None:
        return Finding("skip", check, denied_line(user, what, refusal))
    if isinstance(exc.__cause__, redis.ResponseError) and "WRONGTYPE" in str(exc):
        logger.warning("doctor: %s skipped: %s", check, exc)
        detail = f"cannot {what}: a key is not what the protocol writes ({exc}); skipped"
        return Finding("warn", check, detail)
    raise exc


def _engines(client: redis.Redis, engine_id: str | None) -> list[str]:
    """The namespaces to check: every one with a request stream or a scheduler's lease
    (of ``engine_id`` and its vLLM instances only, when given)."""
    if engine_id is None:
        patterns = [EVERY_REQUEST_STREAM, EVERY_SCHEDULER_LEASE]
    else:
        keys = KeySpace(engine_id)
        sched = keys.owner(SCHEDULER_ROLE)
        patterns = [
            *selected_patterns(engine_id, keys.part(keys.requests)),
            *selected_patterns(engine_id, keys.part(sched)),
        ]
    with translate_redis_errors("listing engines"):
        found = [k for p in patterns for k in client.scan_iter(match=p, count=1000)]
    return sorted({e for e in map(engine_of, found) if e is not None})


def _groups(client: redis.Redis, keys: KeySpace) -> list[int]:
    """Ranks with a consumer group on the engine's request stream."""
    try:
        with translate_redis_errors("reading consumer groups"):
            groups: list[dict[str, Any]] = client.xinfo_groups(keys.requests)
    except BrokerResponseError as exc:
        if "no such key" in str(exc):  # no stream: a scheduler that never sent a lookup
            return []
        raise
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
    beats: dict[int, Any] = {}
    for rank, raw in zip(ranks, raws, strict=True):
        try:
            beats[rank] = json.loads(raw) if raw is not None else None
        except ValueError:
            beats[rank] = {}
        if beats[rank] is not None and not isinstance(beats[rank], dict):
            # JSON, but not a rank's object: it beats, by whom is unknown.
            logger.warning("doctor: heartbeat %s is not a JSON object", keys.heartbeat(rank))
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
        # An entry may carry several completions (a rank's report batch): each counts.
        results += [ev.result for ev in decode_completions(fields or {}).events]
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
    connect_timeout_s: float | None = None,
) -> list[Finding]:
    """Every check, in order; stops after the first failed connection or authentication.

    ``engine_id``: that engine and its vLLM instances only. ``wait`` sleeps between the
    two heartbeat reads (tests pass their own). ``connect_timeout_s``: each answer of Redis
    is waited for this long, once (default: ``socket_timeout_ms``, retried).
    """
    client = make_factory(config, "bl-doctor", socket_timeout_s=connect_timeout_s)()
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
            return [Finding("FAIL", "connect", _gave_up(exc, connect_timeout_s))]
        ms = (time.perf_counter() - started) * 1000
        found = [Finding("ok", "connect", f"PING answered in {ms:.1f} ms")]
        found.append(Finding("ok", "auth", "accepted"))
        user = acting_user(config)
        found += _server(client, user)
        found += _fleet(client, config, engine_id, wait, user)
        return found
    finally:
        client.close()


def _owners(client: redis.Redis, keys: KeySpace) -> Finding:
    """A second process waiting for a role another one holds (its ``contender`` key)."""
    with translate_redis_errors("reading the owner leases"):
        parts = [keys.part(k) for k in client.scan_iter(match=keys.contender_pattern)]
        lines = conflicts(keys.engine_id, engine_roles(client, keys, parts))
    if lines:
        return Finding("FAIL", "owners", "; ".join(lines) + ": stop one of them")
    return Finding("ok", "owners", f"{keys.engine_id}: no role claimed twice")


def _fleet(
    client: redis.Redis,
    config: LookupConfig,
    engine_id: str | None,
    wait: Callable[[float], None],
    user: str | None,
) -> list[Finding]:
    try:
        engines = _engines(client, engine_id)
    except BrokerResponseError as exc:
        return [_skip("engines", "list the engines (SCAN)", exc, user)]
    if not engines:
        return [Finding("warn", "engines", "none on this server yet: start worker ranks")]
    found = [Finding("ok", "engines", f"{len(engines)}: {', '.join(engines)}")]
    groups: dict[str, list[int]] = {}
    first: dict[str, dict[int, dict[str, Any]]] = {}
    for engine in engines:
        try:
            groups[engine] = _groups(client, KeySpace(engine))
            first[engine] = _beats(client, KeySpace(engine), groups[engine])
        except BrokerResponseError as exc:
            found.append(_skip("ranks", f"read the keys of engine {engine}", exc, user))
    # Two heartbeat intervals: a second process serving a rank rewrites its heartbeat.
    wait(2 * config.heartbeat_interval_ms / 1000)
    views = []
    for engine in first:
        try:
            checked, view = _engine(client, KeySpace(engine), groups[engine], first[engine])
        except BrokerResponseError as exc:
            found.append(_skip("ranks", f"read the keys of engine {engine}", exc, user))
            continue
        found += checked
        views.append(view)
    splits = find_splits(views)
    found += [Finding("FAIL", "split", s.message()) for s in splits]
    if not splits:
        found.append(Finding("ok", "split", "every engine's processes share one namespace"))
    return found


def _engine(
    client: redis.Redis, keys: KeySpace, groups: list[int], first: dict[int, dict[str, Any]]
) -> tuple[list[Finding], View]:
    """One engine's checks after the wait, and what the split check needs of it.

    Raises:
        BrokerResponseError: Redis refused a read (the engine's checks are skipped).
    """
    then = _beats(client, keys, groups)
    found = list(_ranks(keys.engine_id, groups, first, then))
    found += [_owners(client, keys), _hashing(client, keys), _hit_rate(client, keys)]
    with translate_redis_errors("reading the scheduler's lease"):
        sched = client.pttl(keys.owner(SCHEDULER_ROLE)) != -2
    return found, View(keys.engine_id, sched, frozenset(then) | frozenset(first))


def render(findings: list[Finding], url: str) -> str:
    """The report as text: one line per finding, then the verdict."""
    width = max((len(f.check) for f in findings), default=0)
    lines = [f"broker-lookup doctor: {redact_url(url)}"]
    lines += [f"  {f.status:<5} {f.check:<{width}}  {f.detail}" for f in findings]
    failed = sum(1 for f in findings if f.status == "FAIL")
    warned = sum(1 for f in findings if f.status == "warn")
    skipped = sum(1 for f in findings if f.status == "skip")
    verdict = f"{failed} check(s) failed" if failed else "every check that ran passed"
    if not failed and not skipped:
        verdict = "every check passed"
    verdict += f", {warned} warning(s)" if warned else ""
    lines.append(verdict + (f", {skipped} skipped" if skipped else ""))
    # Ids and hosts come from processes and callers: no character a terminal acts on.
    return "\n".join(shown(line) for line in lines)


def _gave_up(exc: BrokerLookupError, connect_timeout_s: float | None) -> str:
    if connect_timeout_s is None:
        return str(exc)
    return f"{exc} (--connect-timeout {connect_timeout_s:g}s)"


def run_doctor(
    config: LookupConfig,
    engine_id: str | None = None,
    out: TextIO | None = None,
    connect_timeout_s: float | None = None,
) -> int:
    """Print the report; 0 if no check failed, 1 if one did, 2 for a bad ``engine_id``."""
    if engine_id is not None:
        try:
            validate_engine_id(engine_id, "--engine-id")
        except ConfigError as exc:
            print(f"broker-lookup doctor: {exc}", file=sys.stderr)
            return ExitCode.USAGE
    try:
        findings = diagnose(config, engine_id, connect_timeout_s=connect_timeout_s)
    except BrokerLookupError as exc:  # the server went away between two checks
        findings = [Finding("FAIL", "connect", _gave_up(exc, connect_timeout_s))]
    print(render(findings, config.redis_url), file=out or sys.stdout, flush=True)
    return ExitCode.FAILED if any(f.status == "FAIL" for f in findings) else ExitCode.OK
