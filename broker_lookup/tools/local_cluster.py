"""A throwaway local Redis Cluster (N masters, no replicas) for tests and the cluster bench.

Each node is an :class:`~broker_lookup.tools.embedded.EmbeddedServer` started from the same
binary with ``--cluster-enabled yes``; slots are split evenly with ``CLUSTER
ADDSLOTSRANGE`` (so Redis 7.0+ or Valkey 7.2+), the nodes are joined with
``CLUSTER MEET``, and :meth:`LocalCluster.start` returns once every node reports
``cluster_state:ok`` and knows every node and slot. :meth:`LocalCluster.stop` always
stops every node, also after a failed start.

>>> with LocalCluster(masters=3) as cluster:  # doctest: +SKIP
...     LookupConfig(redis_url=cluster.url)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.processes import free_port
from broker_lookup.tools.embedded import EmbeddedServer

__all__ = ["LocalCluster", "slot_ranges"]

_BUS_PORT_ATTEMPTS = 3


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """Inclusive ``(first, last)`` slot ranges splitting all slots evenly over ``masters``."""
    if masters < 1:
        raise ValueError(f"masters={masters} must be >= 1")
    bounds = [REDIS_CLUSTER_HASH_SLOTS * i // masters for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class LocalCluster:
    """``masters`` cluster-enabled embedded servers on loopback, joined into one cluster.

    Args:
        masters: Number of master nodes (each owns an equal share of the slots).
        binary: Server executable (default: as :class:`EmbeddedServer`).
        host: Address every node binds to and announces.
        node_timeout_ms: ``cluster-node-timeout``.
        extra_args: Further server arguments for every node.
        ready_timeout_s: How long :meth:`start` waits for ``cluster_state:ok``.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.host = host
        self.ranges = slot_ranges(masters)
        self._binary = binary
        self._node_args = ("--cluster-node-timeout", str(node_timeout_ms), *extra_args)
        self._ready_timeout_s = ready_timeout_s
        self.nodes: list[EmbeddedServer] = []
        self._masters = masters
        self.ids: list[str] = []
        self._bus_ports: list[int] = []
        self._admins: list[redis.Redis] = []

    @property
    def url(self) -> str:
        """``redis+cluster://host:port,host:port,...`` naming every node."""
        return "redis+cluster://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    def start(self) -> LocalCluster:
        """Start every node, assign slots, join them and wait until the cluster is ok."""
        try:
            for _ in range(self._masters):
                self.nodes.append(self._start_node())
            self._admins = [
                redis.Redis(host=self.host, port=n.port, socket_timeout=5) for n in self.nodes
            ]
            self.ids = [str(_cmd(a, "CLUSTER", "MYID"), "ascii") for a in self._admins]
            for epoch, (admin, (first, last)) in enumerate(
                zip(self._admins, self.ranges, strict=True), start=1
            ):
                _cmd(admin, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
                _cmd(admin, "CLUSTER", "ADDSLOTSRANGE", first, last)
            for node, bus in zip(self.nodes[1:], self._bus_ports[1:], strict=True):
                _cmd(self._admins[0], "CLUSTER", "MEET", self.host, node.port, bus)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node (each one even if another fails); idempotent."""
        for admin in self._admins:
            admin.close()
        self._admins = []
        for node in self.nodes:
            node.stop()
        self.nodes = []
        self._bus_ports = []

    def admin(self, index: int) -> redis.Redis:
        """A plain (non-cluster) client on node ``index``, for CLUSTER and MIGRATE commands."""
        return self._admins[index]

    def owner(self, slot: int) -> int:
        """Index of the node that owns ``slot`` according to node 0."""
        for first, last, master, *_ in _cmd(self._admins[0], "CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return self._port_index(int(master[1]))
        raise LookupError(f"slot {slot} is not covered")

    def migrate_slot(self, slot: int, dest: int, batch: int = 100, pause_s: float = 0.0) -> int:
        """Move ``slot`` and its keys to node ``dest`` as ``redis-cli --cluster reshard`` does.

        IMPORTING on the target, MIGRATING on the source, MIGRATE the keys in batches
        (``pause_s`` after each, to hold the slot half-moved while traffic runs: ASK and
        TRYAGAIN), then SETSLOT NODE on the target, the source and every other node.
        Returns the number of keys moved.
        """
        src = self.owner(slot)
        if src == dest:
            return 0
        source = self._admins[src]
        target = self._admins[dest]
        _cmd(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[src])
        _cmd(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[dest])
        moved = 0
        while keys := _cmd(source, "CLUSTER", "GETKEYSINSLOT", slot, batch):
            port = self.nodes[dest].port
            _cmd(source, "MIGRATE", self.host, port, "", 0, 5000, "REPLACE", "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause_s)
        order = [dest, src, *(i for i in range(len(self.nodes)) if i not in (src, dest))]
        for i in order:
            _cmd(self._admins[i], "CLUSTER", "SETSLOT", slot, "NODE", self.ids[dest])
        return moved

    def _start_node(self) -> EmbeddedServer:
        """One cluster-enabled node; its bus port is chosen apart from its client port.

        ``--cluster-port`` (7.0+) frees the client port from the "port + 10000 <= 65535"
        rule; a bus port lost to another process before the bind is retried.
        """
        for attempt in range(1, _BUS_PORT_ATTEMPTS + 1):
            bus = free_port(self.host)
            # The config file name is relative, so it lands in the node's own private --dir.
            conf = f"nodes-{uuid.uuid4().hex[:12]}.conf"
            cluster_args = ["--cluster-enabled", "yes", "--cluster-port", str(bus)]
            cluster_args += ["--cluster-config-file", conf]
            node = EmbeddedServer(
                binary=self._binary,
                host=self.host,
                extra_args=(*cluster_args, *self._node_args),
            )
            try:
                node.start()
                self._bus_ports.append(bus)
                return node
            except BrokerUnavailable as exc:
                if attempt == _BUS_PORT_ATTEMPTS or "bind" not in str(exc).lower():
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _port_index(self, port: int) -> int:
        return [n.port for n in self.nodes].index(port)

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        while True:
            states = [_info(a) for a in self._admins]
            if all(_is_ok(s, len(self.nodes)) for s in states):
                return
            if time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"local cluster not ok after {self._ready_timeout_s:g}s: {states}"
                )
            time.sleep(0.05)  # polling gossip convergence; nothing to wait on instead

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalCluster({self.url}, running={[n.running for n in self.nodes]})"


def _cmd(client: redis.Redis, *args: object) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]  # untyped in redis-py


def _info(admin: redis.Redis) -> dict[str, str]:
    try:
        raw: Any = _cmd(admin, "CLUSTER", "INFO")
    except redis.RedisError as exc:
        return {"error": str(exc)}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: v.strip() for k, v in pairs}


def _is_ok(state: dict[str, str], masters: int) -> bool:
    return (
        state.get("cluster_state") == "ok"
        and state.get("cluster_known_nodes") == str(masters)
        and state.get("cluster_slots_ok") == str(REDIS_CLUSTER_HASH_SLOTS)
    )
