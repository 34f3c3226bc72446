"""The chart's fleet-query endpoint (``queryEndpoint``): off by default; on, a Deployment
and Service running ``broker-lookup query --listen`` as the ACL user ``router``, reachable
by the routers and the scrapers alone; and, run as rendered against a server with the
rendered users, it answers and reserves with nothing denied."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.ops.acl import acl_line
from broker_lookup.processes import free_port
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

from ._chart import RenderFn, container, env_map
from ._server import client, running_server, server_binary
from .test_chart_acl import SETS, _build_acl, _secret

pytestmark = pytest.mark.helm

ON = "queryEndpoint.enabled=true"
ROOT = ("test-root", "test-root-password")


def test_off_by_default(render: RenderFn) -> None:
    rendered = render(*SETS)
    assert not rendered.has("Deployment", "-query")
    assert not rendered.has("NetworkPolicy", "-query")
    assert "router" not in _secret(rendered)


def test_it_runs_the_query_endpoint_as_the_router_user(render: RenderFn) -> None:
    rendered = render(*SETS, ON, "queryEndpoint.deadlineMs=20")
    query = container(rendered.get("Deployment", "-query"), "query")
    assert query["command"] == ["broker-lookup"]
    assert query["args"] == ["query", "--listen", "0.0.0.0:9410", "--deadline-ms", "20"]
    env = env_map(query)
    assert env["BROKER_LOOKUP_REDIS_USERNAME"] == "router"
    assert env["BROKER_LOOKUP_REDIS_PASSWORD"]["secretKeyRef"]["key"] == "router"
    assert env["BROKER_LOOKUP_CHUNK_SIZE"] == "256"  # the engines' hashing settings
    for probe in ("livenessProbe", "readinessProbe"):
        # /healthz: Redis down, a query still answers `unavailable` at once.
        assert query[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    service = rendered.get("Service", "-query")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9410, "targetPort": "http", "protocol": "TCP"}
    ]
    # Its user: the router role on every engine, in the ACL file and the Secret.
    template = rendered.get("ConfigMap", "-redis-acl")["data"]["users.acl.in"]
    (line,) = [u for u in template.splitlines() if u.startswith("user router ")]
    expected = acl_line("router", None, user="router", password_sha256="0" * 64).split()
    assert line.split()[4:] == expected[4:]  # all but the password
    assert "router" in _secret(rendered)


def test_only_routers_and_scrapers_reach_it(render: RenderFn) -> None:
    rendered = render(*SETS, ON, "networkPolicy.enabled=true")
    policy = rendered.get("NetworkPolicy", "-query")
    pod = rendered.get("Deployment", "-query")["spec"]["template"]["metadata"]["labels"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= pod.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9410}]
    peers = rule["from"]
    assert {"podSelector": {"matchLabels": {"broker-lookup/router": "true"}}} in peers
    assert any("namespaceSelector" in p for p in peers)  # the scrapers (monitoring)
    # ... and the endpoint may reach Redis.
    redis_peers = rendered.get("NetworkPolicy", "-redis")["spec"]["ingress"][0]["from"]
    assert any(
        p.get("podSelector", {}).get("matchLabels", {}).items() <= pod.items()
        and p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "query"
        for p in redis_peers
    )


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.status, reply.read()


@pytest.mark.real
def test_the_endpoint_runs_as_rendered_and_reserves(render: RenderFn, tmp_path: Path) -> None:
    rendered = render(*SETS, ON)
    secret = _secret(rendered)
    acl_file = _build_acl(rendered, tmp_path)
    # A test-only user that reads ACL LOG (the rendered `admin` may not).
    acl_file.write_text(acl_file.read_text() + f"user {ROOT[0]} on >{ROOT[1]} ~* &* +@all\n")
    conf = rendered.get("ConfigMap", "-redis")["data"]["valkey.conf"]
    conf = conf.replace("aclfile /acl/users.acl", f"aclfile {acl_file}")
    (tmp_path / "valkey.conf").write_text(conf.replace("\ndir /data\n", f"\ndir {tmp_path}\n"))
    port, http_port = free_port(), free_port()
    argv = [server_binary(), str(tmp_path / "valkey.conf"), "--port", str(port)]
    with running_server(argv, port, tmp_path / "server.log"):
        admin = client(port, username=ROOT[0], password=ROOT[1])
        url = f"redis://127.0.0.1:{port}/0"
        config = LookupConfig(
            redis_url=url, redis_username="vllm-llama-70b", redis_password=secret["vllm-llama-70b"]
        )
        engine_id = f"llama-70b@{uuid.uuid4().hex[:5]}"
        engine = ReferenceEngine()
        tokens = list(range(3 * config.chunk_size))
        hashes, offsets = ChunkedTokenHasher(config).hashes_and_offsets(tokens)
        engine.store(hashes[:2], offsets[:2])
        rank = RedisAsyncLookupServer(
            engine, LookupMetadata(engine_id=engine_id, world_size=1), config
        )
        # The container as rendered: its args (but a local port) and its environment.
        query = container(rendered.get("Deployment", "-query"), "query")
        args = [a.replace("0.0.0.0:9410", f"127.0.0.1:{http_port}") for a in query["args"]]
        env = {k: v for k, v in env_map(query).items() if isinstance(v, str)}
        env |= {"BROKER_LOOKUP_REDIS_URL": url, "BROKER_LOOKUP_REDIS_PASSWORD": secret["router"]}
        code = "import sys; from broker_lookup.cli import main; sys.exit(main(sys.argv[1:]))"
        log = (tmp_path / "query.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env={**_base_env(), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(lambda: rank.ready and rank.prober.reading.is_set(), timeout=10)
            base = f"http://127.0.0.1:{http_port}"
            wait_until(
                lambda: _http(base + "/healthz")[0] == 200,
                timeout=30,
                ignoring=(OSError,),
                message=f"the endpoint serves: {(tmp_path / 'query.log').read_text()}",
            )
            ask = {"tokens": tokens, "configured": "llama-70b", "reserve_ms": 300}
            status, body = _http(base + "/query", ask)
            doc = json.loads(body)
            assert status == 200, doc
            best = doc["engines"][0]
            assert (best["engine_id"], best["tokens"], best["reserved"]) == (
                engine_id,
                2 * config.chunk_size,
                2 * config.chunk_size,
            )
            wait_until(lambda: len(rank.reservations) == 0, timeout=10)
            _, text = _http(base + "/metrics")
            reserved = [
                s.value
                for f in text_string_to_metric_families(text.decode())
                for s in f.samples
                if s.name == "broker_lookup_query_reservations_total"
                and s.labels == {"engine": "llama-70b", "outcome": "reserved"}
            ]
            assert reserved == [1.0]
            assert _http(base + "/readyz")[0] == 200  # PING as router
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            log.close()
            rank.close()
            engine.close()
        denied = [
            dict(e)
            for e in admin.acl_log()
            if e.get("username") == "router" and e.get("object") != "client|setinfo"
        ]
        assert denied == []  # nothing the endpoint does needs more than the role grants


def _base_env() -> dict[str, str]:
    keep = ("PATH", "PYTHONPATH", "HOME", "VIRTUAL_ENV")
    return {k: os.environ[k] for k in keep if k in os.environ}
