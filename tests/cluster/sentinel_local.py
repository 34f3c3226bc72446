"""A throwaway Sentinel deployment: one master, one replica, N sentinels, all on loopback.

The master and the replica are :class:`EmbeddedServer` processes; the sentinels are the
same binary run as ``<binary> sentinel.conf --sentinel`` (a sentinel needs a writable
config file, which ``EmbeddedServer`` does not write), started here with the same
parent-death guard. :meth:`LocalSentinel.stop` stops every process, also after a failed
start.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis
from helpers import wait_until

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.processes import free_port, spawn
from broker_lookup.tools.embedded import EmbeddedServer, _default_binary

HOST = "127.0.0.1"
_ATTEMPTS = 3


def _wait(predicate: Any, timeout_s: float, what: str) -> Any:
    """:func:`helpers.wait_until`, failing as the stack's setup does (BrokerUnavailable)."""
    try:
        return wait_until(predicate, timeout_s, 0.05, what, ignoring=(redis.RedisError,))
    except AssertionError as exc:
        raise BrokerUnavailable(f"sentinel setup: {exc}") from None


class _SentinelProcess:
    """One ``--sentinel`` process with its own directory, config and log."""

    def __init__(self, binary: str, conf_lines: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="broker-lookup-sentinel-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._binary = binary
        self._conf_lines = conf_lines

    def start(self, port: int) -> None:
        """Start on ``port``, or on fresh ports if that one is lost to another process."""
        for attempt in range(1, _ATTEMPTS + 1):
            self.port = port if attempt == 1 else free_port(HOST)
            self._launch()
            try:
                _wait(self._answers, 5.0, f"sentinel on port {self.port}")
                return
            except BrokerUnavailable:
                self.stop(keep_dir=True)
                if attempt == _ATTEMPTS:
                    raise BrokerUnavailable(f"no sentinel: {self.log_tail()}") from None

    def _launch(self) -> None:
        conf = self.dir / "sentinel.conf"
        lines = [f"port {self.port}", f"bind {HOST}", f"dir {self.dir}", *self._conf_lines]
        conf.write_text("\n".join(lines) + "\n")
        with open(self.dir / "sentinel.log", "wb") as log:
            argv = [self._binary, str(conf), "--sentinel"]
            self.proc = spawn(argv, os.environ, output=log, cwd=self.dir)

    def _answers(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise BrokerUnavailable(f"sentinel exited: {self.log_tail()}")
        with redis.Redis(host=HOST, port=self.port, socket_timeout=1) as client:
            return bool(client.ping())

    def log_tail(self) -> str:
        try:
            return "\n".join((self.dir / "sentinel.log").read_text().splitlines()[-10:])
        except OSError:
            return "(no log)"

    def stop(self, keep_dir: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class LocalSentinel:
    """Master + replica + ``sentinels`` sentinels monitoring ``service`` with ``quorum``."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        service: str = "mymaster",
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
    ) -> None:
        self.binary = binary or _default_binary()
        self.service = service
        # No 5 s wait for more replicas before the first (diskless) full sync.
        self.master = EmbeddedServer(
            binary=self.binary, extra_args=("--repl-diskless-sync-delay", "0")
        )
        self.replica: EmbeddedServer | None = None
        conf = [
            f"sentinel monitor {service} {HOST} {{port}} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1",
        ]
        self._conf = conf
        self._count = sentinels
        self.sentinels: list[_SentinelProcess] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self) -> LocalSentinel:
        try:
            self.master.start()
            self.replica = EmbeddedServer(
                binary=self.binary, extra_args=("--replicaof", HOST, str(self.master.port))
            ).start()
            replica = redis.Redis(host=HOST, port=self.replica.port, decode_responses=True)

            def linked() -> bool:
                return bool(replica.info("replication").get("master_link_status") == "up")

            _wait(linked, 10.0, "the replica's link to the master")
            replica.close()
            self._start_sentinels()
            for s in self.sentinels:
                _wait(lambda s=s: self._knows_all(s.port), 15.0, "sentinels to find each other")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinels(self) -> None:
        """Start the sentinels, each told its peers and the replica in its config.

        Declaring ``known-sentinel``/``known-replica`` (what a sentinel writes into its
        own config) spares the 2 s hello rounds of discovery; a sentinel that had to move
        to another port is still found by hello messages, only later.
        """
        assert self.replica is not None
        ports = [free_port(HOST) for _ in range(self._count)]
        ids = [secrets.token_hex(20) for _ in range(self._count)]
        base = [c.replace("{port}", str(self.master.port)) for c in self._conf]
        base.append(f"sentinel known-replica {self.service} {HOST} {self.replica.port}")
        for i in range(self._count):
            peers = [
                f"sentinel known-sentinel {self.service} {HOST} {ports[j]} {ids[j]}"
                for j in range(self._count)
                if j != i
            ]
            proc = _SentinelProcess(self.binary, [f"sentinel myid {ids[i]}", *base, *peers])
            self.sentinels.append(proc)
            proc.start(ports[i])

    def _knows_all(self, port: int) -> bool:
        with redis.Redis(host=HOST, port=port, decode_responses=True, socket_timeout=1) as c:
            state: Any = c.sentinel_master(self.service)
        return bool(
            int(state["num-other-sentinels"]) == self._count - 1 and int(state["num-slaves"]) >= 1
        )

    def master_port(self) -> int | None:
        """The master's port as the first answering sentinel reports it."""
        for s in self.sentinels:
            try:
                with redis.Redis(host=HOST, port=s.port, socket_timeout=1) as c:
                    addr: Any = c.sentinel_get_master_addr_by_name(self.service)
                return int(addr[1]) if addr else None
            except redis.RedisError:
                continue
        return None

    def stop(self) -> None:
        """Stop every sentinel and both servers (each even if another fails); idempotent."""
        for s in self.sentinels:
            s.stop()
        self.sentinels = []
        for server in (self.replica, self.master):
            if server is not None:
                server.stop()

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
