"""The server configs and ACL users we ship, loaded into a real valkey-server.

* the chart's Redis container command + ConfigMap, run as rendered;
* deploy/valkey.conf with deploy/users.acl: every role can run exactly its
  commands on its engine's keys, ``bl:{vllm-engine}:*`` and its vLLM instances'
  ``bl:{vllm-engine@<instance>}:*`` (``ACL DRYRUN``), and nothing else: no other
  engine's keys, so one engine's credential cannot forge another's hits.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker_lookup.processes import free_port

from ._acl import EXPECTED_COMMANDS, HANDSHAKE_NOT_GRANTED, SHIPPED_ENGINE, parse_acl
from ._chart import DEPLOY, RenderFn, container
from ._server import client, command, running_server, server_binary

pytestmark = [pytest.mark.helm, pytest.mark.real]

K = f"bl:{{{SHIPPED_ENGINE}@3f2a1}}"  # a vLLM instance of the shipped engine
#: Another engine's keys: no role of the shipped engine may touch them.
OTHER = "bl:{other-engine}"
#: One valid invocation per command; keys sit under the shipped engine so key rules pass.
EXAMPLES: dict[str, list[str]] = {
    "evalsha": ["EVALSHA", "0" * 40, "1", f"{K}:lookup:1"],
    "eval": ["EVAL", "return 1", "1", f"{K}:lookup:1"],
    "script|load": ["SCRIPT", "LOAD", "return 1"],
    "xread": ["XREAD", "COUNT", "1", "STREAMS", f"{K}:done", "0"],
    "rpush": ["RPUSH", f"{K}:probe:q1", "answer"],
    "xadd": ["XADD", f"{K}:requests", "*", "f", "v"],
    "xtrim": ["XTRIM", f"{K}:requests", "MAXLEN", "~", "1000"],
    "hmget": ["HMGET", f"{K}:lookup:1", "state", "result"],
    "hgetall": ["HGETALL", f"{K}:lookup:1"],
    "hget": ["HGET", f"{K}:lookup:1", "state"],
    "hset": ["HSET", f"{K}:fp", "pid", "x"],
    "hsetnx": ["HSETNX", f"{K}:lookup:1", "r0", "16"],
    "hexists": ["HEXISTS", f"{K}:lookup:1", "r0"],
    "hincrby": ["HINCRBY", f"{K}:epochs", "0", "1"],
    "get": ["GET", f"{K}:hb:0"],
    "set": ["SET", f"{K}:hb:0", "{}", "PX", "3000"],
    "mget": ["MGET", f"{K}:hb:0", f"{K}:hb:1"],
    "del": ["DEL", f"{K}:lookup:1"],
    "exists": ["EXISTS", f"{K}:lookup:1"],
    "pttl": ["PTTL", f"{K}:lookup:1"],
    "ttl": ["TTL", f"{K}:lookup:1"],
    "expire": ["EXPIRE", f"{K}:fp", "60"],
    "pexpire": ["PEXPIRE", f"{K}:lookup:1", "3000"],
    "scan": ["SCAN", "0", "MATCH", f"{K}:lookup:*"],
    "ping": ["PING"],
    "info": ["INFO", "server"],
    "time": ["TIME"],
    "type": ["TYPE", f"{K}:requests"],
    "client|setname": ["CLIENT", "SETNAME", "bl-worker-0"],
    "client|setinfo": ["CLIENT", "SETINFO", "LIB-NAME", "redis-py"],
    "xinfo": ["XINFO", "STREAM", f"{K}:requests"],
    "xinfo|groups": ["XINFO", "GROUPS", f"{K}:requests"],
    "hdel": ["HDEL", f"{K}:fp", "rank0:gone:1"],
    "script|kill": ["SCRIPT", "KILL"],
    "xlen": ["XLEN", f"{K}:requests"],
    "xrange": ["XRANGE", f"{K}:dead", "-", "+", "COUNT", "10"],
    "xrevrange": ["XREVRANGE", f"{K}:dead", "+", "-", "COUNT", "10"],
    "xpending": ["XPENDING", f"{K}:requests", "rank-0"],
    "xgroup|create": ["XGROUP", "CREATE", f"{K}:requests", "rank-0", "$", "MKSTREAM"],
    "xreadgroup": [*"XREADGROUP GROUP rank-0 c0 COUNT 1 STREAMS".split(), f"{K}:requests", ">"],
    "xack": ["XACK", f"{K}:requests", "rank-0", "0-1"],
    "hkeys": ["HKEYS", f"{K}:epochs"],
    "blpop": ["BLPOP", f"{K}:probe:q1", "0.01"],
}
#: The router reaches an engine's probe stream, answers, epochs and heartbeats alone.
ROUTER_EXAMPLES = {
    **EXAMPLES,
    "xadd": ["XADD", f"{K}:probes", "*", "f", "v"],
    "pexpire": ["PEXPIRE", f"{K}:probes", "60000"],
}
#: What a router must not do: write a lookup hash or the request stream (forge a hit or
#: a lookup), report (EVALSHA), or touch a lease, heartbeat or another engine's probes.
ROUTER_FORBIDDEN = [
    ["HSET", f"{K}:lookup:1", "r0", "999"],
    ["XADD", f"{K}:requests", "*", "f", "v"],
    ["XADD", f"{K}:done", "*", "id", "x", "gen", "1", "result", "999"],
    ["EVALSHA", "0" * 40, "2", f"{K}:lookup:1", f"{K}:done"],
    ["SET", f"{K}:hb:0", "{}"],
    ["DEL", f"{K}:hb:0"],
    ["GET", f"{K}:owner:scheduler"],
    ["PEXPIRE", f"{K}:lookup:1", "1"],
    ["XADD", f"{OTHER}:probes", "*", "f", "v"],
    ["GET", f"{OTHER}:hb:0"],
]
#: Things no role may do.
FORBIDDEN = [
    ["FLUSHALL"],
    ["FLUSHDB"],
    ["KEYS", "*"],
    ["CONFIG", "GET", "*"],
    ["ACL", "LIST"],
    ["DEBUG", "SLEEP", "0"],
    ["SHUTDOWN"],
    ["GET", "not-ours"],
    ["XADD", "other:stream", "*", "f", "v"],
    ["SUBSCRIBE", "bl:ch"],
    ["XGROUP", "DESTROY", f"{K}:requests", "rank-0"],
    ["XADD", f"{OTHER}:done", "*", "id", "x", "gen", "1", "result", "999"],
    ["EVALSHA", "0" * 40, "2", f"{OTHER}:lookup:1", f"{OTHER}:done"],
    ["SET", f"{OTHER}:hb:0", "{}"],
    ["HSET", "bl:{vllm-engine-2}:lookup:1", "r0", "999"],  # a look-alike engine id
    # An engine whose configured id starts with the shipped one's and a dot, and its
    # instance: ``vllm-engine.*`` matched both before ``@`` joined instances.
    ["HSET", "bl:{vllm-engine.1-8b}:lookup:1", "r0", "999"],
    ["HSET", "bl:{vllm-engine.1-8b@3f2a1}:lookup:1", "r0", "999"],
]
PASSWORDS = {
    "scheduler": "changeme-scheduler-password",
    "worker": "changeme-worker-password",
    "vllm": "changeme-vllm-password",
    "operator": "changeme-operator-password",
    "admin": "changeme-admin-password",
    "router": "changeme-router-password",
}


def test_examples_cover_every_granted_command() -> None:
    granted = set().union(*EXPECTED_COMMANDS.values())
    assert granted <= set(EXAMPLES)


#: The test's own all-powerful user, which runs ``ACL DRYRUN`` for the roles.
ROOT = "test-root"
ADMIN_PASSWORD = "test-admin-password"


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """deploy/valkey.conf with its aclfile line enabled; yields the port.

    The ACL file is the shipped one plus a test-only user ``ROOT`` (appended to a
    temporary copy) that runs ``ACL DRYRUN`` on behalf of the roles.
    """
    tmp = tmp_path_factory.mktemp("acl")
    acl = (DEPLOY / "users.acl").read_text().rstrip("\n")
    acl += f"\nuser {ROOT} on >{ADMIN_PASSWORD} ~* &* +@all\n"
    (tmp / "users.acl").write_text(acl)
    text = (DEPLOY / "valkey.conf").read_text()
    example = "# aclfile /etc/valkey/users.acl"
    assert example in text
    text = text.replace(example, f"aclfile {tmp / 'users.acl'}")
    assert "\ndir /data\n" in text
    (tmp / "valkey.conf").write_text(text.replace("\ndir /data\n", f"\ndir {tmp}\n"))
    port = free_port()
    argv = [server_binary(), str(tmp / "valkey.conf"), "--port", str(port)]
    with running_server(argv, port, tmp / "server.log"):
        yield port


@pytest.fixture(scope="module")
def admin(acl_server: int) -> Iterator[redis.Redis]:
    conn = client(acl_server, username=ROOT, password=ADMIN_PASSWORD, decode_responses=True)
    yield conn
    conn.close()


def dryrun(admin: redis.Redis, user: str, argv: list[str]) -> str:
    """'OK' when ``user`` may run ``argv``, else the server's reason."""
    try:
        return str(command(admin, "ACL", "DRYRUN", user, *argv))
    except redis.ResponseError as exc:  # older servers reply with an error
        return str(exc)


