"""``python -m benchmarks.bench --redis-cost``: where Redis's CPU goes, per lookup.

Per world size, with the one-in-flight loop and then the throughput loop (``window`` in
flight), with no statistic reset (deltas; the slow log's settings are restored after):

* ``INFO commandstats`` deltas per lookup: calls and µs of each command. A command a
  script calls counts under its own name too, and within the ``EVALSHA`` that ran it.
  The µs are the server's wall clock per command: on a loaded box they run above
  ``used_cpu``; the calls are exact.
* per script: its share of the ``EVALSHA`` µs, from ``SLOWLOG`` at 0 µs (every command
  logged with its duration and its script's SHA1; the log keeps the last
  :data:`SLOWLOG_LEN` commands, so a long run is sampled at its end);
* round trips per lookup, all sides together: the server's read events (one per
  pipelined batch it reads; ``total_reads_processed``), and the commands sent plainly;
* ``used_cpu`` per lookup, the server's whole cost, and the floor: the simple operations a
  lookup needs at world W (:func:`floor_ops`) at 1 µs each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from benchmarks.bench.measure import BenchOptions, Prompts, closed_loop, sequential_latency
from benchmarks.bench.ours import client_for, engine_id, rank_host
from broker_lookup.protocol.scripts import ScriptSource

__all__ = ["SLOWLOG_LEN", "floor_ops", "redis_cost", "render_redis_cost"]

#: Commands the slow log keeps: the per-script split of a long run is its last ones.
SLOWLOG_LEN = 200_000


def floor_ops(world: int) -> int:
    """The simple commands one lookup needs at ``world`` ranks, none in a script: the submit
    (HSET, PEXPIRE, XADD), per rank its read, its report (HSET) and its XACK, then the
    answer (XADD on the done stream) and the caller's read of it."""
    return 3 + 3 * world + 1


class _Window:
    """The server's counters from construction to :meth:`per_lookup`, as deltas: nothing
    is reset, so a shared server's statistics stay whole; its slow-log settings are
    restored at the end."""

    def __init__(self, server: redis.Redis) -> None:
        self._server = server
        got: Any = server.config_get("slowlog-*")
        self._slowlog = {k: got[k] for k in ("slowlog-log-slower-than", "slowlog-max-len")}
        server.config_set("slowlog-max-len", SLOWLOG_LEN)
        last: Any = server.execute_command("SLOWLOG", "GET", 1)  # type: ignore[no-untyped-call]
        self._after_id = int(last[0][0]) if last else -1
        server.config_set("slowlog-log-slower-than", 0)
        self._start = self._counters()
        self._stats = _commandstats(server)

    def _counters(self) -> dict[str, float]:
        info: Any = self._server.info("all")
        return {
            "cpu": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "reads": float(info.get("total_reads_processed", 0)),
        }

    def per_lookup(self, lookups: int, sha_names: dict[str, str]) -> dict[str, Any]:
        """Everything per lookup since construction (``lookups``: how many ran)."""
        now = self._counters()
        stats = _commandstats(self._server)
        self._server.config_set("slowlog-log-slower-than", self._slowlog["slowlog-log-slower-than"])
        slow: Any = self._server.execute_command(  # type: ignore[no-untyped-call]
            "SLOWLOG", "GET", SLOWLOG_LEN
        )
        self._server.config_set("slowlog-max-len", self._slowlog["slowlog-max-len"])
        n = max(1, lookups)
        commands = {}
        for name, (calls, usec) in stats.items():
            calls0, usec0 = self._stats.get(name, (0, 0))
            if calls > calls0 and not name.startswith(("config", "slowlog", "info")):
                commands[name] = {
                    "calls": round((calls - calls0) / n, 2),
                    "us": round((usec - usec0) / n, 2),
                }
        evalsha_us = commands.get("evalsha", {}).get("us", 0.0)
        fresh = [e for e in slow if int(e[0]) > self._after_id]
        return {
            "lookups": lookups,
            "redis_cpu_us": round((now["cpu"] - self._start["cpu"]) * 1e6 / n, 1),
            "commands": dict(sorted(commands.items(), key=lambda kv: -kv[1]["us"])),
            "scripts": _script_split(fresh, sha_names, evalsha_us),
            "round_trips": round((now["reads"] - self._start["reads"]) / n, 2),
        }


