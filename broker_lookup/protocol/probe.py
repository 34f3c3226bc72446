"""Wire format of the fleet query: a probe every rank of an engine answers.

Probe entry (``bl:{E}:probes``), written by :class:`broker_lookup.FleetClient`; ranks read
the stream with plain XREAD (no consumer group: a probe nobody answered is only a slower
answer, never a lost lookup)::

    type   "probe" | "reserve"                      readable copy for redis-cli
    q      query id                                 readable copy
    chunks number of chunks                         readable copy
    m      msgpack of :class:`Probe` | :class:`Reserve` (tagged): the only field decoded

A reserve asks the ranks of the engine a router chose to pin the prefix they hold for
``reserve_ms``, or until the engine's own lookup of the prompt arrives; its answer is the
prefix each rank pinned.

Answer (``bl:{E}:probe:<q>``, a list): one msgpack :class:`ProbeAnswer` per rank, RPUSHed
with a PEXPIRE of the probe's budget, so an answer nobody waits for any more expires.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from broker_lookup.errors import MalformedMessage

__all__ = [
    "PROBES_TTL_MS",
    "Probe",
    "ProbeAnswer",
    "ProbeMessage",
    "Reserve",
    "decode_answer",
    "decode_probe",
    "encode_answer",
    "new_query_id",
    "probe_fields",
]

#: How long an engine's probe stream outlives its last probe (every probe refreshes it).
PROBES_TTL_MS = 60_000
#: Entries kept in an engine's probe stream (trimmed on every XADD).
PROBES_MAXLEN = 1000

#: Why a rank's answer holds no count: ``unsupported``, its engine cannot look up
#: without loading; ``error``, the engine raised (logged on the rank).
Status = Literal["ok", "unsupported", "error"]


class Probe(msgspec.Struct, tag="probe", frozen=True, kw_only=True):
    """Ask every rank how much of this prefix it holds now, loading and pinning nothing."""

    query_id: str
    hashes: list[int]  #: per-chunk prefix hashes, as in a lookup
    offsets: list[int]  #: per-chunk token counts, as in a lookup
    budget_ms: int  #: the querier waits this long; the answer list expires after it
    request_configs: dict[str, Any] | None = None


class Reserve(msgspec.Struct, tag="reserve", frozen=True, kw_only=True):
    """Pin the prefix held of these chunks until the engine's own lookup of them arrives,
    or ``reserve_ms`` passed, whichever first; answer the prefix pinned."""

    query_id: str
    hashes: list[int]
    offsets: list[int]
    budget_ms: int  #: as a probe's
    reserve_ms: int
    request_configs: dict[str, Any] | None = None


ProbeMessage = Probe | Reserve


class ProbeAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's answer to a probe."""

    rank: int
    tokens: int  #: the prefix it holds (0 unless ``status`` is ``ok``)
    status: Status = "ok"


_ENCODER = msgspec.msgpack.Encoder()
_PROBE = msgspec.msgpack.Decoder(ProbeMessage)
_ANSWER = msgspec.msgpack.Decoder(ProbeAnswer)


def new_query_id() -> str:
    """A key-safe, unique query id."""
    return os.urandom(8).hex()


def probe_fields(probe: ProbeMessage) -> dict[str, bytes | str | int]:
    """The stream entry's fields for ``probe``."""
    return {
        "type": "probe" if isinstance(probe, Probe) else "reserve",
        "q": probe.query_id,
        "chunks": len(probe.hashes),
        "m": _ENCODER.encode(probe),
    }


def decode_probe(fields: dict[bytes, bytes]) -> ProbeMessage:
    """Decode a probe entry; raise MalformedMessage saying why it can't be."""
    raw = fields.get(b"m")
    if raw is None:
        raise MalformedMessage("probe entry has no 'm' field", fields)
    try:
        probe = _PROBE.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"undecodable probe: {exc}", raw) from None
    if isinstance(probe, Reserve) and probe.reserve_ms < 0:
        raise MalformedMessage("a reserve's reserve_ms is negative", raw)
    if len(probe.hashes) != len(probe.offsets) or any(o < 0 for o in probe.offsets):
        raise MalformedMessage("probe hashes and offsets do not pair up", raw)
    return probe


def encode_answer(answer: ProbeAnswer) -> bytes:
    """msgpack bytes of one rank's answer."""
    return _ENCODER.encode(answer)


def decode_answer(raw: bytes) -> ProbeAnswer:
    """Decode one rank's answer; raise MalformedMessage if it is not one."""
    try:
        return _ANSWER.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"undecodable probe answer: {exc}", raw) from None