def acl_denials(admin: redis.Redis) -> list[str]:
    """ACL LOG entries, except the refused CLIENT SETINFO of redis-py's handshake."""
    out: list[str] = []
    for entry in command(admin, "ACL", "LOG"):
        if isinstance(entry, list):
            entry = dict(zip(entry[::2], entry[1::2], strict=True))
        if entry.get("object") == HANDSHAKE_NOT_GRANTED:
            continue
        out.append(f"{entry.get('username')}: {entry.get('reason')} {entry.get('object')}")
    return out


def test_shipped_acl_loads_as_is(acl_server: int, admin: redis.Redis) -> None:
    users = set(command(admin, "ACL", "USERS"))
    assert users == set(parse_acl(DEPLOY / "users.acl")) | {ROOT}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert admin.config_get("appendonly") == {"appendonly": "no"}
    assert admin.config_get("save") == {"save": ""}


def test_default_user_cannot_connect(acl_server: int) -> None:
    for protocol in (2, 3):
        with pytest.raises(redis.AuthenticationError):
            client(acl_server, protocol=protocol).ping()


@pytest.mark.parametrize("role", sorted(PASSWORDS))
def test_role_connects_with_redis_py(acl_server: int, admin: redis.Redis, role: str) -> None:
    command(admin, "ACL", "LOG", "RESET")
    for protocol in (2, 3):
        conn = client(
            acl_server,
            username=role,
            password=PASSWORDS[role],
            protocol=protocol,
            client_name=f"bl-{role}",
        )
        assert conn.ping() is True
        conn.close()
    # The handshake (HELLO, AUTH, CLIENT SETNAME) was refused nowhere.
    assert acl_denials(admin) == []


