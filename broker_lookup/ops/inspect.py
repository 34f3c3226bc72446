"""``broker-lookup inspect``: what one engine's keys say right now (every engine's, in
short, without ``--engine-id``: see ``fleet``).

In-flight lookups (state, age, per-rank hits, missing ranks with what each confirmed
loaded so far, TTL; ``partial`` once answered at the deadline), rank liveness from
the heartbeat keys, per-group lag and pending, stream lengths, the last dead letters
and hashing fingerprints, and per rank, over the last ``recent`` completions (those
``rank_insights`` timed), p50/p99 of the submit-to-report latency on the server's clock
and the share of lookups it reported last, and who holds each role (scheduler, ranks)
and who waits for it. ``--check`` turns it into a probe: exit 0 iff every expected rank
has a heartbeat and a consumer group and no role has a second process waiting for it
(for the fleet: no conflict anywhere). Read-only: it never writes a key.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import redis

from broker_lookup.config import LookupConfig, redact_url
from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.ops.access import acting_user, denial, denied_line
from broker_lookup.ops.fleet import conflicts, engine_roles, render_owners, run_fleet
from broker_lookup.ops.rank_latency import rank_latency, render_rank_latency
from broker_lookup.ops.split import View, find_splits
from broker_lookup.printable import shown
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import (
    SCHEDULER_ROLE,
    KeySpace,
    engine_of,
    selected_patterns,
    validate_engine_id,
)
from broker_lookup.transport.connection import make_factory

__all__ = ["RECENT", "check", "namespaces", "rank_latency", "render", "run_inspect", "snapshot"]

Snapshot = dict[str, Any]

#: Completion entries read for the per-rank latency by default.
RECENT = 1000


def _s(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: object, default: int | None = None) -> int | None:
    try:
        return int(_s(value))
    except ValueError:
        return default


def _lookups(client: redis.Redis, keys: KeySpace, now_ms: int, limit: int) -> Snapshot:
    found = [_s(k) for k in client.scan_iter(match=keys.lookup_pattern, count=500)]
    shown = sorted(found)[:limit]
    pipe = client.pipeline(transaction=False)
    for key in shown:
        pipe.hgetall(key)
        pipe.pttl(key)
    replies = pipe.execute()
    items = []
    for i, key in enumerate(shown):
        fields = lookup_hash.decode(replies[2 * i])
        created = fields.created_ms
        items.append(
            {
                # The caller's id: the key holds a digest of ids a key should not hold.
                "id": fields.lookup_id or keys.lookup_id_of(key),
                "state": fields.state,
                "gen": fields.gen,
                "age_ms": now_ms - created if created is not None else None,
                "tokens": fields.tokens,
                "hits": fields.hits,
                "missing": fields.missing,
                # Prefixes ranks confirmed loaded so far (engines that report progress).
                "progress": fields.progress,
                "partial": fields.partial,
                "result": fields.result,
                "ttl_ms": replies[2 * i + 1],
            }
        )
    return {"total": len(found), "shown": items}


def _ranks(client: redis.Redis, keys: KeySpace, now_ms: int) -> dict[int, Snapshot]:
    ranks: dict[int, Snapshot] = {}
    for raw in client.scan_iter(match=keys.heartbeat_pattern, count=500):
        key = _s(raw)
        rank = _int(key.rsplit(":", 1)[-1])
        value = client.get(key)
        ttl = client.pttl(key)
        if rank is None or value is None:
            continue  # expired between SCAN and GET
        try:
            info = json.loads(value)
        except ValueError:
            info = {"raw": _s(value)}
        if not isinstance(info, dict):  # JSON, but not what a rank writes: show it raw
            info = {"raw": _s(value)}
        ts = info.get("ts_ms")
        age = (now_ms - ts) / 1000 if isinstance(ts, int) else None
        ranks[rank] = {**info, "age_s": age, "ttl_ms": ttl}
    return ranks


def _groups(client: redis.Redis, keys: KeySpace) -> list[Snapshot]:
    try:
        groups: Any = client.xinfo_groups(keys.requests)
    except redis.ResponseError:
        return []  # no stream yet: no rank ever started
    return [{_s(k): (_s(v) if isinstance(v, bytes) else v) for k, v in g.items()} for g in groups]


def snapshot(
    client: redis.Redis,
    keys: KeySpace,
    world_size: int | None,
    limit: int,
    recent: int = RECENT,
) -> Snapshot:
    """Everything ``inspect`` shows, as plain JSON-able data.

    ``recent``: completion entries read (newest first) for the per-rank latency.

    Raises:
        BrokerUnavailable: Redis could not be reached.
    """
    now_ms = int(time.time() * 1000)
    with translate_redis_errors(f"inspecting engine {keys.engine_id}"):
        groups = _groups(client, keys)
        pipe = client.pipeline(transaction=False)
        for stream in (keys.requests, keys.done, keys.dead):
            pipe.xlen(stream)
        pipe.xrevrange(keys.dead, count=5)
        pipe.hgetall(keys.fingerprint)
        pipe.xrevrange(keys.done, count=max(1, recent))
        req, done, dead, letters, fps, completions = pipe.execute()
        parts = [keys.part(k) for k in client.scan_iter(match=keys.pattern, count=500)]
        roles = engine_roles(client, keys, parts)
        snap: Snapshot = {
            "engine_id": keys.engine_id,
            "keys": len(parts),
            "roles": roles,
            "conflicts": conflicts(keys.engine_id, roles),
            "time_ms": now_ms,
            "lookups": _lookups(client, keys, now_ms, limit),
            "ranks": _ranks(client, keys, now_ms),
            "groups": groups,
            "streams": {keys.requests: req, keys.done: done, keys.dead: dead},
            "dead_letters": [
                {"id": _s(i), **{_s(k): _s(v) for k, v in f.items()}} for i, f in letters
            ],
            "fingerprints": {_s(k): _s(v) for k, v in fps.items()},
            "rank_latency": rank_latency(completions),
        }
    names = [str(g.get("name", "")) for g in groups]
    in_groups = [int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit()]
    snap["world_size"] = world_size if world_size else (max(in_groups) + 1 if in_groups else 0)
    return snap


def check(snap: Snapshot, keys: KeySpace) -> list[str]:
    """Why the engine is not healthy: empty when every expected rank beats and has its group."""
    n = snap["world_size"]
    if not n:
        return [f"no consumer group on {keys.requests} and no --world-size: no rank expected"]
    groups = {str(g.get("name")) for g in snap["groups"]}
    reasons = []
    for rank in range(n):
        if rank not in snap["ranks"]:
            reasons.append(f"rank {rank}: no heartbeat ({keys.heartbeat(rank)} missing)")
        if keys.group(rank) not in groups:
            reasons.append(f"rank {rank}: consumer group {keys.group(rank)} missing")
    return reasons + list(snap.get("conflicts", []))


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _render_ranks(snap: Snapshot, lines: list[str]) -> None:
    n = snap["world_size"]
    lines.append(f"RANKS (world size {n})")
    lines.append(
        f"  {'rank':<5}{'alive':<7}{'pid':<9}{'host':<22}{'hb age':<8}{'running':<9}{'held':<6}"
        "reserved"
    )
    for rank in sorted(set(range(n)) | set(snap["ranks"])):
        info = snap["ranks"].get(rank)
        if info is None:
            lines.append(f"  {rank:<5}{'NO':<7}-")
            continue
        lines.append(
            f"  {rank:<5}{'yes':<7}{info.get('pid', '-')!s:<9}{str(info.get('host', '-'))[:21]:<22}"
            f"{_fmt_s(info.get('age_s')):<8}{info.get('running', '-')!s:<9}"
            f"{info.get('held', '-')!s:<6}{info.get('reservations', '-')}"
        )


def _render_lookups(snap: Snapshot, lines: list[str]) -> None:
    lk = snap["lookups"]
    lines.append(f"LOOKUPS ({lk['total']} keys, {len(lk['shown'])} shown)")
    if lk["shown"]:
        # The id comes last and whole, so it can be pasted into HGETALL however long it is.
        lines.append(
            f"  {'state':<9}{'age':<9}{'ttl':<9}{'result':<8}{'hits':<24}{'missing':<12}id"
        )
    for item in lk["shown"]:
        shown = item["hits"].items()
        hits = " ".join(f"{lookup_hash.rank_field(r)}={v}" for r, v in shown) or "-"
        ttl = item["ttl_ms"] / 1000 if item["ttl_ms"] and item["ttl_ms"] > 0 else None
        age = item["age_ms"] / 1000 if item["age_ms"] is not None else None
        progress = item.get("progress") or {}
        missing = ",".join(_awaited(r, progress.get(r)) for r in item["missing"]) or "-"
        state = "partial" if item.get("partial") else item["state"] or "-"
        result = "-" if item.get("result") is None else str(item["result"])
        lines.append(
            f"  {state:<9}{_fmt_s(age):<9}{_fmt_s(ttl):<9}{result:<8}"
            f"{hits:<24}{missing:<12}{item['id']}"
        )


def _awaited(rank: int, loaded: int | None) -> str:
    """A rank still awaited, with the prefix it confirmed loaded so far if it said."""
    return str(rank) if loaded is None else f"{rank}(loaded {loaded})"


def render(snap: Snapshot, url: str, reasons: list[str] | None) -> str:
    """The human-readable report (``reasons`` is None unless ``--check``)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap["time_ms"] / 1000))
    lines = [f"engine {snap['engine_id']}  redis {redact_url(url)}  at {when}", ""]
    _render_ranks(snap, lines)
    lines += ["", "GROUPS"]
    lines.append(f"  {'group':<10}{'consumers':<11}{'pending':<9}{'lag':<7}last-delivered")
    for g in snap["groups"]:
        lines.append(
            f"  {g.get('name')!s:<10}{g.get('consumers')!s:<11}{g.get('pending')!s:<9}"
            f"{g.get('lag')!s:<7}{g.get('last-delivered-id')}"
        )
    render_owners(snap.get("roles", {}), lines)
    lines += ["", "STREAMS  " + "  ".join(f"{k} {v}" for k, v in snap["streams"].items()), ""]
    render_rank_latency(snap.get("rank_latency"), lines)
    _render_lookups(snap, lines)
    lines += ["", f"DEAD LETTERS (last {len(snap['dead_letters'])})"]
    for d in snap["dead_letters"]:
        lines.append(f"  {d['id']}  rank {d.get('rank', '?')}: {d.get('reason', '?')}")
    if snap["fingerprints"]:
        lines += ["", "FINGERPRINTS"]
        lines += [f"  {k}: {v}" for k, v in sorted(snap["fingerprints"].items())]
    if reasons is not None:
        lines += ["", "CHECK " + ("OK" if not reasons else "FAILED")]
        lines += [f"  {r}" for r in reasons]
    # Lookup ids, dead letters and hosts come from callers and processes: no line may
    # carry a character the operator's terminal would act on.
    return "\n".join(shown(line) for line in lines)


