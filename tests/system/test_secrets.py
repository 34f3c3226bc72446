"""Passwords never show: not in logs (any logger, DEBUG), reprs, exception texts, the
``broker-lookup inspect`` output, or a rank process's output, right password or wrong."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from broker_lookup.cli import main as cli_main
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.errors import BrokerLookupError, ConfigError, translate_redis_errors
from broker_lookup.processes import child_env
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.transport.connection import make_factory

RIGHT = "Right-Pass-7c1e"
SECRETS = ("Wrong-Pass-93ab", "Url-Pass-5d2f", RIGHT)


def _clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, (
            f"a password leaked: ...{text[max(0, text.find(secret) - 80) :][:200]}"
        )


@pytest.fixture(scope="module")
def locked() -> Iterator[EmbeddedServer]:
    """A private server with a password (requirepass)."""
    binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None
    with EmbeddedServer(binary=binary, password=RIGHT) as server:
        yield server


def _url(server: EmbeddedServer, password: str | None) -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{server.port}/0"


def test_config_repr_and_errors_hide_passwords() -> None:
    cfg = LookupConfig(redis_url="redis://user:Url-Pass-5d2f@h:6379/0", redis_password=RIGHT)
    _clean(repr(cfg) + str(cfg))
    assert "***" in repr(cfg)
    bad: list[dict[str, Any]] = [
        {"redis_url": "redis://u:Url-Pass-5d2f@h:6379/0", "block_ms": 99_999},
        {"redis_url": "http://u:Url-Pass-5d2f@h:6379/0"},
        {"redis_password": 12345, "redis_url": "redis://:Url-Pass-5d2f@h/0"},
    ]
    for values in bad:
        with pytest.raises(ConfigError) as err:
            LookupConfig(**values)
        _clean(str(err.value) + repr(err.value))
    with pytest.raises(ConfigError) as err:
        LookupConfig.from_env({"BROKER_LOOKUP_REDIS_URL": "ftp://:Url-Pass-5d2f@h/0"})
    _clean(str(err.value))


def _failures(cfg: LookupConfig) -> str:
    """Every text a failed connection produces: redis-py's exception, ours, their causes."""
    texts = []
    conn = make_factory(cfg, "bl-secret-test")()
    try:
        with translate_redis_errors("pinging"):
            conn.ping()
    except BrokerLookupError as exc:
        texts += [str(exc), repr(exc), str(exc.__cause__), repr(exc.__cause__)]
    finally:
        conn.close()
    assert texts, "a wrong password must fail"
    return "\n".join(texts)


@pytest.mark.parametrize(
    "how", ["config", "url", "both"], ids=["config-password", "url-password", "both"]
)
def test_wrong_password_leaks_nowhere(
    locked: EmbeddedServer, engine_id: str, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, redis-py's included
    url = _url(locked, "Url-Pass-5d2f" if how != "config" else None)
    password = "Wrong-Pass-93ab" if how != "url" else None
    cfg = LookupConfig(
        redis_url=url,
        redis_password=password,
        chunk_size=4,
        lookup_timeout_ms=500,
        block_ms=50,
        heartbeat_interval_ms=100,
        heartbeat_ttl_ms=1000,
    )
    _clean(_failures(cfg))
    client = RedisAsyncLookupClient(cfg, LookupMetadata(engine_id=engine_id, world_size=1))
    try:
        assert client.lookup(list(range(40)), "r1") == 0  # no rank is reachable: 0, no hang
        wait_until(lambda: client.stats().redis_errors > 0, timeout=10)
    finally:
        client.close()
    assert caplog.records  # the failures were logged ...
    _clean(caplog.text)  # ... without the password
    _clean(repr(client.config) + repr(locked))


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli_main(["inspect", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_inspect_output_hides_passwords(
    locked: EmbeddedServer,
    engine_id: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BROKER_LOOKUP_REDIS_PASSWORD", raising=False)
    conn = make_factory(LookupConfig(redis_url=_url(locked, RIGHT)), "test")()
    conn.set(KeySpace(engine_id).heartbeat(0), "{}", px=60_000)  # the engine exists
    conn.close()
    code, out = _inspect(capsys, "--redis-url", _url(locked, RIGHT), "--engine-id", engine_id)
    assert code == 0 and engine_id in out, out
    _clean(out)
    code, out = _inspect(
        capsys, "--redis-url", _url(locked, RIGHT), "--engine-id", engine_id, "--json"
    )
    assert code == 0
    _clean(out)
    code, out = _inspect(capsys, "--redis-url", _url(locked, "Url-Pass-5d2f"), "--engine-id", "e")
    assert code != 0 and out, out
    _clean(out)
    monkeypatch.setenv("BROKER_LOOKUP_REDIS_PASSWORD", "Wrong-Pass-93ab")
    code, out = _inspect(capsys, "--redis-url", _url(locked, None), "--engine-id", "e")
    assert code != 0
    _clean(out)


def test_rank_process_output_hides_passwords(
    locked: EmbeddedServer, engine_id: str, tmp_path: Path
) -> None:
    extra = {
        "BROKER_LOOKUP_REDIS_URL": _url(locked, None),
        "BROKER_LOOKUP_REDIS_PASSWORD": "Wrong-Pass-93ab",
    }
    env = child_env(os.environ, extra)
    argv = [
        sys.executable,
        "-m",
        "workers",
        "--engine-id",
        engine_id,
        "--world-size",
        "1",
        "--rank",
        "0",
        "--metrics-port",
        "0",
        "--connect-timeout",
        "1",
        "--log-level",
        "DEBUG",
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]  # the password refused: a config error
    assert "Redis refused the credentials" in done.stderr
    _clean(done.stdout + done.stderr)
