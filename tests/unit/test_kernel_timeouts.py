"""A hot loop's socket timeout kept by the kernel: what :func:`kernel_timeouts` makes of a
socket (the reads and writes it times out are tested through the fault proxy, in
``tests/system/test_lean_reset.py``)."""

from __future__ import annotations

import socket
import struct

import pytest

from broker_lookup.transport.redis_internals import kernel_timeouts

#: The kernel keeps a socket timeout in clock ticks (1-10 ms): it reads back rounded up.
_TICK_US = 10_000


def _kernel_us(sock: socket.socket, option: int) -> int:
    seconds, micros = struct.unpack("@ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
    return int(seconds) * 1_000_000 + int(micros)


@pytest.mark.parametrize("timeout", [30.0, 2.25, 0.05, 1e-7])
def test_the_timeout_moves_to_the_kernel(timeout: float) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(timeout)
        kernel_timeouts(a)
        assert a.gettimeout() is None and a.getblocking()
        wanted = round(timeout * 1_000_000)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            # Never zero, not even for a timeout under 1 µs: zero is no timeout at all.
            assert max(wanted, 1) <= _kernel_us(a, option) < wanted + _TICK_US
        before = _kernel_us(a, socket.SO_RCVTIMEO)
        kernel_timeouts(a)  # again: nothing changes
        assert _kernel_us(a, socket.SO_RCVTIMEO) == before
        if timeout < 1:
            with pytest.raises(BlockingIOError):  # what a read past the timeout raises now
                a.recv(1)


def test_sockets_without_a_timeout_are_left_as_they_are() -> None:
    a, b = socket.socketpair()
    with a, b:
        kernel_timeouts(a)  # blocking, no timeout
        assert a.gettimeout() is None and _kernel_us(a, socket.SO_RCVTIMEO) == 0
        b.setblocking(False)
        kernel_timeouts(b)  # non-blocking
        assert b.gettimeout() == 0.0 and _kernel_us(b, socket.SO_RCVTIMEO) == 0