@pytest.mark.parametrize("role", sorted(PASSWORDS))
def test_role_may_run_its_commands(admin: redis.Redis, role: str) -> None:
    examples = ROUTER_EXAMPLES if role == "router" else EXAMPLES
    refused = {
        name: reason
        for name in sorted(EXPECTED_COMMANDS[role])
        if (reason := dryrun(admin, role, examples[name])) != "OK"
    }
    assert refused == {}


def test_router_cannot_report_or_write_a_lookup(admin: redis.Redis) -> None:
    allowed = [argv for argv in ROUTER_FORBIDDEN if dryrun(admin, "router", argv) == "OK"]
    assert allowed == []


@pytest.mark.parametrize("role", sorted(PASSWORDS))
def test_role_may_run_nothing_else(admin: redis.Redis, role: str) -> None:
    granted = EXPECTED_COMMANDS[role]
    # A subcommand of a command granted whole (the operator's XINFO GROUPS) is granted too.
    others = [
        EXAMPLES[n] for n in sorted(set(EXAMPLES) - granted) if n.split("|")[0] not in granted
    ]
    allowed = [argv for argv in [*FORBIDDEN, *others] if dryrun(admin, role, argv) == "OK"]
    assert allowed == []


def test_operator_commands_write_nothing(admin: redis.Redis) -> None:
    """The server's own command flags: no operator command may write (CLIENT is a no-op on data)."""
    for name in sorted(EXPECTED_COMMANDS["operator"]):
        if name.startswith("client|"):
            continue
        (info,) = command(admin, "COMMAND", "INFO", name)
        flags = set(info[2])
        assert "write" not in flags, name