def _commandstats(server: redis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and µs so far per command (``INFO commandstats``)."""
    info: Any = server.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in info.items()
    }


def _script_split(
    entries: Iterable[Any], sha_names: dict[str, str], evalsha_us: float
) -> dict[str, dict[str, float]]:
    """The ``EVALSHA`` µs per lookup split by script in the slow log's proportions, and each
    script's median µs per call."""
    durations: dict[str, list[int]] = {}
    for entry in entries:
        args = entry[3]
        if len(args) > 1 and args[0].upper() == b"EVALSHA":
            name = sha_names.get(args[1].decode(), "?")
            durations.setdefault(name, []).append(int(entry[2]))
    total = sum(sum(d) for d in durations.values()) or 1
    return {
        name: {
            "us_per_lookup": round(evalsha_us * sum(d) / total, 1),
            "calls_share": round(len(d) / sum(len(x) for x in durations.values()), 3),
            "median_us": float(sorted(d)[len(d) // 2]),
        }
        for name, d in sorted(durations.items())
    }


def redis_cost(opts: BenchOptions, url: str, run_id: str) -> dict[str, Any]:
    """Per world of ``opts.worlds``: one in flight, then ``opts.window`` in flight."""
    sha_names = {sha: name for name, sha in ScriptSource().sha.items()}
    engines = {engine_id(run_id, f"rc{w}"): w for w in opts.worlds}
    out: dict[str, Any] = {}
    server = redis.Redis.from_url(url)
    try:
        with rank_host(opts, url, engines):
            for w in opts.worlds:
                out[str(w)] = _world(opts, server, url, engine_id(run_id, f"rc{w}"), w, sha_names)
    finally:
        server.close()
    return out


def _world(
    opts: BenchOptions,
    server: redis.Redis,
    url: str,
    eid: str,
    world: int,
    sha_names: dict[str, str],
) -> dict[str, Any]:
    prompts = Prompts(opts.tokens)
    client = client_for(url, eid, world)
    try:
        one = _measured(
            server,
            sha_names,
            lambda: opts.lookups + opts.warmup,
            lambda: sequential_latency(
                client, prompts, opts.lookups, opts.warmup, opts.poll_s, "rc1"
            ),
        )
        many = _measured(
            server,
            sha_names,
            None,
            lambda: closed_loop(client, prompts, opts.window, opts.duration_s, opts.poll_s, "rcw"),
        )
    finally:
        client.close()
    return {"one_in_flight": one, "in_flight": many, "floor_ops": floor_ops(world)}


def _measured(
    server: redis.Redis,
    sha_names: dict[str, str],
    count: Callable[[], int] | None,
    loop: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """``loop``'s figures per lookup; ``count``: how many lookups it ran (None: its
    ``completed``, with its rate)."""
    window = _Window(server)
    run = loop()
    lookups = count() if count is not None else int(run["completed"])
    time.sleep(0.05)  # the last answers' reports are in
    got = window.per_lookup(lookups, sha_names)
    if count is None:
        got["lookups_per_s"] = run.get("lookups_per_s")
    return got


def render_redis_cost(results: dict[str, Any]) -> str:
    """The per-world table of Redis's cost per lookup, by command and by script."""
    lines = []
    for world, phases in results.items():
        floor = phases["floor_ops"]
        for phase in ("one_in_flight", "in_flight"):
            r = phases[phase]
            rate = f", {r['lookups_per_s']:.0f} lookups/s" if r.get("lookups_per_s") else ""
            lines.append(
                f"world {world}, {phase.replace('_', ' ')}{rate}: Redis CPU "
                f"{r['redis_cpu_us']} µs/lookup (floor {floor} ops = {floor} µs); round trips "
                f"(server reads) per lookup {r['round_trips']}"
            )
            lines.append("  command            calls/lookup   µs/lookup")
            for name, c in r["commands"].items():
                lines.append(f"  {name:<18} {c['calls']:>12} {c['us']:>11}")
            lines.append("  script             µs/lookup   calls share   median µs/call")
            for name, s in r["scripts"].items():
                lines.append(
                    f"  {name:<18} {s['us_per_lookup']:>9} {s['calls_share']:>13}"
                    f" {s['median_us']:>16}"
                )
    return "\n".join(lines)
