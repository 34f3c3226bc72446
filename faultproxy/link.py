"""One connection through the :class:`~faultproxy.FaultProxy`: two sockets.

A :class:`Link` pairs the socket a client opened to the proxy with the proxy's socket to
the server. Each direction is a :class:`Pipe`: a RESP framer plus a queue of byte chunks,
each due at a time (now, or later under ``delay``). Complete frames are forwarded
unchanged; the link keeps the FIFO of commands awaiting a reply, which is how it finds
the reply that ``lose_reply`` marked. The proxy's selector thread is the only one that
touches a link.
"""

from __future__ import annotations

import selectors
import socket
from collections import deque
from collections.abc import Callable

from faultproxy.resp_frames import Frame, FrameParser, RespError

__all__ = ["QUEUE_LIMIT", "Link", "Pipe"]

#: Bytes queued toward one side before the proxy stops reading the other, so that TCP's
#: own backpressure reaches the sender and memory stays bounded.
QUEUE_LIMIT = 8 * 1024 * 1024
#: After these commands replies no longer pair with commands (pub/sub sends many, RESP3
#: sends them as pushes): the link then forwards raw bytes and loses no reply.
_UNTRACKED_COMMANDS = frozenset({"SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "MONITOR"})
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE

#: Decides, under the proxy's lock, which of a batch of commands lose their reply: for
#: each, None (delivered) or the ``then`` of the matching ``lose_reply``.
Marker = Callable[[list[Frame]], list[str | None]]


class Pipe:
    """One direction of a link: what was read from one side, framed, queued for the other."""

    __slots__ = ("parser", "queue", "queued")

    def __init__(self, capture: int) -> None:
        self.parser = FrameParser(capture)
        self.queue: deque[tuple[float, memoryview]] = deque()  # (due time, bytes)
        self.queued = 0

    def push(self, data: bytes, due: float) -> None:
        """Queue ``data`` to be sent from monotonic time ``due`` on."""
        if data:
            self.queue.append((due, memoryview(data)))
            self.queued += len(data)

    def drop(self) -> None:
        """Forget everything queued (its destination is gone)."""
        self.queue.clear()
        self.queued = 0

    def next_due(self) -> float | None:
        """When the first queued chunk is due, or None if nothing is queued."""
        return self.queue[0][0] if self.queue else None

    def undelay(self) -> None:
        """Make every queued chunk due now (``delay(0)`` ends the latency of those too)."""
        self.queue = deque((0.0, view) for _, view in self.queue)

    def pump(self, sock: socket.socket, now: float) -> bool:
        """Send every chunk due by ``now``; True if some stay unsent (the socket is full).

        Raises:
            OSError: The socket is broken; the caller aborts the link.
        """
        queue = self.queue
        while queue and queue[0][0] <= now:
            due, view = queue[0]
            try:
                sent = sock.send(view)
            except BlockingIOError:
                return True
            self.queued -= sent
            if sent < len(view):
                queue[0] = (due, view[sent:])
                return True
            queue.popleft()
        return False


class Link:
    """A client's connection and the proxy's connection to the server on its behalf.

    Attributes:
        up: Client to server: commands (their name and first argument are captured).
        down: Server to client: replies.
        fifo: The commands awaiting a reply, oldest first: (name, None or the ``then``
            of a lost reply).
        lost: None, or the ``then`` of the reply lost on this link: "reset" (the client
            is reset once the replies before it are out) or "hold" (it hears nothing more).
    """

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.up = Pipe(capture=2)
        self.down = Pipe(capture=0)
        self.fifo: deque[tuple[str, str | None]] = deque()
        self.connected = False  # the upstream connect has completed
        self.client_open = self.upstream_open = True
        self.untracked = False
        self.in_multi = False  # between MULTI and EXEC or DISCARD
        self.multi_then: str | None = None  # a lost reply of a queued command, for EXEC's
        self.lost: str | None = None
        self.masks = [0, 0]  # selector interest registered for (client, upstream)
        self.blocked = [False, False]  # a due chunk toward (client, upstream) is unsent

    def client_events(self, held: bool) -> int:
        """The selector events to wait for on the client socket (0: none)."""
        if held or not self.client_open:
            return 0
        # A hung link (lost "hold") is read only to notice the client giving up.
        reading = self.lost == "hold" or (
            self.lost is None
            and self.connected
            and self.upstream_open
            and self.up.queued < QUEUE_LIMIT
        )
        return (_READ if reading else 0) | (_WRITE if self.blocked[0] else 0)

    def upstream_events(self, held: bool) -> int:
        """The selector events to wait for on the upstream socket (0: none)."""
        if not self.upstream_open:
            return 0
        if not self.connected:
            return _WRITE  # the connect's completion
        if held:
            return 0
        reading = self.down.queued < QUEUE_LIMIT
        return (_READ if reading else 0) | (_WRITE if self.blocked[1] else 0)

    def from_client(self, data: bytes, due: float, mark: Marker) -> None:
        """Queue the complete commands in ``data`` for the server, noting each in the FIFO."""
        if self.lost == "hold":  # a hung connection: what the client sends goes nowhere
            return
        if self.untracked:
            self.up.push(data, due)
            return
        try:
            frames = self.up.parser.feed(data)
        except RespError:
            self._untrack(due)
            return
        if not frames:  # the start of a command only: it waits for the rest
            return
        names = [frame.name for frame in frames]
        if _UNTRACKED_COMMANDS.intersection(names):
            self._untrack(due)
            return
        for name, then in zip(names, mark(frames), strict=True):
            self._expect_reply(name, then)
        self.up.push(self.up.parser.take(self.up.parser.complete), due)

    def _expect_reply(self, name: str, then: str | None) -> None:
        """Append a command to the FIFO; inside MULTI a lost reply moves to EXEC's."""
        if name == "MULTI":
            self.in_multi = True
            self.multi_then = None
        elif self.in_multi:
            if name in ("EXEC", "DISCARD"):
                self.in_multi = False
                if name == "EXEC":
                    then = then or self.multi_then
            elif then is not None:
                # A queued command runs at EXEC and its result is in EXEC's reply: losing
                # "+QUEUED" would lose nothing the command did.
                self.multi_then = then
                then = None
        self.fifo.append((name, then))

    def from_server(self, data: bytes, due: float) -> tuple[int, bool]:
        """Queue the replies in ``data`` for the client, up to a lost one.

        Returns:
            (replies seen, pushes excepted; whether one of them was the lost reply).
        """
        if self.lost is not None or not self.client_open:
            return 0, False  # nobody hears this any more: read only to keep the server moving
        if self.untracked:
            self.down.push(data, due)
            return 0, False
        parser = self.down.parser
        try:
            frames = parser.feed(data)
        except RespError:
            self._untrack(due)
            return 0, False
        forward = replies = 0
        for frame in frames:
            if not frame.push:  # a push answers no command
                replies += 1
                then = self.fifo.popleft()[1] if self.fifo else None
                if then is not None:
                    self.down.push(parser.take(forward), due)
                    parser.take(frame.size)  # the reply is lost; nothing after it is delivered
                    self.lost = then
                    return replies, True
            forward += frame.size
        self.down.push(parser.take(forward), due)
        return replies, False

    def _untrack(self, due: float) -> None:
        """Stop framing: forward raw bytes both ways from now on (no reply can be lost)."""
        self.untracked = True
        self.fifo.clear()
        self.up.push(self.up.parser.take_all(), due)
        self.down.push(self.down.parser.take_all(), due)
