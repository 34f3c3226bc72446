"""The key scheme: formats, hash tags, engine id validation, the lookup-id inverse."""

from __future__ import annotations

import pytest

from broker_lookup.errors import ConfigError
from broker_lookup.protocol.keys import (
    PREFIX,
    KeySpace,
    configured_of,
    configured_patterns,
    engine_of,
    instance_of,
    validate_configured_id,
    validate_engine_id,
)


def test_key_formats() -> None:
    ks = KeySpace("vllm-0")
    assert ks.engine_id == "vllm-0"
    assert ks.requests == "bl:{vllm-0}:requests"
    assert ks.done == "bl:{vllm-0}:done"
    assert ks.dead == "bl:{vllm-0}:dead"
    assert ks.fingerprint == "bl:{vllm-0}:fp"
    assert ks.lookup("req-1") == "bl:{vllm-0}:lookup:req-1"
    assert ks.heartbeat(3) == "bl:{vllm-0}:hb:3"


def test_patterns_and_group_names() -> None:
    ks = KeySpace("e")
    assert ks.lookup_pattern == "bl:{e}:lookup:*"
    assert ks.heartbeat_pattern == "bl:{e}:hb:*"
    assert ks.pattern == "bl:{e}:*"
    assert (KeySpace.group(2), KeySpace.consumer(2), KeySpace.rank_field(2)) == (
        "rank-2",
        "rank-2",
        "r2",
    )


def test_every_key_shares_one_hash_tag_and_the_prefix() -> None:
    ks = KeySpace("a.b:c_d-1")
    keys = [ks.requests, ks.done, ks.dead, ks.fingerprint, ks.lookup("x"), ks.heartbeat(0)]
    for key in keys:
        assert key.startswith(PREFIX + ":")
        tag = key[key.index("{") + 1 : key.index("}")]
        assert tag == "a.b:c_d-1"


def test_engines_do_not_share_keys() -> None:
    a, b = KeySpace("a"), KeySpace("b")
    assert a.lookup("x") != b.lookup("x") and a.pattern != b.pattern


@pytest.mark.parametrize("engine_id", ["e", "vllm-0", "A.b:c_d-9", "x" * 128, "0"])
def test_valid_engine_ids(engine_id: str) -> None:
    assert validate_engine_id(engine_id) == engine_id
    assert KeySpace(engine_id).engine_id == engine_id


@pytest.mark.parametrize(
    "engine_id",
    ["", "a{b}", "a}", "{", "sp ace", "x" * 129, "é", "a/b", "a*", "new\nline", "e\n", "vllm-0\n"],
)
def test_invalid_engine_ids(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="engine_id"):
        validate_engine_id(engine_id)
    with pytest.raises(ConfigError):
        KeySpace(engine_id)


@pytest.mark.parametrize(
    "namespace", ["e@i", "llama-3.1-8b@1796611254403740308", "x" * 128 + "@" + "y" * 64]
)
def test_instance_namespaces_are_engine_ids_but_not_configured_ids(namespace: str) -> None:
    assert validate_engine_id(namespace) == namespace
    assert engine_of(KeySpace(namespace).requests) == namespace
    with pytest.raises(ConfigError, match=r"--engine-id=.*'@' is reserved"):
        validate_configured_id(namespace, "--engine-id")


@pytest.mark.parametrize("namespace", ["a@b@c", "@b", "a@", "a@" + "y" * 65, "x" * 129 + "@i"])
def test_invalid_namespaces(namespace: str) -> None:
    with pytest.raises(ConfigError, match="engine_id"):
        validate_engine_id(namespace)


def test_configured_of_maps_a_namespace_back_to_its_configured_id() -> None:
    assert configured_of("llama-3.1-8b@1796611254403740308") == "llama-3.1-8b"
    assert configured_of("llama-3.1-8b") == "llama-3.1-8b"
    assert instance_of("llama-3.1-8b") is None
    assert instance_of("llama@1796611254403740308") == "1796611254403740308"
    assert configured_patterns("llama-3", "metrics:*") == (
        "bl:{llama-3}:metrics:*",
        "bl:{llama-3@*}:metrics:*",
    )


@pytest.mark.parametrize("engine_id", [None, 5, b"e"])
def test_engine_id_must_be_a_str(engine_id: object) -> None:
    with pytest.raises(ConfigError):
        validate_engine_id(engine_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("lookup_id", ["r", "req-1", "a:b:c", "lookup:x", "cmpl-9f3a-0", "a.b_c"])
def test_lookup_id_of_inverts_lookup(lookup_id: str) -> None:
    ks = KeySpace("eng")
    key = ks.lookup(lookup_id)
    assert key == "bl:{eng}:lookup:" + lookup_id
    assert ks.lookup_id_of(key) == lookup_id
    assert ks.lookup_id_of(key.encode()) == lookup_id


HOSTILE_IDS = [
    "a b",
    "{t}",
    "id#3",
    "é",
    "日本",
    "x" * 129,
    "x" * 10_000,
    "\n",
    "req-1\n",  # ``$`` matches before a trailing newline: the id must not reach a key verbatim
    "x" * 128 + "\n",
    "*",
    "~abc",
    "\udc80",
]


@pytest.mark.parametrize("lookup_id", HOSTILE_IDS)
def test_any_other_id_is_keyed_by_a_digest(lookup_id: str) -> None:
    ks = KeySpace("eng")
    key = ks.lookup(lookup_id)
    part = key.removeprefix("bl:{eng}:lookup:")
    # A fixed-size, key-safe name: no spaces, braces or non-ASCII inside a Redis key.
    assert part.startswith("~") and len(part) == 65 and part[1:].isalnum()
    assert ks.lookup_id_of(key) is None  # the hash's ``id`` field holds the original
    assert key == ks.lookup(lookup_id)  # stable


def test_digest_keys_never_collide_with_plain_ones() -> None:
    ks = KeySpace("eng")
    keys = {ks.lookup(i) for i in HOSTILE_IDS} | {ks.lookup(i) for i in ("r", "req-1")}
    assert len(keys) == len(HOSTILE_IDS) + 2


def test_the_exporter_reads_one_configured_id_and_its_instances_only() -> None:
    """``exporter --engine-id llama-3`` exported ``llama-3.1-8b`` (``bl:{llama-3.*}``)."""
    import fakeredis

    from broker_lookup.ops.exporter import read_snapshots

    client = fakeredis.FakeRedis()
    engines = ["llama-3", "llama-3@r1", "llama-3.1-8b", "llama-3.1-8b@r2", "llama-30"]
    for engine in engines:
        client.set(KeySpace(engine).metrics("0"), b"not a snapshot")
    assert read_snapshots(client, "llama-3") == ([], 2)  # its own and its instance's
    assert read_snapshots(client, "llama-3.1-8b@r2") == ([], 1)  # one instance
    assert read_snapshots(client, None) == ([], len(engines))
