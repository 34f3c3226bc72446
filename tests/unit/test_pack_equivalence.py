"""The rank's C write packer (``workers/pipeline/_pack.c``) against the Python path.

For any batch the read loop writes (ack ids, the reports that rode with it, the next read
or none), ``Reporter`` either packs it in C or, handed back None, builds the commands in
Python; the C bytes must equal hiredis' packing of those commands, byte for byte. And it
does pack every plain batch, so the fast path is not vacuous. Without the extension built
these skip, except under ``CI``, which must build it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import hiredis
import pytest
import redis
from helpers import optional_extension
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.transport.lean import Command, LeanLink
from broker_lookup.transport.lease import Lease
from workers.pipeline.clock import ServerClock
from workers.pipeline.reader import Reader
from workers.pipeline.reporter import Report, Reporter, Served

_I64 = 2**63


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return optional_extension("workers.pipeline._pack")


class _PythonLink:
    """A link that is no LeanLink: the reporter builds the commands in Python."""

    def __init__(self) -> None:
        self.wire: list[Command] = []

    reading = False

    def call(self, commands: Sequence[Command], read: Command | None = None) -> list[Any]:
        self.wire = [*commands, *([read] if read is not None else [])]
        return []

    def take_read(self) -> Any:
        raise AssertionError("not read here")

    def settle_read(self) -> None:
        pass

    def close(self) -> None:
        pass


class _PackedLink(LeanLink):
    """A LeanLink that takes packed bytes and records them (no connection is made)."""

    def __init__(self) -> None:
        super().__init__(redis.ConnectionPool())
        self.data: bytes | None = None
        self.read: bool | None = None
        self.fell_back = False
        self.accepts_packed = True

    def call_packed(self, data: bytes, n: int, read: bool) -> list[Any]:
        self.data, self.read = data, read
        return []

    def call(self, commands: Sequence[Command], read: Command | None = None) -> list[Any]:
        self.fell_back = True
        return []


def _reporter(**fields: Any) -> Reporter:
    def no_connection() -> Any:  # the thread is never started here
        raise AssertionError("no connection expected")

    return Reporter(LookupConfig(**fields), KeySpace("e:1"), 3, no_connection, lambda r, a: None)


def _python_bytes(reporter: Reporter, served: Served, read: Command | None) -> bytes:
    link = _PythonLink()
    reporter._write(link, served, read)
    return b"".join(hiredis.pack_command(tuple(c)) for c in link.wire)  # type: ignore[arg-type]


def _packed(reporter: Reporter, served: Served, read: Command | None) -> _PackedLink:
    link = _PackedLink()
    reporter._write(link, served, read)
    return link


def _plain(report: Report) -> bool:
    """Whether the C packer takes ``report``: a final report of 64-bit values, a UTF-8 id."""
    try:
        report.lookup_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not report.progress and all(-_I64 <= v < _I64 for v in (report.gen, report.hits))


_ints = st.one_of(st.integers(-5, 10**6), st.integers(-(2**64), 2**64))
_ids = st.one_of(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20),
    st.text(min_size=0, max_size=40),  # spaces, non-ASCII, braces, surrogates: digest keys
    st.just("x" * 300),
)
_reports = st.builds(Report, _ids, _ints, _ints, st.booleans())
_ack_ids = st.lists(st.binary(min_size=1, max_size=24), max_size=5)


def _read(kind: str) -> Command | None:
    reader = Reader(LookupConfig(), KeySpace("e:1"), 3, ServerClock(), None)
    if kind == "none":
        return None
    reader._next_replay = float("inf") if kind == "block" else 0.0
    return reader.read_command()


@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ack_ids=_ack_ids,
    reports=st.lists(_reports, max_size=4),
    read=st.sampled_from(["block", "replay", "none"]),
)
def test_the_packed_write_is_the_python_paths_bytes(
    native: ModuleType, ack_ids: list[bytes], reports: list[Report], read: str
) -> None:
    reporter = _reporter()
    served = Served(reports, ack_ids, [])
    command = _read(read)
    link = _packed(reporter, served, command)
    if all(_plain(r) for r in reports):
        assert not link.fell_back, "a plain batch must be packed in C"
        assert link.data == _python_bytes(reporter, served, command)
        assert link.read is (command is not None)
    else:
        assert link.fell_back and link.data is None


@pytest.mark.parametrize(
    "fields", [{}, {"done_maxlen": 1}, {"key_grace_ms": 0}, {"key_grace_ms": 86_400_000}]
)
def test_the_fixed_parts_follow_the_config(native: ModuleType, fields: dict[str, Any]) -> None:
    reporter = _reporter(**fields)
    served = Served([Report("req-1", 2, 16), Report("a b", 0, 0)], [b"1-1", b"2-0"], [])
    link = _packed(reporter, served, _read("block"))
    assert link.data == _python_bytes(reporter, served, _read("block"))


def test_the_fenced_write_follows_the_lease_token(native: ModuleType) -> None:
    keys = KeySpace("e:1")
    lease = Lease(keys, "3", "rank 3", 2000, 60_000)
    reporter = Reporter(LookupConfig(), keys, 3, _no_connection, lambda r, a: None, lease)
    served = Served([Report("req-1", 2, 16), Report("a b", 0, 0)], [b"1-1"], [])
    for token in ("1.aaaa", "2.bbbb", None):  # claimed, taken over after a lapse, lost
        lease.token = token
        link = _packed(reporter, served, _read("block"))
        assert not link.fell_back
        assert link.data == _python_bytes(reporter, served, _read("block"))
        # report.lua's KEYS[3] and ARGV[7]: the lease key and the token held ("" when none).
        key, held = keys.owner("3"), token or ""
        assert link.data is not None and b"*13\r\n$7\r\nEVALSHA\r\n" in link.data
        assert f"${len(key)}\r\n{key}\r\n".encode() in link.data
        assert f"${len(held)}\r\n{held}\r\n".encode() in link.data


def _no_connection() -> Any:
    raise AssertionError("no connection expected")


def test_dead_letters_and_other_links_take_the_python_path(native: ModuleType) -> None:
    reporter = _reporter()
    dead: list[Command] = [("XADD", "bl:{e:1}:dead", "*", "reason", "bad")]
    link = _packed(reporter, Served([Report("a", 1, 1)], [b"1-0"], dead), None)
    assert link.fell_back and link.data is None


def test_an_unpacking_link_takes_the_python_path(native: ModuleType) -> None:
    reporter = _reporter()
    link = _PythonLink()
    reporter._write(link, Served([Report("a", 1, 1)], [b"1-0"], []), None)
    assert [c[0] for c in link.wire] == ["XACK", "EVALSHA"]


def test_the_packer_refuses_a_bad_construction_by_field(native: ModuleType) -> None:
    packer = native.Packer
    good: dict[str, Any] = {
        "stream": "s",
        "group": "g",
        "sha": "0" * 40,
        "done_key": "d",
        "rank": 0,
        "done_maxlen": 1,
        "done_ttl_ms": 1,
        "key_of": str,
    }
    with pytest.raises(TypeError, match="key_of"):
        packer(**{**good, "key_of": 1})
    with pytest.raises(TypeError, match="argument 5 must be int"):  # rank
        packer(**{**good, "rank": "0"})
    assert packer(**good).pack([], [], None) == b""