def namespaces(client: redis.Redis, engine_id: str) -> list[str]:
    """The namespaces with a key that ``--engine-id engine_id`` selects: the id itself and
    every vLLM instance of it (``<engine_id>@<instance>``)."""
    patterns = selected_patterns(engine_id)
    with translate_redis_errors(f"listing the namespaces of engine {engine_id}"):
        found = {engine_of(k) for p in patterns for k in client.scan_iter(match=p, count=1000)}
    return sorted(e for e in found if e is not None)


def _view(snap: Snapshot) -> View:
    sched = snap["roles"].get(SCHEDULER_ROLE) or {}
    return View(snap["engine_id"], bool(sched.get("owner")), frozenset(snap["ranks"]))


def _once(
    client: redis.Redis,
    engine_id: str | None,
    config: LookupConfig,
    opts: dict[str, Any],
    out: TextIO,
) -> int:
    url = redact_url(config.redis_url)
    if engine_id is None:
        with translate_redis_errors("inspecting every engine"):
            return run_fleet(client, url, opts["as_json"], opts["check"], out, acting_user(config))
    found = namespaces(client, engine_id)
    if not found:
        where = " or ".join(selected_patterns(engine_id))
        if opts["allow_absent"]:
            # Reading the engine's keys as this user worked: all a fresh install promises.
            _print_absent(engine_id, url, where, opts["as_json"], out)
            return 0
        print(f"no key of engine {engine_id} on {url} ({where})", file=sys.stderr)
        return 1
    args = (opts["world_size"], opts["limit"], opts["recent"])
    snaps = [snapshot(client, KeySpace(ns), *args) for ns in found]
    splits = [s.message() for s in find_splits(map(_view, snaps))]
    reasons = [r for snap in snaps for r in check(snap, KeySpace(snap["engine_id"]))] + splits
    if found == [engine_id]:  # the engine's own namespace alone: the one-engine report
        _print_one(snaps[0], reasons, config, opts, out)
    else:
        _print_instances(engine_id, snaps, splits, reasons, config, opts, out)
    return 1 if opts["check"] and reasons else 0


