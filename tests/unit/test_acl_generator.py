"""``broker-lookup acl``: deploy/users.acl is its output for the chart's default engine, and
the users it makes for any other engine reach that engine's keys only."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest

from broker_lookup.cli import main
from broker_lookup.errors import ConfigError
from broker_lookup.ops.acl import ROLES, acl_file, acl_line

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "users.acl"


def test_the_shipped_file_is_the_generators_output() -> None:
    assert SHIPPED.read_text() == acl_file("vllm-engine")


def test_a_user_is_scoped_to_its_engine_and_its_vllm_instances() -> None:
    line = acl_line("worker", "llama-70b", user="worker-llama-70b", password="s3cret")
    words = line.split()
    assert words[:3] == ["user", "worker-llama-70b", "on"]
    assert "#" + hashlib.sha256(b"s3cret").hexdigest() in words
    assert [w for w in words if w.startswith(("~", "%"))] == [
        "~bl:{llama-70b}:*",
        "~bl:{llama-70b@*}:*",
        "~bl:members:{llama-70b}",
    ]
    assert "-@all" in words and "+eval" not in words and "+evalsha" in words
    assert not any(w.startswith("+@") for w in words)


def test_roles_and_their_limits() -> None:
    assert ROLES == ("scheduler", "worker", "vllm", "operator", "admin", "router")

    # A vLLM pod hosts the scheduler's client and the rank servers under one credential.
    def grants(role: str) -> set[str]:
        return {w for w in acl_line(role, "e").split() if w.startswith(("+", "~"))}

    assert grants("vllm") == grants("scheduler") | grants("worker")
    with pytest.raises(ConfigError, match="needs an engine id"):
        acl_line("vllm", None)
    assert "~bl:*" in acl_line("operator", None).split()  # a fleet-wide read-only operator
    admin = acl_line("admin", "e").split()
    assert "+script|kill" in admin and not any(w.startswith("~") for w in admin)
    # A router reaches each engine's probe stream, answers, epochs and heartbeats alone,
    # and sends no script (so never reports).
    router = acl_line("router", "e").split()
    assert [w for w in router if w.startswith("~")] == [
        "~bl:{e}:epochs",
        "~bl:{e@*}:epochs",
        "~bl:{e}:hb:*",
        "~bl:{e@*}:hb:*",
        "~bl:{e}:probes",
        "~bl:{e@*}:probes",
        "~bl:{e}:probe:*",
        "~bl:{e@*}:probe:*",
    ]
    assert "+evalsha" not in router and "+hset" not in router and "+blpop" in router
    fleet = [w for w in acl_line("router", None).split() if w.startswith("~")]
    assert fleet == ["~bl:{*}:epochs", "~bl:{*}:hb:*", "~bl:{*}:probes", "~bl:{*}:probe:*"]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"role": "root", "engine_id": "e"}, "role='root'"),
        ({"role": "worker", "engine_id": None}, "needs an engine id"),
        ({"role": "worker", "engine_id": "bad{id}"}, "engine_id"),
        ({"role": "worker", "engine_id": "e", "password_sha256": "abc"}, "64 hex"),
        ({"role": "worker", "engine_id": "e", "user": "two words"}, "user="),
    ]
    for kwargs, match in bad:
        with pytest.raises(ConfigError, match=match):
            acl_line(**kwargs)


def test_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["acl", "--engine-id", "vllm-engine"]) == 0
    assert capsys.readouterr().out == SHIPPED.read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret\n"))
    argv = ["acl", "--engine-id", "e1", "--role", "scheduler", "--user", "sched-e1"]
    assert main([*argv, "--password-stdin"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("user sched-e1 on #" + hashlib.sha256(b"s3cret").hexdigest())
    assert main(["acl", "--role", "worker"]) == 2
    assert "needs an engine id" in capsys.readouterr().err
    # An instance's namespace is no configured id: its users would miss their siblings.
    assert main(["acl", "--engine-id", "vllm-engine@1796611254403740308"]) == 2
    err = capsys.readouterr().err
    assert "--engine-id='vllm-engine@1796611254403740308'" in err and "reserved" in err
