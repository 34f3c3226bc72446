"""``broker-lookup bench --floor``: what the protocol alone costs, without our client or ranks.

The floor runs the same lookup over the same Redis: the same hashing, the same wire
messages, the same ``submit.lua`` and ``report.lua`` and the same commands per lookup
(a rank's reports, XACK and next XREADGROUP in one write; a completion read from the done
stream with ``XREAD BLOCK``). It leaves out everything that makes ours correct under
failure: no generations, pins, watchdog, breaker, retries, reconnects, reconciliation,
validation, dead letters, heartbeats after the first, counters or histograms.

So its figures bound what any Python implementation of this protocol can reach on this
machine, and the gap between the floor and LMCache is the price of the broker's two
hops, not of our code. Nothing here is safe to deploy: a lost reply or a dead rank hangs
it. It is tooling, like the rest of the bench.

``python -m broker_lookup.tools.bench.floor --redis-url URL --engine E:4`` serves the
floor's ranks (one process each, forked from one host: ``rank_host``); the client,
:class:`FloorClient`, runs in the bench's process and is driven by the same loops as
ours and LMCache's (``measure.sequential_latency``).
"""

from __future__ import annotations

import logging
import select
import socket
import sys
import threading
import time
from typing import Any
from urllib.parse import urlparse

import hiredis
import redis

from broker_lookup.processes import ExitCode
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import LookupRequest, decode_done, decode_request
from broker_lookup.protocol.scripts import ScriptSet, report_call, submit_call
from broker_lookup.tools.bench.measure import BenchError
from broker_lookup.tools.bench.rank_host import RankSpec, host_parser, ready, run_host
from broker_lookup.transport.lean import Command, stream_entries

__all__ = ["FloorClient", "main"]

logger = logging.getLogger(__name__)

_BLOCK_MS = 200  #: every blocking read returns this often, so a stop is seen
_BATCH = 64
_TTL_MS = 60_000  #: the lookup hash's TTL and the heartbeat's: longer than any run
_DONE_MAXLEN = 10_000
_STREAM_MAXLEN = 100_000
_BUDGET_MS = 5_000
#: hiredis' packer (its stub types the argument as a 1-tuple; it takes any).
_pack: Any = hiredis.pack_command


class _Wire:
    """One raw socket to Redis with hiredis' reader: the least a hot loop can do."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self._sock = socket.create_connection((parsed.hostname or "localhost", parsed.port or 6379))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = hiredis.Reader()

    def send(self, commands: list[Command]) -> None:
        self._sock.sendall(b"".join(_pack(tuple(c)) for c in commands))

    def reply(self) -> Any:
        """The next reply, waiting for it; an error reply is returned as a value."""
        while True:
            reply = self._reader.gets()
            if reply is not False:
                return reply
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("Redis closed the connection")
            self._reader.feed(data)

    def ready(self) -> bool:
        """Whether a reply can be read without waiting."""
        if self._reader.has_data():
            return True
        return bool(select.select([self._sock], [], [], 0)[0])

    def close(self) -> None:
        self._sock.close()


class FloorClient:
    """The protocol's scheduler side, bare: ``lookup`` writes ``submit.lua`` from the
    caller's thread (its reply read at the next call, when it is there), one thread
    reads completions into a dict, ``lookup_cache`` reads the dict.

    The dict holds every completion until :meth:`clear_lookup_status`, as the bench's
    loops call it for each id; nothing else bounds it (tooling, not a client to deploy).
    """

    def __init__(self, url: str, engine_id: str, world: int) -> None:
        self._keys = KeySpace(engine_id)
        self._expected = list(range(world))
        self._expected_text = ",".join(str(r) for r in self._expected)
        self._hasher = ChunkedTokenHasher()
        self._scripts = ScriptSet()
        admin = redis.Redis.from_url(url)
        try:
            self._scripts.load(admin)
            last: Any = admin.xrevrange(self._keys.done, count=1)
        finally:
            admin.close()
        self._last_id: bytes = last[0][0] if last else b"0-0"
        self._submits = _Wire(url)
        self._unread = 0
        self._results: dict[str, int] = {}
        self._stop = threading.Event()
        self._failure: Exception | None = None
        self._listener_wire = _Wire(url)
        self._listener = threading.Thread(target=self._listen, name="floor listener", daemon=True)
        self._listener.start()

    def lookup(
        self, token_ids: list[int], lookup_id: str, request_configs: dict[str, Any] | None = None
    ) -> int | None:
        """Send the lookup; None: poll :meth:`lookup_cache`."""
        while self._unread and self._submits.ready():
            self._submits.reply()
            self._unread -= 1
        hashes, offsets = self._hasher.hashes_and_offsets(token_ids)
        now_ms = int(time.time() * 1000)
        request = LookupRequest(
            lookup_id=lookup_id,
            gen=0,
            hashes=hashes,
            offsets=offsets,
            expected=self._expected,
            deadline_ms=now_ms + _BUDGET_MS,
            request_configs=request_configs,
            tokens=sum(offsets),
            budget_ms=_BUDGET_MS,
        )
        call = submit_call(
            self._keys,
            request,
            expected=self._expected_text,
            created_ms=now_ms,
            ttl_ms=_TTL_MS,
            maxlen=_STREAM_MAXLEN,
        )
        self._submits.send([self._scripts.command(call)])
        self._unread += 1
        return None

    def lookup_cache(self, lookup_id: str) -> int | None:
        """The result once its completion was read, else None.

        Raises:
            BenchError: the listener thread failed, so nothing will be answered.
        """
        if self._failure is not None:
            raise BenchError(f"the floor's listener failed: {self._failure!r}")
        return self._results.get(lookup_id)

    def clear_lookup_status(self, lookup_id: str) -> None:
        """Forget ``lookup_id``'s result."""
        self._results.pop(lookup_id, None)

    def close(self) -> None:
        """Stop the listener (within one BLOCK) and close both sockets."""
        self._stop.set()
        self._listener.join(timeout=5 * _BLOCK_MS / 1000)
        self._listener_wire.close()
        self._submits.close()

    def _listen(self) -> None:
        try:
            self._read_completions()
        except Exception as exc:  # the bench's next poll raises it
            self._failure = exc

    def _read_completions(self) -> None:
        wire = self._listener_wire
        done = self._keys.done
        results = self._results
        while not self._stop.is_set():
            wire.send(
                [("XREAD", "COUNT", 1000, "BLOCK", _BLOCK_MS, "STREAMS", done, self._last_id)]
            )
            for entry_id, fields in stream_entries(wire.reply()):
                self._last_id = entry_id
                event = decode_done(fields or {})
                results[event.lookup_id] = event.result