def _print_absent(engine_id: str, url: str, where: str, as_json: bool, out: TextIO) -> None:
    """``--allow-absent`` with no key of ``engine_id``: say so, as a passed check."""
    if as_json:
        body: Snapshot = {"engine_id": engine_id, "instances": [], "splits": [], "redis_url": url}
        body["check"] = {"ok": True, "reasons": []}
        print(json.dumps(body), file=out, flush=True)
        return
    line = f"no process of engine {engine_id} has registered on {url} yet ({where})"
    print(shown(line + ": nothing to check"), file=out, flush=True)


def _print_one(
    snap: Snapshot, reasons: list[str], config: LookupConfig, opts: dict[str, Any], out: TextIO
) -> None:
    if opts["as_json"]:
        snap["check"] = {"ok": not reasons, "reasons": reasons}
        snap["redis_url"] = redact_url(config.redis_url)
        print(json.dumps(snap, default=str), file=out, flush=True)
    else:
        print(render(snap, config.redis_url, reasons if opts["check"] else None), file=out)


def _print_instances(
    engine_id: str,
    snaps: list[Snapshot],
    splits: list[str],
    reasons: list[str],
    config: LookupConfig,
    opts: dict[str, Any],
    out: TextIO,
) -> None:
    """A configured id's namespaces: one report each, then its splits and the check."""
    if opts["as_json"]:
        body: Snapshot = {"engine_id": engine_id, "instances": snaps, "splits": splits}
        body["redis_url"] = redact_url(config.redis_url)
        body["check"] = {"ok": not reasons, "reasons": reasons}
        print(json.dumps(body, default=str), file=out, flush=True)
        return
    parts = [render(snap, config.redis_url, None) for snap in snaps]
    tail = [f"SPLITS ({len(splits)})", *(f"  {line}" for line in splits or ["none"])]
    if opts["check"]:
        tail += ["", "CHECK " + ("OK" if not reasons else "FAILED")]
        tail += [f"  {r}" for r in reasons]
    names = ", ".join(s["engine_id"] for s in snaps)
    head = f"{len(snaps)} namespace(s) of engine {engine_id}: {names}"
    body_text = ("\n\n" + "-" * 72 + "\n").join(parts)
    print(shown(head), "", body_text, "", *map(shown, tail), sep="\n", file=out)


