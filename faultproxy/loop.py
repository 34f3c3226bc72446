"""The selector thread of :class:`faultproxy.proxy.FaultProxy`.

:class:`ProxyLoop` owns every socket: it accepts, connects upstream without
blocking, reads, frames (:class:`~faultproxy.link.Link`), writes what is
due, and closes. Other threads reach it only through :meth:`ProxyLoop.submit` and
:meth:`ProxyLoop.wake`, so no socket is touched by two threads.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from faultproxy.link import Link
from faultproxy.state import FaultState

__all__ = ["ProxyLoop"]

logger = logging.getLogger("faultproxy.proxy")

T = TypeVar("T")

_CLIENT, _UPSTREAM = 0, 1
_LISTENER, _WAKE = "listener", "wake"
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_RECV_BYTES = 256 * 1024
_IDLE_S = 1.0  # the longest select; every state change wakes the loop anyway
_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN
_CONNECTING = (0, errno.EINPROGRESS, errno.EWOULDBLOCK)


class ProxyLoop:
    """One proxy's sockets and the thread body (:meth:`run`) that serves them.

    Args:
        state: The faults and counters, shared with the public API.
        upstream: The server's (host, port), resolved once here.
        listen: Where to listen; bound and listening when the constructor returns.
    """

    def __init__(
        self, state: FaultState, upstream: tuple[str, int], listen: tuple[str, int]
    ) -> None:
        self._state = state
        info = socket.getaddrinfo(*upstream, type=socket.SOCK_STREAM)[0]
        self._upstream_family = info[0]
        self._upstream_addr = info[4]
        self._listener = socket.create_server(listen, backlog=128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, _READ, _LISTENER)
        self._sel.register(self._wake_r, _READ, _WAKE)
        self._links: set[Link] = set()
        self._calls: deque[tuple[Callable[[ProxyLoop], Any], Future[Any]]] = deque()
        self._stopping = False
        self._closed = False  # under state.lock: no call is taken any more

    # --- for other threads -------------------------------------------------------------

    def wake(self) -> None:
        """Make the loop look at the fault state now."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed (the loop is gone)
            pass

    def stop(self) -> None:
        """Ask :meth:`run` to close everything and return."""
        self._stopping = True
        self.wake()

    def submit(self, action: Callable[[ProxyLoop], T]) -> Future[T]:
        """Run ``action(loop)`` on the loop's thread; the future is cancelled if it stops."""
        future: Future[T] = Future()
        with self._state.lock:
            if self._closed:
                future.cancel()
                return future
            self._calls.append((action, future))
        self.wake()
        return future

    # --- actions run on the loop's thread through submit ---------------------------------

    def reset_all(self) -> int:
        """RST both sides of every connection; returns how many client connections."""
        count = sum(1 for link in self._links if link.client_open)
        for link in list(self._links):
            self._abort(link)
        return count

    def clear_links(self) -> None:
        """Reset the connections a ``then="hold"`` lost reply left hanging; undelay the rest."""
        for link in list(self._links):
            if link.lost == "hold":
                self._abort(link)
        self.undelay()

    def undelay(self) -> None:
        """Make every queued chunk due now."""
        for link in self._links:
            link.up.undelay()
            link.down.undelay()

    # --- the thread ----------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`; every socket is closed when it returns."""
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._timeout()):
                    self._dispatch(key.data, mask)
                self._run_calls()
                with self._state.lock:
                    held = self._state.held
                now = time.monotonic()
                for link in list(self._links):
                    self._service(link, now, held)
        except Exception:
            logger.exception("fault proxy on port %d failed; closing every connection", self.port)
        finally:
            self._shutdown()

    def _timeout(self) -> float:
        """Until the next delayed chunk is due (chunks due now wait for WRITE readiness)."""
        now = time.monotonic()
        soonest = now + _IDLE_S
        for link in self._links:
            for pipe in (link.up, link.down):
                due = pipe.next_due()
                if due is not None and now < due < soonest:
                    soonest = due
        return soonest - now

    def _dispatch(self, data: Any, mask: int) -> None:
        if data == _LISTENER:
            self._accept()
        elif data == _WAKE:
            while True:
                try:
                    if not self._wake_r.recv(4096):
                        return
                except OSError:  # drained (BlockingIOError) or closed
                    return
        else:
            link, side = data
            if link in self._links:  # an earlier event of this batch may have closed it
                self._ready(link, side, mask)

    def _run_calls(self) -> None:
        while True:
            with self._state.lock:
                if not self._calls:
                    return
                action, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(action(self))
                except Exception as exc:  # handed to the waiting caller
                    future.set_exception(exc)

    def _shutdown(self) -> None:
        with self._state.lock:
            self._closed = True
            pending = list(self._calls)
            self._calls.clear()
        for _, future in pending:
            future.cancel()
        for link in list(self._links):
            self._close(link, _CLIENT, rst=False)
            self._close(link, _UPSTREAM, rst=False)
        self._links.clear()
        self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    # --- sockets -------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next readiness retries
                logger.warning("fault proxy on port %d: accept failed: %s", self.port, exc)
                return
            with self._state.lock:
                refusing = self._state.refusing
                self._state.stats["connections"] += 1
                self._state.stats["refused"] += refusing
                self._state.open_clients += not refusing
            if refusing:
                _close_socket(client, rst=True)
            else:
                self._open(client)

    def _open(self, client: socket.socket) -> None:
        """Pair ``client`` with a new upstream socket, whose connect completes later."""
        try:
            upstream = socket.socket(self._upstream_family, socket.SOCK_STREAM)
        except OSError as exc:  # out of descriptors: this client is reset, the proxy lives on
            logger.warning("fault proxy on port %d: no socket to the server: %s", self.port, exc)
            _close_socket(client, rst=True)
            with self._state.lock:
                self._state.open_clients -= 1
                self._state.stats["resets"] += 1
                self._state.stats["upstream_failures"] += 1
            return
        link = Link(client, upstream)
        self._links.add(link)
        try:
            for sock in (client, upstream):
                sock.setblocking(False)
                # Replies are small and latency is what the tests measure: no Nagle.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            result = upstream.connect_ex(self._upstream_addr)
        except OSError as exc:  # the client reset already, say
            result = exc.errno or errno.ECONNABORTED
        link.connected = result == 0
        if result not in _CONNECTING:
            self._state.count(upstream_failures=1)
            self._abort(link)

    def _ready(self, link: Link, side: int, mask: int) -> None:
        if side == _UPSTREAM and not link.connected:
            try:
                failed = link.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            except OSError as exc:
                failed = exc.errno or errno.ECONNABORTED
            if failed:
                self._state.count(upstream_failures=1)
                self._abort(link)  # no server: the client sees its connection reset
            else:
                link.connected = True
        elif mask & _READ:
            self._read(link, side)

    def _read(self, link: Link, side: int) -> None:
        sock = link.client if side == _CLIENT else link.upstream
        try:
            data = sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # a reset on one side is passed on as a reset
            self._abort(link)
            return
        if not data:  # a FIN: the other side drains what is queued for it, then closes
            self._close(link, side, rst=False)
            return
        with self._state.lock:
            due = time.monotonic() + self._state.delay_s
        if side == _CLIENT:
            self._state.count(bytes_up=len(data))
            link.from_client(data, due, self._state.mark)
        else:
            replies, lost = link.from_server(data, due)
            self._state.count(bytes_down=len(data), replies=replies, replies_lost=lost)

    def _service(self, link: Link, now: float, held: bool) -> None:
        """Send what is due, close what is done, and select what to wait for."""
        if not held:
            try:
                if link.client_open:
                    link.blocked[_CLIENT] = link.down.pump(link.client, now)
                if link.upstream_open and link.connected:
                    link.blocked[_UPSTREAM] = link.up.pump(link.upstream, now)
            except OSError:
                self._abort(link)
                return
            self._settle(link)
        if not (link.client_open or link.upstream_open):
            self._links.discard(link)
            return
        self._register(link, _CLIENT, link.client_events(held))
        self._register(link, _UPSTREAM, link.upstream_events(held))

    def _settle(self, link: Link) -> None:
        """Close each side that has nothing left to receive."""
        if link.client_open and not link.down.queue:
            if link.lost == "reset":  # the replies before the lost one are out
                self._close(link, _CLIENT, rst=True)
            elif not link.upstream_open:
                self._close(link, _CLIENT, rst=False)
        if link.upstream_open and not link.client_open and not link.up.queue:
            self._close(link, _UPSTREAM, rst=False)

    def _register(self, link: Link, side: int, mask: int) -> None:
        old = link.masks[side]
        if old == mask:
            return
        sock = link.client if side == _CLIENT else link.upstream
        if not mask:
            self._sel.unregister(sock)
        elif not old:
            self._sel.register(sock, mask, (link, side))
        else:
            self._sel.modify(sock, mask, (link, side))
        link.masks[side] = mask

    def _abort(self, link: Link) -> None:
        """Reset both sides now, dropping whatever is queued."""
        self._close(link, _CLIENT, rst=True)
        self._close(link, _UPSTREAM, rst=True)
        self._links.discard(link)

    def _close(self, link: Link, side: int, *, rst: bool) -> None:
        """Close one side (RST if ``rst``); what was queued toward it is dropped."""
        if not (link.client_open if side == _CLIENT else link.upstream_open):
            return
        self._register(link, side, 0)
        if side == _CLIENT:
            link.client_open = False
            link.down.drop()
            _close_socket(link.client, rst)
            with self._state.lock:
                self._state.open_clients -= 1
                self._state.stats["resets"] += rst
        else:
            link.upstream_open = False
            link.up.drop()
            _close_socket(link.upstream, rst)


def _close_socket(sock: socket.socket, rst: bool) -> None:
    """Close ``sock``; with ``rst`` by an RST (SO_LINGER 0), as a connection lost in the network."""
    if rst:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        except OSError:  # already broken: a plain close is all there is
            pass
    sock.close()