def test_scripts_cannot_escape_the_acl(acl_server: int, admin: redis.Redis) -> None:
    worker = client(acl_server, username="worker", password=PASSWORDS["worker"])

    def run(script: str, *keys: str) -> object:
        return worker.evalsha(worker.script_load(script), len(keys), *keys)

    assert run("return redis.call('HSET', KEYS[1], 'r0', 5)", f"{K}:lookup:9") == 1
    with pytest.raises(redis.ResponseError):
        run("return redis.call('FLUSHALL')")
    assert admin.exists(f"{K}:lookup:9") == 1
    for outside in ("outside", f"{OTHER}:lookup:9"):  # another engine's hits: never forged
        with pytest.raises(redis.ResponseError):
            run("return redis.call('HSET', KEYS[1], 'r0', 5)", outside)
        assert admin.exists(outside) == 0
    with pytest.raises(redis.ResponseError):
        worker.eval("return 1", 0)  # scripts run by EVALSHA only


def test_admin_kills_a_runaway_script(acl_server: int, admin: redis.Redis) -> None:
    """A script stuck in a loop blocks the whole server; ``admin`` can stop it, and do
    nothing else to the data."""
    command(admin, "CONFIG", "SET", "busy-reply-threshold", "100")
    scheduler = client(acl_server, username="scheduler", password=PASSWORDS["scheduler"])
    sha = scheduler.script_load("while true do end")
    killed: list[str] = []

    def run_it() -> None:
        try:
            scheduler.evalsha(sha, 0)
        except redis.ResponseError as exc:
            killed.append(str(exc))

    stuck = threading.Thread(target=run_it, daemon=True)
    stuck.start()
    operator = client(acl_server, username="admin", password=PASSWORDS["admin"])
    deadline = time.monotonic() + 30
    while True:
        try:
            assert operator.script_kill() is True
            break
        except redis.ResponseError as exc:  # "NOTBUSY": the loop has not started yet
            assert "NOTBUSY" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.05)
    stuck.join(10)
    assert not stuck.is_alive() and admin.ping()
    assert killed and "kill" in killed[0].lower()
    assert dryrun(admin, "admin", ["GET", f"{K}:hb:0"]) != "OK"


# ------------------------------------------------------- the chart's Redis --


def test_chart_redis_runs_as_rendered(render: RenderFn, tmp_path: Path) -> None:
    """The Redis container's command and ConfigMap, run locally as rendered (one password;
    the ACL users' server is tests/helm/test_chart_acl.py's)."""
    rendered = render("redis.maxmemory=64mb", "auth.acl.enabled=false")
    sts = rendered.get("StatefulSet", "-redis")
    redis_container = container(sts, "redis")
    # Each volume mount becomes a local directory; paths in the config and the
    # command line are rewritten to match.
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in redis_container["volumeMounts"]}
    for local in mounts.values():
        local.mkdir()

    def localize(text: str) -> str:
        """Rewrite every whitespace-separated token that is a mounted path."""
        out: list[str] = []
        for token in re.split(r"(\s+)", text):
            for mount_path, local in mounts.items():
                if token == mount_path or token.startswith(mount_path + "/"):
                    token = str(local) + token[len(mount_path) :]
                    break
            out.append(token)
        return "".join(out)

    conf = rendered.get("ConfigMap", "-redis")["data"]["valkey.conf"]
    (mounts["/etc/valkey"] / "valkey.conf").write_text(localize(conf))
    password = base64.b64decode(
        rendered.get("Secret", "-redis-auth")["data"]["redis-password"]
    ).decode()
    argv = [localize(a).replace("$(REDIS_PASSWORD)", password) for a in redis_container["command"]]
    assert argv[0] == "valkey-server"
    port = free_port()
    argv = [server_binary(), *argv[1:], "--port", str(port)]
    with running_server(argv, port, tmp_path / "server.log"):
        with pytest.raises(redis.AuthenticationError):
            client(port).ping()
        conn = client(port, password=password, decode_responses=True)
        assert conn.ping() is True
        assert conn.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert conn.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
        assert conn.config_get("appendonly") == {"appendonly": "no"}
        assert conn.config_get("save") == {"save": ""}
        assert conn.config_get("protected-mode") == {"protected-mode": "yes"}


