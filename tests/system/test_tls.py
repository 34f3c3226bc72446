"""``rediss://`` with a CA and a client certificate, against a TLS-only Redis (mutual TLS).

Certificates are made here with ``openssl``: a CA, a server certificate for
``IP:127.0.0.1``, a client certificate, and a second CA nobody trusts. The server is
Debian's ``/usr/bin/redis-server`` (built with TLS) started by the fixture itself:
``EmbeddedServer`` checks readiness with a plaintext PING, which a TLS-only port
never answers. Without a TLS-capable binary the tests skip, except under ``CI``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from faultkit import alive
from helpers import wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.processes import free_port
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.connection import make_factory
from workers.server import RedisAsyncLookupServer

pytestmark = pytest.mark.real

BINARY = "/usr/bin/redis-server"
TOKENS = list(range(40))


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set, so the TLS tests must run, but {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _new_key(name: str) -> list[str]:
    """``openssl req`` options for a new P-256 key in ``<name>.key``, subject ``CN=<name>``."""
    key = ["-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    return [*key, "-keyout", f"{name}.key", "-subj", f"/CN={name}"]


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", *_new_key(name), "-out", f"{name}.crt", "-days", "2", cwd=cwd)


def _leaf(name: str, ext: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("req", *_new_key(name), "-out", f"{name}.csr", cwd=cwd)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        _unavailable("no openssl to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    _ca("ca", d)
    _ca("rogue", d)
    _leaf("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", d)
    _leaf("client", "extendedKeyUsage=clientAuth\n", d)
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Certs(
        d / "ca.crt",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "rogue.crt",
    )


def _tls_client(port: int, certs: Certs) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        ssl=True,
        ssl_ca_certs=str(certs.ca),
        ssl_certfile=str(certs.client_cert),
        ssl_keyfile=str(certs.client_key),
        socket_timeout=1,
        socket_connect_timeout=1,
    )


def _wait_ready(proc: subprocess.Popen[bytes], port: int, certs: Certs, log: Path) -> None:
    client = _tls_client(port, certs)
    deadline = time.monotonic() + 15
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)  # polling a starting child process
    finally:
        client.close()
    text = log.read_text(errors="replace")
    if proc.poll() is not None and "bad directive" in text.lower() and "tls" in text.lower():
        _unavailable(f"{BINARY} refuses the TLS options (built without TLS?):\n{text[-500:]}")
    raise AssertionError(f"TLS server did not answer:\n{text[-2000:]}")


@pytest.fixture(scope="module")
def tls_port(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A TLS-only redis-server requiring client certificates; always stopped."""
    if not Path(BINARY).exists():
        _unavailable(f"no {BINARY}")
    port, workdir = free_port(), tmp_path_factory.mktemp("tls-server")
    argv = [
        BINARY,
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        str(certs.server_cert),
        "--tls-key-file",
        str(certs.server_key),
        "--tls-ca-cert-file",
        str(certs.ca),
        "--tls-auth-clients",
        "yes",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    log = workdir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        _wait_ready(proc, port, certs, log)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _config(port: int, certs: Certs, **tls: str | None) -> LookupConfig:
    values: dict[str, Any] = {
        "ssl_ca_certs": str(certs.ca),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
        **tls,
    }
    return LookupConfig(
        redis_url=f"rediss://127.0.0.1:{port}/0",
        chunk_size=4,
        lookup_timeout_ms=5000,
        block_ms=50,
        heartbeat_interval_ms=100,
        heartbeat_ttl_ms=1000,
        **values,
    )


def test_lookup_over_mutual_tls(tls_port: int, certs: Certs, engine_id: str) -> None:
    cfg = _config(tls_port, certs)
    rank = RedisAsyncLookupServer(
        StubEngine("instant", hits=28), LookupMetadata(engine_id=engine_id, world_size=1), cfg
    )
    client = RedisAsyncLookupClient(cfg, LookupMetadata(engine_id=engine_id, world_size=1))
    try:
        alive(client, timeout=10)
        client.lookup(TOKENS, "tls-1")
        wait_until(lambda: client.lookup_cache("tls-1") == 28, timeout=10)
        assert client.stats().redis_errors == 0 and rank.stats().reporter_errors == 0
    finally:
        client.close()
        rank.close()


@pytest.mark.parametrize(
    ("tls", "why"),
    [
        ({"ssl_certfile": None, "ssl_keyfile": None}, "no client certificate"),
        ({"ssl_ca_certs": "ROGUE"}, "server certificate from a CA we do not trust"),
    ],
)
def test_tls_refuses_what_it_must(
    tls_port: int, certs: Certs, tls: dict[str, str | None], why: str
) -> None:
    if tls.get("ssl_ca_certs") == "ROGUE":
        tls = {**tls, "ssl_ca_certs": str(certs.rogue_ca)}
    conn = make_factory(_config(tls_port, certs, **tls), "bl-tls-test")()
    try:
        with pytest.raises(redis.ConnectionError):
            conn.ping()
    finally:
        conn.close()


def test_plaintext_to_the_tls_port_fails(tls_port: int) -> None:
    conn = redis.Redis(
        host="127.0.0.1",
        port=tls_port,
        socket_timeout=1,
        socket_connect_timeout=1,
        retry=Retry(NoBackoff(), 0),
    )
    with pytest.raises(redis.RedisError):
        conn.ping()
