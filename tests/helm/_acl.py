"""deploy/users.acl: the roles' expected command sets and a parser for the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Commands run inside the Lua scripts: ACL rules apply to them too. Scripts are loaded
#: with SCRIPT LOAD and run with EVALSHA only: EVAL is granted to nobody.
SCRIPT_COMMANDS = {
    "xadd",
    "hset",
    "hget",
    "hmget",
    "del",
    "pexpire",  # the lookup hash's TTL, and each stream's after its XADD
    "time",  # submit.lua and report.lua stamp on the server's clock (rank_insights)
    # claim.lua: each role's lease (GET, SET PX), its epoch counter (HINCRBY); report.lua
    # and progress.lua read the rank's lease (GET) to fence a report
    "get",
    "set",
    "hincrby",
}
#: The owner leases' script (claim.lua) on the owner and epoch keys.
OWNERSHIP = {"get", "set", "hincrby", "pexpire", "del"}
#: What every connection does: name itself, and PING (redis-py's health check, probes).
CONNECTION = {"client|setname", "ping"}
#: Beyond the scripts, what each role's code sends: the listener reads completions
#: (XREAD), where to start (XREVRANGE) and the ranks' heartbeats (MGET); progress.lua
#: checks with HEXISTS whether the rank reported; every process keeps its fingerprint
#: in a hash (HSET, HGETALL, HDEL of stale members); a rank reads its group's lag
#: (XINFO GROUPS) and keeps its heartbeat (SET, DEL).
SCHEDULER_EXTRA = {"evalsha", "script|load", "xread", "xrevrange", "mget", "hgetall", "hdel"}
WORKER_EXTRA = {
    *"evalsha script|load xgroup|create xreadgroup xack xinfo|groups set hexists".split(),
    *"hgetall hdel".split(),
    # The fleet query: a rank reads its engine's probe stream and RPUSHes its answers.
    *"xread rpush".split(),
}
#: redis-py >= 5 sends CLIENT SETINFO on every connect and ignores a refusal. The
#: command (and so an ACL rule naming it) exists only from Redis 7.2, and the file must
#: load on Redis 6.2+, so it is not granted; its refusals are expected in ACL LOG.
HANDSHAKE_NOT_GRANTED = "client|setinfo"
#: Per role, the commands its ACL user must be granted (lower case; subcommands as cmd|sub).
EXPECTED_COMMANDS = {
    "scheduler": SCRIPT_COMMANDS | OWNERSHIP | CONNECTION | SCHEDULER_EXTRA,
    "worker": SCRIPT_COMMANDS | OWNERSHIP | CONNECTION | WORKER_EXTRA,
    # A vLLM pod's processes host both and share one credential.
    "vllm": SCRIPT_COMMANDS | OWNERSHIP | CONNECTION | SCHEDULER_EXTRA | WORKER_EXTRA,
    # Read-only: broker-lookup inspect and the redis-cli commands of docs/deploy.md.
    "operator": CONNECTION
    | set("scan type get mget pttl ttl hget hgetall xlen xrange xrevrange xpending info".split())
    | {"xinfo"},  # every XINFO subcommand
    # Stops a runaway script; touches no key.
    "admin": CONNECTION | {"script|kill", "info"},
    # The fleet query and its reservations: lists engines (SCAN), reads their ranks
    # (HKEYS epochs, GET heartbeats), XADDs a probe (PEXPIRE its stream), BLPOPs answers.
    "router": CONNECTION | {"scan", "hkeys", "get", "xadd", "pexpire", "blpop"},
}
#: The engine the shipped file's users are scoped to (the chart's default engine.id).
SHIPPED_ENGINE = "vllm-engine"


@dataclass
class AclUser:
    name: str
    rules: list[str]

    @property
    def enabled(self) -> bool:
        states = [r for r in self.rules if r in ("on", "off")]
        return bool(states) and states[-1] == "on"

    @property
    def allowed(self) -> set[str]:
        return {r[1:].lower() for r in self.rules if r.startswith("+") and not r.startswith("+@")}

    @property
    def key_patterns(self) -> list[str]:
        return [r for r in self.rules if r.startswith(("~", "%"))]

    @property
    def passwords(self) -> list[str]:
        return [r for r in self.rules if r.startswith((">", "#"))]


def parse_acl(path: Path) -> dict[str, AclUser]:
    users: dict[str, AclUser] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        words = line.split()
        # The server rejects anything else, comments included.
        assert words[0] == "user" and len(words) >= 2, f"users.acl:{number}: {line!r}"
        assert words[1] not in users, f"users.acl:{number}: duplicate user {words[1]}"
        users[words[1]] = AclUser(words[1], words[2:])
    return users