def test_chart_redis_persistence_config_runs(render: RenderFn, tmp_path: Path) -> None:
    conf = render("redis.persistence.enabled=true", "auth.acl.enabled=false")
    conf = conf.get("ConfigMap", "-redis")["data"]
    text = conf["valkey.conf"].replace("\ndir /data\n", f"\ndir {tmp_path}\n")
    (tmp_path / "valkey.conf").write_text(text)
    port = free_port()
    argv = [server_binary(), str(tmp_path / "valkey.conf"), "--port", str(port)]
    with running_server(argv, port, tmp_path / "server.log"):
        conn = client(port, decode_responses=True)
        assert conn.config_get("appendonly") == {"appendonly": "yes"}
        assert conn.config_get("appendfsync") == {"appendfsync": "everysec"}


# --------------------------------------- the protocol under the shipped users --


@pytest.mark.slow
def test_protocol_runs_under_least_privilege_users(
    acl_server: int, admin: redis.Redis, tmp_path: Path
) -> None:
    """Worker as `worker`, client as `scheduler`, inspect as `operator`: no ACL denial."""
    from broker_lookup import LookupConfig, LookupMetadata, RedisAsyncLookupClient
    from broker_lookup.protocol.keys import KeySpace, instance_engine_id

    engine = instance_engine_id(SHIPPED_ENGINE, "acl5e")  # as a vLLM instance names it
    keys = KeySpace(engine)
    command(admin, "ACL", "LOG", "RESET")

    def url(role: str) -> str:
        return f"redis://{role}@127.0.0.1:{acl_server}/0"

    metrics_port = free_port()
    worker_env = {
        **os.environ,
        "BROKER_LOOKUP_REDIS_URL": url("worker"),
        "BROKER_LOOKUP_REDIS_PASSWORD": PASSWORDS["worker"],
        "BROKER_LOOKUP_ENGINE_ID": engine,
        "BROKER_LOOKUP_WORLD_SIZE": "1",
        "BROKER_LOOKUP_RANK": "0",
        "BROKER_LOOKUP_METRICS_PORT": str(metrics_port),
    }
    log = tmp_path / "referenceWorkers.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "workers"], env=worker_env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while not admin.exists(keys.heartbeat(0)):
            assert worker.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "no heartbeat:\n" + log.read_text(errors="replace")
            time.sleep(0.1)

        config = LookupConfig(
            redis_url=url("scheduler"),
            redis_password=PASSWORDS["scheduler"],
            lookup_timeout_ms=10_000,
        )
        client = RedisAsyncLookupClient(config, LookupMetadata(engine_id=engine, world_size=1))
        try:
            started = time.monotonic()
            client.lookup(list(range(1024)), "acl-1")
            while (result := client.lookup_cache("acl-1")) is None:
                assert time.monotonic() - started < 5, "no answer well before the timeout"
                time.sleep(0.01)
            assert result == 0  # nothing stored: a real miss, answered by the rank
            client.lookup(list(range(2048)), "acl-2")
            client.cancel_lookup("acl-2")
        finally:
            client.close()

        argv = [str(Path(sys.executable).parent / "broker-lookup"), "inspect", "--check"]
        argv += ["--redis-url", url("operator"), "--engine-id", engine, "--world-size", "1"]
        inspect = subprocess.run(
            argv,
            env={**os.environ, "BROKER_LOOKUP_REDIS_PASSWORD": PASSWORDS["operator"]},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert inspect.returncode == 0, inspect.stdout + inspect.stderr

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=10) == 0, log.read_text(errors="replace")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=5)
    assert acl_denials(admin) == []
