"""Stub of the optional C extension (``_native_floor.c``): the floor's rank turn in C."""

from collections.abc import Callable, Sequence

Arg = bytes | str | int

def turn(
    fd: int,
    timeout_ms: int,
    pending: bytearray,
    read: bytes,
    ack_head: tuple[Arg, ...],
    answer: Callable[[bytes, bytes], Sequence[Arg | float] | None],
    /,
) -> int:
    """One rank turn on the connected socket ``fd``: wait for the reply at the front of
    ``pending`` (reading more into it), call ``answer(entry_id, m)`` for each entry, write
    ``ack_head`` + every entry id (the XACK), the commands ``answer`` returned and ``read``
    at once, read the XACK's and the commands' replies; returns the entries read.

    ``answer`` returns a tuple of bytes, str and int, or None; anything else raises
    TypeError. Raises TimeoutError after ``timeout_ms`` without a byte, ConnectionError when the
    server closes or resets the connection, ValueError on bytes that are not RESP2."""
