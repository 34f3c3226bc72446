"""``python -m benchmarks.bench --floor``: what the protocol alone costs, without our client
or ranks.

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

The *native floor* is the same rank with its turn in C (``_native_floor.c``, an optional
extension): the socket's reads and writes, the replies' framing and the commands' packing
run with no Python between the wake-up and the write but the request's decoding and the
report's arguments (:class:`_Answer`, shared with the Python floor). So it says what a
native rank turn could cost on this machine. The scheduler side is the floor's for both.

``python -m benchmarks.bench.floor --redis-url URL --engine E:4 [--native]`` serves
the floor's ranks (one process each, forked from one host: ``rank_host``); the client,
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

from benchmarks.bench.measure import BenchError
from benchmarks.bench.rank_host import RankSpec, host_parser, ready, run_host
from broker_lookup.processes import ExitCode
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import LookupRequest, decode_completions, decode_request
from broker_lookup.protocol.scripts import report_call, submit_call
from broker_lookup.transport.link import stream_entries
from broker_lookup.transport.script_runner import ScriptSet

__all__ = ["FloorClient", "main"]

logger = logging.getLogger(__name__)

_BLOCK_MS = 200  #: every blocking read returns this often, so a stop is seen
_BATCH = 64
_TTL_MS = 60_000  #: the lookup hash's TTL, the heartbeat's, the streams': longer than any run
_DONE_MAXLEN = 10_000
_STREAM_MAXLEN = 100_000
_BUDGET_MS = 5_000
#: hiredis' packer (its stub types the argument as a 1-tuple; it takes any).
_pack: Any = hiredis.pack_command


class _Wire:
    """One raw socket to Redis with hiredis' reader: the least a hot loop can do."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.sock = socket.create_connection((parsed.hostname or "localhost", parsed.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = hiredis.Reader()

    def send(self, commands: list[Command]) -> None:
        self.sock.sendall(b"".join(_pack(tuple(c)) for c in commands))

    def reply(self) -> Any:
        """The next reply, waiting for it; an error reply is returned as a value."""
        while True:
            reply = self._reader.gets()
            if reply is not False:
                return reply
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("Redis closed the connection")
            self._reader.feed(data)

    def ready(self) -> bool:
        """Whether a reply can be read without waiting."""
        if self._reader.has_data():
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def close(self) -> None:
        self.sock.close()


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
            engine_ttl_ms=_TTL_MS,
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
                for event in decode_completions(fields or {}).events:
                    results[event.lookup_id] = event.result


def _join(url: str, keys: KeySpace, rank: int) -> ScriptSet:
    """Load the scripts, create the rank's group and its heartbeat (the bench waits for it)."""
    scripts = ScriptSet()
    admin = redis.Redis.from_url(url)
    try:
        scripts.load(admin)
        try:
            admin.xgroup_create(keys.requests, keys.group(rank), id="$", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        admin.pexpire(keys.requests, _TTL_MS)  # MKSTREAM: nothing is left without a TTL
        admin.set(keys.heartbeat(rank), "floor", px=_TTL_MS)
    finally:
        admin.close()
    return scripts


class _Answer:
    """A floor rank's answer to one entry: ``fraction`` of its chunks hit, as ``report.lua``."""

    def __init__(self, keys: KeySpace, scripts: ScriptSet, rank: int, fraction: float) -> None:
        self._keys = keys
        self._scripts = scripts
        self._rank = rank
        self._fraction = fraction
        self._chunk = ChunkedTokenHasher().chunk_size

    def report(self, fields: dict[bytes, bytes] | None) -> Command | None:
        """The report's EVALSHA for a lookup entry; None for an abort or a keep."""
        msg = decode_request(fields)
        if type(msg) is not LookupRequest:
            return None
        call = report_call(
            self._keys,
            msg.lookup_id,
            rank=self._rank,
            gen=msg.gen,
            hits=int(len(msg.offsets) * self._fraction) * self._chunk,
            done_maxlen=_DONE_MAXLEN,
            engine_ttl_ms=_TTL_MS,
        )
        return self._scripts.command(call)

    def native(self, entry_id: bytes, m: bytes) -> Command | None:
        """:meth:`report` in ``_native_floor.turn``'s shape (it hands over ``m`` alone)."""
        return self.report({b"m": m})


def _read(keys: KeySpace, rank: int) -> Command:
    head = ("XREADGROUP", "GROUP", keys.group(rank), keys.consumer(rank), "COUNT", _BATCH)
    return (*head, "BLOCK", _BLOCK_MS, "STREAMS", keys.requests, ">")


def _serve_floor_rank(url: str, fraction: float, spec: RankSpec, stop: threading.Event) -> int:
    """One rank of the floor: read, answer ``fraction`` of the prompt, report, ack."""
    keys = KeySpace(spec.engine_id)
    answer = _Answer(keys, _join(url, keys, spec.rank), spec.rank, fraction)
    group = keys.group(spec.rank)
    wire = _Wire(url)
    read = _read(keys, spec.rank)
    ready(spec)
    try:
        wire.send([read])
        while not stop.is_set():
            entries = stream_entries(wire.reply())
            commands: list[Command] = []
            if entries:
                commands.append(("XACK", keys.requests, group, *[e for e, _ in entries]))
            for _, fields in entries:
                report = answer.report(fields)
                if report is not None:
                    commands.append(report)
            wire.send([*commands, read])
            for _ in commands:
                wire.reply()
        return ExitCode.OK
    finally:
        wire.close()


def _serve_native_rank(url: str, fraction: float, spec: RankSpec, stop: threading.Event) -> int:
    """One rank of the native floor: the same turn, its I/O, framing and packing in C."""
    from benchmarks.bench import _native_floor

    keys = KeySpace(spec.engine_id)
    answer = _Answer(keys, _join(url, keys, spec.rank), spec.rank, fraction)
    ack_head = ("XACK", keys.requests, keys.group(spec.rank))
    read = _pack(_read(keys, spec.rank))
    wire = _Wire(url)
    pending = bytearray()
    # A turn returns at least once a BLOCK, so a stop is seen; a reply never comes later
    # than that plus the server's own work.
    timeout_ms = 10 * _BLOCK_MS
    ready(spec)
    try:
        wire.sock.sendall(read)
        while not stop.is_set():
            _native_floor.turn(
                wire.sock.fileno(), timeout_ms, pending, read, ack_head, answer.native
            )
        return ExitCode.OK
    finally:
        wire.close()


def native_floor_built() -> bool:
    """Whether the native floor's C extension was compiled (it is optional)."""
    try:
        from benchmarks.bench import _native_floor  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Serve the floor's ranks until SIGTERM (``--native``: the native floor's)."""
    p = host_parser("python -m benchmarks.bench.floor", __doc__)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--native", action="store_true", help="the turn in C (_native_floor)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    serve = _serve_native_rank if args.native else _serve_floor_rank
    return run_host(
        args.engine, lambda spec, stop: serve(args.redis_url, args.hit_fraction, spec, stop)
    )


if __name__ == "__main__":
    sys.exit(main())