def _serve_floor_rank(url: str, fraction: float, spec: RankSpec, stop: threading.Event) -> int:
    """One rank of the floor: read, answer ``fraction`` of the prompt, report, ack."""
    keys = KeySpace(spec.engine_id)
    scripts = ScriptSet()
    admin = redis.Redis.from_url(url)
    group = keys.group(spec.rank)
    try:
        scripts.load(admin)
        try:
            admin.xgroup_create(keys.requests, group, id="$", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        admin.set(keys.heartbeat(spec.rank), "floor", px=_TTL_MS)  # the bench waits for it
    finally:
        admin.close()
    wire = _Wire(url)
    chunk = ChunkedTokenHasher().chunk_size
    consumer = keys.consumer(spec.rank)
    head = ("XREADGROUP", "GROUP", group, consumer, "COUNT", _BATCH, "BLOCK", _BLOCK_MS)
    read: Command = (*head, "STREAMS", keys.requests, ">")
    ready(spec)
    try:
        wire.send([read])
        while not stop.is_set():
            entries = stream_entries(wire.reply())
            commands: list[Command] = []
            if entries:
                commands.append(("XACK", keys.requests, group, *[e for e, _ in entries]))
            for _, fields in entries:
                msg = decode_request(fields)
                if type(msg) is not LookupRequest:
                    continue
                hits = int(len(msg.offsets) * fraction) * chunk
                call = report_call(
                    keys,
                    msg.lookup_id,
                    rank=spec.rank,
                    gen=msg.gen,
                    hits=hits,
                    done_maxlen=_DONE_MAXLEN,
                    done_ttl_ms=_TTL_MS,
                )
                commands.append(scripts.command(call))
            wire.send([*commands, read])
            for _ in commands:
                wire.reply()
        return ExitCode.OK
    finally:
        wire.close()


def main(argv: list[str] | None = None) -> int:
    """Serve the floor's ranks until SIGTERM."""
    p = host_parser("python -m broker_lookup.tools.bench.floor", __doc__)
    p.add_argument("--redis-url", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_host(
        args.engine,
        lambda spec, stop: _serve_floor_rank(args.redis_url, args.hit_fraction, spec, stop),
    )


if __name__ == "__main__":
    sys.exit(main())
