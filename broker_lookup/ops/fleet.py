"""``broker-lookup inspect`` without ``--engine-id``: every engine on one server.

One SCAN of ``bl:{*`` finds every key; keys are grouped by their hash tag (the engine
id). Per engine: its scheduler and ranks (the lease holder, heartbeat live or not, host,
pid), lookups in flight, conflicts (a process waiting for a role another one holds: its
``contender`` key) and, for a stale engine (no live lease, no heartbeat), when its last
key expires (the largest PTTL; ``never`` if a key has none). An engine split across two
namespaces of one configured id (see ``split``) is reported beside the conflicts. An engine
whose keys the user may not read (a per-engine ``operator-<engine>``) is skipped and
counted, not fatal. Read-only.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from typing import Any, TextIO

import redis

from broker_lookup.ops.access import denial, denied_line
from broker_lookup.ops.split import View, find_splits
from broker_lookup.printable import shown
from broker_lookup.protocol.keys import FLEET_PATTERN, SCHEDULER_ROLE, KeySpace, engine_of
from broker_lookup.protocol.ownership import describe, parse_holder

__all__ = [
    "conflicts",
    "engine_roles",
    "fleet_snapshot",
    "problems",
    "render_fleet",
    "render_owners",
    "run_fleet",
    "splits_of",
]

Snapshot = dict[str, Any]
logger = logging.getLogger(__name__)


def _s(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _who(raw: object) -> dict[str, Any]:
    try:
        info = json.loads(_s(raw))
    except ValueError:
        return {"raw": _s(raw)}
    return info if isinstance(info, dict) else {"raw": _s(raw)}


def _named(info: dict[str, Any]) -> str:
    return describe(info.get("host", "?"), info.get("pid", "?"), info.get("started_ms"))


def engine_roles(client: redis.Redis, keys: KeySpace, parts: list[str]) -> dict[str, Snapshot]:
    """Per role seen in ``parts`` (``owner:<role>``, ``contender:<role>``, ``hb:<r>``): the
    lease holder, its TTL, whether the rank beats, and who waits for it."""
    roles = sorted(
        {p.split(":", 1)[1] for p in parts if p.split(":", 1)[0] in ("owner", "contender", "hb")}
    )
    pipe = client.pipeline(transaction=False)
    for role in roles:
        pipe.get(keys.owner(role))
        pipe.pttl(keys.owner(role))
        pipe.get(keys.contender(role))
        # A rank's heartbeat (PTTL -2: none); the scheduler has none (its lease again keeps
        # the stride). PTTL, not EXISTS: the operator's ACL user reads with PTTL already.
        pipe.pttl(keys.heartbeat(int(role)) if role.isdigit() else keys.owner(role))
    replies = pipe.execute()
    out: dict[str, Snapshot] = {}
    for i, role in enumerate(roles):
        value, ttl, waiting, beats = replies[4 * i : 4 * i + 4]
        holder = parse_holder(value)
        out[role] = {
            "owner": {**holder.info, "epoch": holder.epoch} if holder else None,
            "owner_ttl_ms": ttl if holder else None,
            "heartbeat": beats != -2 if role != SCHEDULER_ROLE else None,
            "waiting": _who(waiting) if waiting is not None else None,
        }
    return out


def conflicts(engine_id: str, roles: dict[str, Snapshot]) -> list[str]:
    """One line per role a second process waits for while another holds it."""
    lines = []
    for role, info in sorted(roles.items()):
        if info["waiting"] is None:
            continue
        what = "the scheduler" if role == SCHEDULER_ROLE else f"rank {role}"
        owner = info["owner"]
        held = _named(owner) if owner else "nobody (taking over)"
        lines.append(
            f"engine {engine_id} {what}: served by {held}; a second process waits for it: "
            f"{_named(info['waiting'])}"
        )
    return lines


def _engine(client: redis.Redis, engine_id: str, found: list[str]) -> Snapshot:
    keys = KeySpace(engine_id)
    parts = [keys.part(k) for k in found]
    roles = engine_roles(client, keys, parts)
    lookups = [k for k, p in zip(found, parts, strict=True) if p.startswith("lookup:")]
    pipe = client.pipeline(transaction=False)
    for key in found:
        pipe.pttl(key)
    for key in lookups:
        pipe.hget(key, "state")
    replies = pipe.execute()
    ttls = replies[: len(found)]
    states = replies[len(found) :]
    live = any(r["owner"] or r["heartbeat"] for r in roles.values())
    never = any(t == -1 for t in ttls)
    return {
        "engine_id": engine_id,
        "live": live,
        "keys": len(found),
        "scheduler": roles.get(SCHEDULER_ROLE),
        "ranks": {int(r): v for r, v in roles.items() if r.isdigit()},
        "inflight": sum(1 for s in states if s == b"pending"),
        "conflicts": conflicts(engine_id, roles),
        # -1: a key without a TTL (it never expires); else the last key's PTTL.
        "expires_in_ms": -1 if never else max((t for t in ttls if t > 0), default=0),
    }


def fleet_snapshot(client: redis.Redis, now_ms: int, user: str | None = None) -> Snapshot:
    """Every engine with a key on the server, by engine id (see the module docstring).

    ``user``: the ACL user reading, named where it may not read an engine's keys (those
    engines, and engines with a key of the wrong type, are listed under ``skipped``).
    """
    by_engine: dict[str, list[str]] = defaultdict(list)
    for raw in client.scan_iter(match=FLEET_PATTERN, count=1000):
        engine = engine_of(raw)
        if engine is not None:
            by_engine[engine].append(_s(raw))
    engines, skipped = [], []
    for engine, found in sorted(by_engine.items()):
        try:
            engines.append(_engine(client, engine, sorted(found)))
        except redis.ResponseError as exc:  # one engine's keys: the others are still shown
            skipped.append(_skipped(engine, exc, user))
    splits = [s.message() for s in splits_of(engines)]
    return {"time_ms": now_ms, "engines": engines, "splits": splits, "skipped": skipped}


def _skipped(engine: str, exc: redis.ResponseError, user: str | None) -> str:
    refusal = denial(exc)
    if refusal is not None:
        return f"engine {engine}: " + denied_line(user, "read its keys", refusal)
    logger.warning("inspect: engine %s skipped: %s", engine, exc)
    return f"engine {engine}: a key is not what the protocol writes ({exc}); skipped"


def splits_of(engines: list[Snapshot]) -> list[Any]:
    """The splits (``split.Split``) among engines as :func:`fleet_snapshot` lists them."""
    views = [
        View(
            e["engine_id"],
            bool((e["scheduler"] or {}).get("owner")),
            frozenset(r for r, info in e["ranks"].items() if info["heartbeat"]),
        )
        for e in engines
    ]
    return find_splits(views)


def problems(snap: Snapshot) -> list[str]:
    """What fails ``inspect --check`` of the fleet: conflicts and splits."""
    found: list[str] = [line for e in snap["engines"] for line in e["conflicts"]]
    found += snap["splits"]
    return found


def _scheduler(info: Snapshot | None) -> str:
    owner = (info or {}).get("owner")
    return f"{owner.get('host', '?')}/{owner.get('pid', '?')}" if owner else "-"


def _ranks(ranks: dict[int, Snapshot]) -> str:
    parts = []
    for rank, info in sorted(ranks.items()):
        owner = info["owner"]
        beat = "live" if info["heartbeat"] else "stale"
        who = f"{owner.get('host', '?')}/{owner.get('pid', '?')}" if owner else "-"
        parts.append(f"{rank}:{beat}:{who}")
    return " ".join(parts) or "-"


def render_fleet(snap: Snapshot, url: str) -> str:
    """The human-readable fleet report (every line through ``shown``)."""
    engines = snap["engines"]
    lines = [f"ENGINES ({len(engines)}) on {url}", ""]
    # Ids are never cut: an operator copies them into --engine-id.
    wide = max((len(e["engine_id"]) for e in engines), default=6) + 2
    schedulers = [_scheduler(e["scheduler"]) for e in engines]
    swide = max(map(len, schedulers), default=9) + 2
    lines.append(
        f"  {'engine':<{wide}}{'state':<7}{'keys':<6}{'in-flight':<11}{'expires':<10}"
        f"{'scheduler':<{swide}}ranks (rank:heartbeat:host/pid)"
    )
    for e, sched in zip(engines, schedulers, strict=True):
        ttl = e["expires_in_ms"]
        expires = "-" if e["live"] else ("never" if ttl == -1 else f"{ttl / 1000:.0f}s")
        lines.append(
            f"  {e['engine_id']:<{wide}}{'live' if e['live'] else 'stale':<7}{e['keys']:<6}"
            f"{e['inflight']:<11}{expires:<10}{sched:<{swide}}{_ranks(e['ranks'])}"
        )
    found = [line for e in engines for line in e["conflicts"]]
    lines += ["", f"CONFLICTS ({len(found)})"]
    lines += [f"  {line}" for line in found] or ["  none"]
    lines += ["", f"SPLITS ({len(snap['splits'])})"]
    lines += [f"  {line}" for line in snap["splits"]] or ["  none"]
    if snap.get("skipped"):
        lines += ["", f"SKIPPED ({len(snap['skipped'])} engines)"]
        lines += [f"  {line}" for line in snap["skipped"]]
    return "\n".join(shown(line) for line in lines)


def render_owners(roles: dict[str, Snapshot], lines: list[str]) -> None:
    """One engine's roles for ``inspect --engine-id``: the holder, and who waits."""
    lines += ["", "OWNERS"]
    for role, info in sorted(roles.items()):
        owner = info["owner"]
        held = (
            f"epoch {owner.get('epoch')} {owner.get('host')}/{owner.get('pid')}" if owner else "-"
        )
        waiting = info["waiting"]
        extra = f"  WAITING: {waiting.get('host')}/{waiting.get('pid')}" if waiting else ""
        name = "scheduler" if role == SCHEDULER_ROLE else f"rank {role}"
        lines.append(f"  {name:<11}{held}{extra}")


def run_fleet(
    client: redis.Redis,
    url: str,
    as_json: bool,
    check: bool,
    out: TextIO,
    user: str | None = None,
) -> int:
    """Print every engine on the server; with ``check``, 1 if any role has a conflict or
    any engine is split.

    Raises:
        redis.RedisError: Redis failed (the caller translates it).
    """
    snap = fleet_snapshot(client, int(time.time() * 1000), user)
    found = problems(snap)
    if as_json:
        snap["check"] = {"ok": not found, "reasons": found}
        snap["redis_url"] = url
        print(json.dumps(snap, default=str), file=out, flush=True)
    else:
        print(render_fleet(snap, url), file=out)
        if check:
            print("", "CHECK " + ("OK" if not found else "FAILED"), sep="\n", file=out)
    return 1 if check and found else 0
