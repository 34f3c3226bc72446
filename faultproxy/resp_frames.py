"""Incremental framing of RESP2/RESP3 byte streams, for tools that watch Redis traffic.

:class:`FrameParser` says where each top-level frame (a command, a reply, a push) ends in
a stream that arrives in arbitrary pieces. It decodes nothing but the lengths it needs
and, for commands, the first few arguments, so a proxy can forward the bytes unchanged
and still know which reply answers which command. Parsing resumes where the previous
piece ended: a large reply that arrives in many pieces is scanned once, not once a piece.

Used by :mod:`faultproxy.proxy`; the client and worker runtime never import it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Frame", "FrameParser", "RespError"]

_CRLF = b"\r\n"
#: Simple types whose whole value is the header line: + - : _ , # (
_LINE_TYPES = frozenset(b"+-:_,#(")
#: Blob types: a length line, then that many bytes and CRLF: $ ! =
_BLOB_TYPES = frozenset(b"$!=")
#: Aggregates and how many values each counted element stands for: * ~ > %
_AGGREGATES = {ord("*"): 1, ord("~"): 1, ord(">"): 1, ord("%"): 2}
_ATTRIBUTE = ord("|")
_PUSH = ord(">")
#: A header line longer than this is not RESP (an inline command, a stray protocol):
#: failing beats buffering a stream that will never frame.
_MAX_HEADER = 64 * 1024


class RespError(ValueError):
    """The stream is not RESP2/RESP3 (an inline command, a streamed string): it cannot be framed."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One complete top-level frame of the stream.

    Attributes:
        size: Its length in bytes, attributes (``|``) before it included.
        push: True for a RESP3 out-of-band push (``>``): no command's reply.
        args: The leading blob strings of a top-level array, up to the parser's
            ``capture`` (for a command: its name and first arguments).
    """

    size: int
    push: bool = False
    args: tuple[bytes, ...] = ()

    @property
    def name(self) -> str:
        """The upper-cased first argument (a command's name), or "" if none was captured."""
        return self.args[0].decode("latin-1").upper() if self.args else ""


class FrameParser:
    """Finds frame boundaries in one direction of a RESP connection, piece by piece.

    Feed it the bytes as they arrive; it keeps them until :meth:`take` hands back those of
    complete frames, so the caller forwards exactly the frames it decides to forward.

    Args:
        capture: How many leading blob strings of a top-level array to keep in
            :attr:`Frame.args` (2 for commands: the name and, say, an EVALSHA's sha).
    """

    def __init__(self, capture: int = 0) -> None:
        self._capture = capture
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # the next byte to parse
        self._start = 0  # where the frame being parsed begins
        self._blob = -1  # the payload length of the blob being read, -1 between blobs
        self._stack: list[list[int]] = []  # open aggregates: [values left, 1 if attribute]
        self._push = False
        self._args: list[bytes] = []

    @property
    def complete(self) -> int:
        """Bytes of complete frames not yet taken."""
        return self._start

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data`` and return every frame it completes, in stream order.

        Raises:
            RespError: The stream is not RESP; the parser is then unusable.
        """
        self._buf += data
        frames: list[Frame] = []
        while (frame := self._next_frame()) is not None:
            frames.append(frame)
        return frames

    def take(self, nbytes: int) -> bytes:
        """Remove and return the first ``nbytes`` bytes, which must be complete frames."""
        if not 0 <= nbytes <= self._start:
            raise ValueError(f"take({nbytes}): only {self._start} bytes of complete frames")
        chunk = bytes(self._buf[:nbytes])
        # Deleting a bytearray's head is cheap in CPython (it moves the start), so a
        # partial frame left behind is not copied on every take.
        del self._buf[:nbytes]
        self._pos -= nbytes
        self._start -= nbytes
        return chunk

    def take_all(self) -> bytes:
        """Remove and return every byte held, a partial frame included, and start afresh."""
        chunk = bytes(self._buf)
        self._reset()
        return chunk

    def _next_frame(self) -> Frame | None:
        """Parse values until a top-level frame completes (it) or the bytes run out (None)."""
        buf = self._buf
        while True:
            if self._blob >= 0:
                end = self._pos + self._blob
                if len(buf) < end + 2:
                    return None
                if self._capturing():
                    self._args.append(bytes(buf[self._pos : end]))
                self._pos = end + 2  # past the blob's CRLF
                self._blob = -1
                done = self._value_done()
            else:
                eol = buf.find(_CRLF, self._pos)
                if eol < 0:
                    if len(buf) - self._pos > _MAX_HEADER:
                        raise RespError("no CRLF within a header's length")
                    return None
                done = self._header(buf[self._pos], eol)
            if done:
                return self._emit()

    def _header(self, kind: int, eol: int) -> bool:
        """Consume the header line ``buf[pos:eol]``; True if it ends the top-level frame."""
        first = self._pos + 1
        self._pos = eol + 2
        if kind in _LINE_TYPES:
            return self._value_done()
        count = self._count(first, eol)
        if kind in _BLOB_TYPES:
            if count < 0:  # $-1: the RESP2 null bulk string
                return self._value_done()
            self._blob = count
            return False
        if kind == _ATTRIBUTE:
            if count > 0:
                self._stack.append([2 * count, 1])
            return False
        per_element = _AGGREGATES.get(kind)
        if per_element is None:
            raise RespError(f"not a RESP type byte: {bytes([kind])!r}")
        if not self._stack and kind == _PUSH:
            self._push = True
        if count <= 0:  # *-1 (the RESP2 null array) or an empty aggregate
            return self._value_done()
        self._stack.append([count * per_element, 0])
        return False

    def _count(self, first: int, eol: int) -> int:
        try:
            return int(self._buf[first:eol])
        except ValueError:
            # "$?" and "*?" (RESP3 streamed types) land here: no server sends them.
            raise RespError(f"bad length {bytes(self._buf[first:eol])!r}") from None

    def _value_done(self) -> bool:
        """Count one finished value against the open aggregates; True if the frame is done."""
        stack = self._stack
        while stack:
            top = stack[-1]
            top[0] -= 1
            if top[0]:
                return False
            stack.pop()
            if top[1]:  # an attribute annotates the value after it and is not one itself
                return False
        return True

    def _capturing(self) -> bool:
        return (
            len(self._stack) == 1
            and not self._push
            and not self._stack[0][1]
            and len(self._args) < self._capture
        )

    def _emit(self) -> Frame:
        frame = Frame(self._pos - self._start, self._push, tuple(self._args))
        self._start = self._pos  # the next frame begins where this one ended
        self._push = False
        self._args = []
        return frame
