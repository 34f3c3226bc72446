"""The chart's ACL users: one source of truth with ``broker-lookup acl``, and a server that
runs them as the chart renders them.

The chart cannot run Python, so the roles' command lists and key patterns reach it as
``files/acl-roles.json``, generated from ``broker_lookup/ops/acl.py``. These tests check
that file is current, that the ACL file the chart renders is exactly what
``broker-lookup acl`` prints for the same engines, users and passwords, and that the
server's init script and config, run as rendered, give every user its own engine's keys
and nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from broker_lookup.ops.acl import (
    COMMANDS,
    DEFAULT_USER,
    ROLES,
    acl_line,
    key_patterns,
    router_key_patterns,
)
from broker_lookup.processes import free_port

from ._chart import CHART, REPO, Manifest, Rendered, RenderFailFn, RenderFn, container, env_map
from ._server import client, command, running_server, server_binary

pytestmark = pytest.mark.helm

ROLES_FILE = CHART / "files" / "acl-roles.json"
ENGINES = ["llama-70b", "mistral-7b.tp2"]
SETS = ("engine.id=llama-70b", "auth.acl.extraEngines={mistral-7b.tp2}")


def roles_document() -> dict[str, object]:
    """What files/acl-roles.json must hold, from broker_lookup/ops/acl.py."""
    return {
        "_comment": (
            "Generated from broker_lookup/ops/acl.py; tests/helm/test_chart_acl.py checks "
            "it is current."
        ),
        "default_user": DEFAULT_USER,
        "engine_key_patterns": [p.replace("ENGINE", "%s") for p in key_patterns("ENGINE")],
        "fleet_key_patterns": key_patterns(None),
        "router_key_patterns": router_key_patterns(None),
        "commands": {role: list(dict.fromkeys(COMMANDS[role])) for role in ROLES},
    }


def test_the_charts_roles_file_is_generated_from_the_code() -> None:
    regenerate = (
        "python -c 'import json,tests.helm.test_chart_acl as t; "
        f'open("{ROLES_FILE.relative_to(CHART.parents[1])}", "w").write('
        'json.dumps(t.roles_document(), indent=2) + "\\n")\''
    )
    expected = json.dumps(roles_document(), indent=2) + "\n"
    assert ROLES_FILE.read_text() == expected, f"stale; regenerate with: {regenerate}"


def _secret(rendered: Rendered) -> dict[str, str]:
    data = rendered.get("Secret", "-redis-auth")["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def _template_and_script(rendered: Rendered) -> tuple[str, str]:
    data = rendered.get("ConfigMap", "-redis-acl")["data"]
    return data["users.acl.in"], data["build-acl.sh"]


def _placeholders(rendered: Rendered) -> dict[str, str]:
    """PW_<i> -> the Secret key the init container reads it from."""
    init = container_of(rendered.get("StatefulSet", "-redis"), "acl")
    return {name: ref["secretKeyRef"]["key"] for name, ref in env_map(init).items()}


def container_of(workload: Manifest, name: str) -> Manifest:
    found: Manifest
    (found,) = [
        c for c in workload["spec"]["template"]["spec"]["initContainers"] if c["name"] == name
    ]
    return found


def _cli_line(role: str, engine: str | None, user: str, password: str) -> str:
    """One user's line as `broker-lookup acl --role R --user U --password-sha256 H` prints it."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    argv = ["acl", "--role", role, "--user", user, "--password-sha256", digest]
    if engine is not None:
        argv += ["--engine-id", engine]
    out = subprocess.run(
        [sys.executable, "-m", "broker_lookup.cli", *argv],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    return out.rstrip("\n")


def test_the_rendered_acl_is_broker_lookup_acls_output(render: RenderFn) -> None:
    rendered = render(*SETS)
    template, _ = _template_and_script(rendered)
    secret = _secret(rendered)
    filled = template
    for placeholder, key in _placeholders(rendered).items():
        digest = hashlib.sha256(secret[key].encode()).hexdigest()
        filled = filled.replace(f" @{placeholder}@ ", f" #{digest} ")
    expected = [DEFAULT_USER]
    for engine in ENGINES:
        for role in ("scheduler", "worker", "vllm", "operator"):
            user = f"{role}-{engine}"
            expected.append(acl_line(role, engine, user=user, password=secret[user]))
    expected.append(acl_line("operator", None, user="exporter", password=secret["exporter"]))
    expected.append(acl_line("admin", None, user="admin", password=secret["admin"]))
    assert filled.splitlines() == expected
    # ... which is what the command line prints, user by user.
    assert expected[3] == _cli_line("vllm", "llama-70b", "vllm-llama-70b", secret["vllm-llama-70b"])
    assert expected[-2] == _cli_line("operator", None, "exporter", secret["exporter"])


def test_every_user_has_a_generated_password(render: RenderFn) -> None:
    rendered = render(*SETS)
    secret = _secret(rendered)
    users = [f"{role}-{e}" for e in ENGINES for role in ("scheduler", "worker", "vllm", "operator")]
    assert sorted(secret) == sorted([*users, "exporter", "admin"])
    assert all(len(p) == 32 and p.isalnum() for p in secret.values())
    assert len(set(secret.values())) == len(secret)
    assert sorted(_placeholders(rendered).values()) == sorted(secret)


def test_an_existing_secret_names_every_key(render: RenderFn) -> None:
    rendered = render(*SETS, "auth.existingSecret=fleet-redis")
    assert not rendered.of_kind("Secret")
    init = container_of(rendered.get("StatefulSet", "-redis"), "acl")
    assert {ref["secretKeyRef"]["name"] for ref in env_map(init).values()} == {"fleet-redis"}
    exporter = env_map(container(rendered.get("Deployment", "-exporter"), "exporter"))
    assert exporter["BROKER_LOOKUP_REDIS_USERNAME"] == "exporter"
    assert exporter["BROKER_LOOKUP_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "fleet-redis", "key": "exporter"}
    }


def test_an_engine_id_that_cannot_name_a_user_fails(
    render: RenderFn, render_fails: RenderFailFn
) -> None:
    assert "engine id" in render_fails("engine.id=a:b")
    assert render("engine.id=a:b", "auth.acl.enabled=false")  # no users to name


# ------------------------------------------------ the server as rendered --


def _build_acl(rendered: Rendered, root: Path) -> Path:
    """Run the init container's script locally: mounts become directories under ``root``."""
    template, script = _template_and_script(rendered)
    conf_in, acl_dir = root / "acl-in", root / "acl"
    conf_in.mkdir()
    acl_dir.mkdir()
    (conf_in / "users.acl.in").write_text(template)
    local = script.replace("/etc/valkey-acl", str(conf_in)).replace("/acl/", f"{acl_dir}/")
    secret = _secret(rendered)
    env = {"PATH": "/usr/bin:/bin"}
    env |= {name: secret[key] for name, key in _placeholders(rendered).items()}
    subprocess.run(["sh", "-c", local], env=env, check=True, capture_output=True, timeout=30)
    return acl_dir / "users.acl"


@pytest.mark.real
def test_the_server_runs_the_rendered_users(render: RenderFn, tmp_path: Path) -> None:
    rendered = render(*SETS)
    acl_file = _build_acl(rendered, tmp_path)
    assert "@PW_" not in acl_file.read_text()
    assert not re.search(r" >", acl_file.read_text()), "no clear-text password"
    conf = rendered.get("ConfigMap", "-redis")["data"]["valkey.conf"]
    conf = conf.replace("aclfile /acl/users.acl", f"aclfile {acl_file}")
    conf = conf.replace("\ndir /data\n", f"\ndir {tmp_path}\n")
    (tmp_path / "valkey.conf").write_text(conf)
    port = free_port()
    secret = _secret(rendered)
    argv = [server_binary(), str(tmp_path / "valkey.conf"), "--port", str(port)]
    with running_server(argv, port, tmp_path / "server.log"):
        with pytest.raises(redis.AuthenticationError):
            client(port).ping()
        for user, password in secret.items():
            conn = client(port, username=user, password=password)
            assert conn.ping() is True, user
            conn.close()
        vllm = client(port, username="vllm-llama-70b", password=secret["vllm-llama-70b"])
        # A vLLM instance's namespace, <engine>@<instance>: its keys only (not those of
        # an engine whose id starts with "llama-70b.", nor of its instances).
        assert vllm.xadd("bl:{llama-70b@3f2a1}:requests", {"f": "v"})
        others = ("bl:{mistral-7b.tp2}:requests", "bl:{llama-70b-2}:requests", "x")
        for other in (*others, "bl:{llama-70b.q4}:requests", "bl:{llama-70b.q4@1}:requests"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                vllm.xadd(other, {"f": "v"})
        exporter = client(port, username="exporter", password=secret["exporter"])
        assert command(exporter, "XLEN", "bl:{llama-70b@3f2a1}:requests") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            exporter.xadd("bl:{llama-70b@3f2a1}:requests", {"f": "v"})
