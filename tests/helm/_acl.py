"""deploy/users.acl: the roles' expected command sets and a parser for the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Commands run inside the Lua scripts: ACL rules apply to them too.
SCRIPT_COMMANDS = {
    "xadd",
    "hset",
    "hget",
    "hmget",
    "hgetall",
    "del",
    "pexpire",
    "exists",
    "time",  # submit.lua and report.lua stamp on the server's clock (rank_insights)
    # claim.lua: each role's lease (GET, SET PX), its epoch counter (HINCRBY); report.lua
    # and progress.lua read the rank's lease (GET) to fence a report
    "get",
    "set",
    "hincrby",
}
#: Beyond the protocol's published lists, what the code calls (found by the end-to-end
#: test in test_server_configs.py): the listener reads its start position with XREVRANGE,
#: report.lua records a rank's count once with HSETNX (and, like progress.lua, checks
#: with HEXISTS whether the rank reported), and `broker-lookup inspect` names its
#: connection (CLIENT SETNAME touches no data).
SCHEDULER_EXTRA = {"xrevrange"}
WORKER_EXTRA = {"hsetnx", "hexists"}
OPERATOR_EXTRA = {"client|setname"}
#: redis-py >= 5 sends CLIENT SETINFO on every connect and ignores a refusal. The
#: command (and so an ACL rule naming it) exists only from Redis 7.2, and the file must
#: load on Redis 6.2+, so it is not granted; its refusals are expected in ACL LOG.
HANDSHAKE_NOT_GRANTED = "client|setinfo"
#: Per role, the commands its ACL user must be granted (lower case; subcommands as cmd|sub).
EXPECTED_COMMANDS = {
    "scheduler": set(
        """evalsha eval script|load xread xadd xtrim hmget hgetall get pttl mget scan ping
        hset expire pexpire client|setname info xinfo""".split()
    )
    | SCRIPT_COMMANDS
    | SCHEDULER_EXTRA,
    "worker": set(
        """xgroup|create xreadgroup xack xadd xpending xinfo evalsha eval script|load set del
        get hset pexpire ping client|setname info time""".split()
    )
    | SCRIPT_COMMANDS
    | WORKER_EXTRA,
    "operator": set(
        """scan hgetall hget get pttl ttl xinfo xlen xrange xrevrange xpending ping info
        type""".split()
    )
    | OPERATOR_EXTRA,
}


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
