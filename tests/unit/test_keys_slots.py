"""Redis Cluster safety of the key scheme and of the Lua scripts, checked without a server.

1. Every key :class:`KeySpace` can produce for an engine hashes to one slot, the slot of
   the engine id itself (the ``{engine_id}`` hash tag), for several engine ids.
2. Every ``redis.call``/``redis.pcall`` in ``broker_lookup/protocol/lua/*.lua`` names a
   literal command and takes its key from ``KEYS[n]``, so no script can touch a key its
   caller did not declare (the dynamic half runs the scripts on a real cluster:
   ``tests/cluster/test_cluster_scripts.py``).
"""

from __future__ import annotations

import inspect
import re
from importlib import resources

import pytest
from redis.crc import key_slot

from broker_lookup.protocol.keys import PREFIX, KeySpace

ENGINE_IDS = ["vllm-0", "e", "engine.with.dots", "a:b:c", "x_" * 40, "Z9-" * 40, "0"]

#: Sample arguments by parameter annotation, to call every key-producing method.
_SAMPLES: dict[str, list[object]] = {
    "str": ["req-1", "", "{braces}", "with:colons", "ü-unicode", "x" * 256],
    "int": [0, 1, 7, 1023],
}


def _all_keys(ks: KeySpace) -> list[str]:
    """Every key string the key module produces for ``ks``, found by introspection.

    Attributes and methods (one-argument ones called with samples) whose value starts
    with the ``bl:`` prefix are keys; group, consumer and field names are not.
    """
    keys: list[str] = []
    for name in dir(KeySpace):
        if name.startswith("_") or name.endswith("pattern"):
            continue  # SCAN patterns are no keys
        value = getattr(ks, name)
        if isinstance(value, str):
            keys.append(value)
        elif callable(value):
            params = list(inspect.signature(value).parameters.values())
            if len(params) == 1 and str(params[0].annotation) in _SAMPLES:
                keys.extend(str(value(s)) for s in _SAMPLES[str(params[0].annotation)])
    return [k for k in keys if k.startswith(f"{PREFIX}:")]


@pytest.mark.parametrize("engine_id", ENGINE_IDS)
def test_every_key_of_an_engine_is_in_the_slot_of_its_engine_id(engine_id: str) -> None:
    ks = KeySpace(engine_id)
    keys = _all_keys(ks)
    # The introspection found every kind of key, so a new kind is checked too.
    for kind in (
        ks.requests,
        ks.done,
        ks.dead,
        ks.fingerprint,
        ks.lookup("req-1"),
        ks.heartbeat(0),
    ):
        assert kind in keys
    slots = {k: key_slot(k.encode()) for k in keys}
    assert set(slots.values()) == {key_slot(engine_id.encode())}, slots


def test_engine_ids_spread_over_slots() -> None:
    """Different engines usually land in different slots (so a cluster can spread them)."""
    slots = {key_slot(KeySpace(f"engine-{i}").requests.encode()) for i in range(64)}
    assert len(slots) > 48


# -- static check of the Lua scripts --------------------------------------------------

_CALL = re.compile(r"redis\.p?call\s*\(")
_LITERAL_CMD = re.compile(r"""\s*(['"])([A-Za-z]+)\1\s*(,|\))""")
#: ``KEYS[2]``, or ``KEYS[k]`` with a variable index (a batch's n-th key): a declared key.
_KEY_ARG = re.compile(r"\s*KEYS\[(\d+|[A-Za-z_]\w*)\]\s*[,)]")
#: Commands whose every argument is a key.
_ALL_KEYS = {"DEL", "UNLINK", "EXISTS", "TOUCH", "MGET"}
#: ``redis.*`` functions that are no commands and touch no key.
_SAFE_API = {"status_reply", "error_reply", "log", "sha1hex", "setresp", "set_repl"}


def violations(source: str) -> list[str]:
    """What in ``source`` could touch a key not passed in ``KEYS`` (empty: nothing)."""
    problems = []
    for m in re.finditer(r"redis\.(\w+)(\s*\()?", source):
        if m.group(1) not in {"call", "pcall", *_SAFE_API} or not m.group(2):
            problems.append(f"redis.{m.group(1)} used other than as a call")
    for m in _CALL.finditer(source):
        rest = source[m.end() :]
        cmd = _LITERAL_CMD.match(rest)
        line = source[: m.start()].count("\n") + 1
        if cmd is None:
            problems.append(f"line {line}: command is not a string literal")
            continue
        if cmd.group(3) == ")":
            continue  # keyless command, e.g. redis.call('TIME')
        args = rest[cmd.end() :]
        keys = args.split(")")[0].count(",") + 1 if cmd.group(2).upper() in _ALL_KEYS else 1
        for _ in range(keys):
            key = _KEY_ARG.match(args)
            if key is None:
                problems.append(f"line {line}: {cmd.group(2)}'s key is not KEYS[n]: {args[:40]!r}")
                break
            args = args[key.end() :]
    return problems


def _scripts() -> dict[str, str]:
    base = resources.files("broker_lookup.protocol") / "lua"
    return {p.name: p.read_text() for p in base.iterdir() if p.name.endswith(".lua")}


def test_the_protocol_has_scripts_to_check() -> None:
    assert {"submit.lua", "report.lua", "cancel.lua"} <= set(_scripts())


@pytest.mark.parametrize("name", sorted(_scripts()))
def test_every_redis_call_takes_its_key_from_KEYS(name: str) -> None:
    source = _scripts()[name]
    assert _CALL.search(source), f"{name} calls no command?"
    assert violations(source) == []


@pytest.mark.parametrize(
    "bad",
    [
        "redis.call('GET', 'bl:{e}:x')",
        "redis.call('HSET', 'bl:{' .. ARGV[1] .. '}:x', 'f', 1)",
        "redis.call('XADD', ARGV[1], '*', 'a', 1)",
        "local k = KEYS[1] .. ':x'\nredis.call('DEL', k)",
        "redis.call('DEL', KEYS[1], ARGV[2])",
        "local cmd = 'DEL'\nredis.call(cmd, KEYS[1])",
        "local c = redis.call\nc('DEL', 'x')",
    ],
)
def test_the_static_check_catches_keys_outside_KEYS(bad: str) -> None:
    assert violations(bad), bad


@pytest.mark.parametrize(
    "good",
    [
        "redis.call('TIME')",
        "redis.pcall('DEL', KEYS[1], KEYS[2])",
        'redis.call("XLEN", KEYS[3])',
        "redis.call('HGET', KEYS[k], 'f')",
    ],
)
def test_the_static_check_accepts_keys_from_KEYS(good: str) -> None:
    assert violations(good) == []