#: Home the cursor and clear the screen: ``--watch`` redraws in place on a terminal.
_CLEAR = "\x1b[H\x1b[2J"


def run_inspect(
    config: LookupConfig,
    engine_id: str | None,
    *,
    world_size: int | None = None,
    as_json: bool = False,
    watch_s: float | None = None,
    check: bool = False,
    allow_absent: bool = False,
    limit: int = 50,
    recent: int = RECENT,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
    connect_timeout_s: float | None = None,
) -> int:
    """Print one report, or one every ``watch_s`` seconds until Ctrl-C; return the exit code.

    ``engine_id`` None: every engine on the server; else that engine and its vLLM
    instances, and whether it is split. ``recent``: completion entries read for the
    per-rank latency (newest first). ``allow_absent``: no key of ``engine_id`` yet (nothing
    has served it) is a pass, not exit 1. ``connect_timeout_s``: each answer of Redis is waited
    for this long, once (default: ``socket_timeout_ms``, retried).

    Exit codes: 0 ok, 1 ``check`` failed or no key of ``engine_id`` (unless
    ``allow_absent``), 3 Redis unreachable or refused a read.

    Raises:
        ConfigError: ``engine_id`` is not an engine id.
    """
    stream = out or sys.stdout
    if engine_id is not None:
        validate_engine_id(engine_id, "--engine-id")
    opts = {
        "world_size": world_size,
        "limit": limit,
        "recent": recent,
        "as_json": as_json,
        "check": check,
        "allow_absent": allow_absent,
    }
    client = make_factory(config, "bl-inspect", socket_timeout_s=connect_timeout_s)()
    waited = f" (--connect-timeout {connect_timeout_s:g}s)" if connect_timeout_s else ""
    code = 0
    try:
        while True:
            try:
                code = _once(client, engine_id, config, opts, stream)
            except BrokerLookupError as exc:
                refusal = denial(exc)
                why = (
                    denied_line(acting_user(config), "read these keys", refusal) if refusal else exc
                )
                print(
                    f"cannot inspect {redact_url(config.redis_url)}{waited}: {why}",
                    file=sys.stderr,
                )
                code = 3
            if not watch_s:
                return code
            sleep(watch_s)
            # On a terminal the next report replaces this one; piped, they follow each other.
            print(_CLEAR if stream.isatty() else "-" * 72, file=stream, end="", flush=True)
            if not stream.isatty():
                print(file=stream)
    except KeyboardInterrupt:
        return code
    finally:
        client.close()
