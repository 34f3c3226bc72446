"""Namespaces of different configured engine ids never overlap, nor do their ACL users.

A configured id may not hold ``@``, which joins it to an instance's id, so ``a`` + instance
``b`` (``a@b``) is never configured ``a.b``, and ``~bl:{<id>@*}:*`` matches the id's own
instances only. Checked with ``ACL DRYRUN`` on a real server for every pair of a set of
ids that are prefixes of each other, hold dots, or are as long as an id may be (whose
instance namespace passes 128 characters: the generated ACL must still match it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from helpers import command

from broker_lookup.ops.acl import acl_line
from broker_lookup.protocol.keys import KeySpace, configured_of, instance_engine_id
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = pytest.mark.real

ROOT = ("bl-test-root", "root-only-in-this-test")
CONFIGURED = [
    "llama-3",
    "llama-3.1-8b",
    "llama-3.1",
    "llama",
    "a",
    "a.b",
    "a.b.c",
    "x" * 128,
    "x" * 127,
]
INSTANCES = ["b", "1796611254403740308", "r" + "0123456789abcdef", "c_dp1"]


def namespaces() -> list[str]:
    """Every configured id, and each of its instances' namespaces."""
    out = list(CONFIGURED)
    out += [instance_engine_id(c, i) for c in CONFIGURED for i in INSTANCES]
    return out


def _user(configured: str) -> str:
    return f"w{CONFIGURED.index(configured)}"


@pytest.fixture(scope="module")
def root() -> Iterator[redis.Redis]:
    """A real server with one ``worker`` user per configured id, and a test root user."""
    with EmbeddedServer(password="bootstrap-only") as server:
        conn = redis.Redis(host="127.0.0.1", port=server.port, password="bootstrap-only")
        command(conn, "ACL", "SETUSER", ROOT[0], "on", f">{ROOT[1]}", "~*", "&*", "+@all")
        command(conn, "AUTH", *ROOT)
        for configured in CONFIGURED:
            line = acl_line("worker", configured, user=_user(configured), password="pw")
            command(conn, "ACL", "SETUSER", *line.split()[1:])
        try:
            yield conn
        finally:
            conn.close()


def _may(root: redis.Redis, user: str, key: str) -> bool:
    try:
        return bool(command(root, "ACL", "DRYRUN", user, "HSET", key, "r0", "999") == b"OK")
    except redis.ResponseError:  # some servers answer a denial as an error
        return False


def test_no_two_configured_ids_share_a_namespace() -> None:
    found = namespaces()
    assert len(set(found)) == len(found)  # "a" + instance "b" is not configured "a.b"
    assert all(configured_of(n) in CONFIGURED for n in found)
    assert {configured_of(instance_engine_id(c, "b")) for c in CONFIGURED} == set(CONFIGURED)
    assert instance_engine_id("a", "b") != "a.b"


def test_long_ids_keep_their_whole_configured_id() -> None:
    longest = instance_engine_id("x" * 128, "1796611254403740308")
    assert len(longest) > 128 and longest.startswith("x" * 128 + "@")
    assert configured_of(longest) == "x" * 128
    assert KeySpace(longest).requests.startswith("bl:{" + "x" * 128 + "@")


def test_each_user_reaches_its_own_namespaces_and_no_other(root: redis.Redis) -> None:
    """Every (user, namespace) pair: allowed exactly when the namespace is of its id."""
    wrong = []
    for configured in CONFIGURED:
        for namespace in namespaces():
            key = KeySpace(namespace).lookup("req-1")
            expected = configured_of(namespace) == configured
            if _may(root, _user(configured), key) != expected:
                wrong.append((configured, namespace, expected))
    assert wrong == []
