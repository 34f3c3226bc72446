"""Wire messages: every byte that crosses Redis is one of these msgspec Structs.

Request stream entry (``bl:{E}:requests``), written by the scheduler's client::

    type         "lookup" | "abort" | "keep"  readable copy for redis-cli
    id           lookup id                    readable copy
    gen          generation (int)             readable copy
    deadline_ms  epoch ms (lookups only)      readable copy (client's clock; ranks use budget_ms)
    chunks       number of chunks (lookups)   readable copy
    tokens       prefix to keep (keeps)       readable copy
    m            msgpack of LookupRequest | Abort | Keep (tagged union): the only field decoded

A *batch entry* carries the lookups one ``submit.lua`` batch registered (the sender's
queued submits, sent in one round trip), so the server appends, delivers to each rank's
group and acks one entry per batch instead of one per lookup::

    type         "batch"                      readable
    n            number of lookups            readable
    m0 .. m<n-1> msgpack of each LookupRequest, in submit order

A rank decodes each part on its own (:func:`decode_entry`): a part that can't be served
is dead-lettered alone and the others are served. Aborts and keeps are never batched.
Every process of one engine must read batch entries (this version on): an older rank
dead-letters them ("no 'm' field"), and their lookups are answered 0 at the timeout.

Completion entry (``bl:{E}:done``), written by ``report.lua``: ``id``, ``gen``, ``result``;
with ``rank_insights`` (the lookup hash holds a ``submitted_us`` stamp) also::

    last   the rank whose report completed it (the last to report)
    ranks  the expected ranks, comma-separated ("0,1,2"): the order of the next two
    hits   each rank's hit count, comma-separated, in that order
    lat    µs from the submit to each rank's report on the server's clock, comma-separated
           in that order, empty where a rank has none

An entry without them (insights off, or an older ``report.lua``) still completes its
lookup; one whose extra fields do not parse completes it too, without the insights.

A ``report.lua`` batch that completes several lookups writes them all in one entry, so
the server pays one XADD a batch, not one a lookup::

    n      how many completions the entry carries (only where more than one)
    id gen result [last ranks hits lat]                 the first, as above
    id.1 gen.1 result.1 [last.1 ranks.1 hits.1 lat.1]   the second, and so on to n-1

:func:`decode_completions` reads either kind: a completion whose fields do not parse is
left out (and said), the others still complete. An older reader of a multi entry
completes its first lookup; its client reconciles the others from their hashes.
Dead letter (``bl:{E}:dead``): ``rank``, ``entry`` (stream id), ``reason``, ``raw``.

Schema evolution: new fields get defaults, nothing is reordered, unknown fields
are ignored, so old and new processes can share one stream during an upgrade.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from broker_lookup.errors import MalformedMessage

__all__ = [
    "BATCH_TYPE",
    "Abort",
    "Completions",
    "ConfigsProblem",
    "DoneEvent",
    "Keep",
    "LookupRequest",
    "Request",
    "batch_field",
    "check_lookup_id",
    "decode_completions",
    "decode_done",
    "decode_entry",
    "decode_request",
    "encode_request",
    "request_configs_problem",
    "request_fields",
    "validate_request",
    "wire_id_problem",
]

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


class LookupRequest(msgspec.Struct, tag="lookup", frozen=True, kw_only=True, gc=False):
    """Ask every expected rank for its cached prefix of these chunks."""

    # gc=False: a request lives as long as its lookup, in the client's table and in a
    # rank's job, so a tracked one would count towards the host process's collections
    # (vLLM's, whose heap each full collection walks). It can't be part of a cycle:
    # frozen, and its fields are ints, lists of ints and a JSON-able dict.

    lookup_id: str
    gen: int  #: generation: distinguishes attempts that reuse one lookup id
    hashes: list[int]  #: per-chunk prefix hashes (int64 for builtin, uint64 for digests)
    offsets: list[int]  #: per-chunk token counts (not cumulative), LMCache's convention
    expected: list[int]  #: ranks whose reports complete the lookup
    deadline_ms: int  #: client's epoch ms after which the answer is worthless (for humans)
    request_configs: dict[str, Any] | None = None  #: any JSON-able values (LMCache D13)
    tokens: int = 0  #: sum of offsets: the largest valid hit count
    #: Relative deadline: the answer is worthless this many ms after the server stamped the
    #: entry (its stream id), so ranks judge it by the server's clock, never by comparing
    #: wall clocks across hosts. 0 (an older client): ranks fall back to ``deadline_ms``.
    budget_ms: int = 0


class Abort(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    """Release whatever this generation of the lookup pinned; drop it if not started."""

    lookup_id: str
    gen: int


class Keep(msgspec.Struct, tag="keep", frozen=True, kw_only=True):
    """The lookup was answered at its deadline with ``tokens`` (a partial answer): keep
    exactly that prefix pinned and release the rest (``deadline.lua`` decided it)."""

    lookup_id: str
    gen: int
    tokens: int


Request = LookupRequest | Abort | Keep


class DoneEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A lookup every expected rank answered: ``result`` is the minimum.

    The rest is there only with ``rank_insights`` (see the module docstring): ``ranks``,
    ``hits`` and ``latency_us`` are aligned (``latency_us`` None where a rank has none).
    """

    lookup_id: str
    gen: int
    result: int
    last: int | None = None  #: the rank whose report completed the lookup
    ranks: tuple[int, ...] = ()  #: expected ranks, the order of ``hits`` and ``latency_us``
    hits: tuple[int, ...] = ()  #: each rank's hit count
    latency_us: tuple[int | None, ...] = ()  #: µs from the submit to each rank's report


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Request)


def encode_request(msg: Request) -> bytes:
    """msgpack bytes of a request, for the ``m`` field."""
    return _ENCODER.encode(msg)


def request_fields(msg: Request) -> dict[str, bytes | str | int]:
    """All fields of the stream entry for ``msg``: readable copies plus ``m``."""
    if isinstance(msg, LookupRequest):
        return {
            "type": "lookup",
            "id": msg.lookup_id,
            "gen": msg.gen,
            "deadline_ms": msg.deadline_ms,
            "chunks": len(msg.hashes),
            "m": _ENCODER.encode(msg),
        }
    if isinstance(msg, Keep):
        return {
            "type": "keep",
            "id": msg.lookup_id,
            "gen": msg.gen,
            "tokens": msg.tokens,
            "m": _ENCODER.encode(msg),
        }
    return {"type": "abort", "id": msg.lookup_id, "gen": msg.gen, "m": _ENCODER.encode(msg)}


def decode_request(fields: dict[bytes, bytes] | None) -> Request:
    """Decode a request entry's fields; raise MalformedMessage saying why it can't be."""
    if fields is None:
        raise MalformedMessage("entry was trimmed while pending (nil payload)")
    raw = fields.get(b"m")
    if raw is None:
        raise MalformedMessage("entry has no 'm' field", fields)
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"undecodable 'm' field: {exc}", raw) from None


#: ``type`` of a batch entry (``submit.lua`` writes it; :func:`decode_entry` reads it).
BATCH_TYPE = b"batch"


def batch_field(index: int) -> str:
    """The field holding part ``index`` of a batch entry (``submit.lua`` builds the same)."""
    return f"m{index}"


def decode_entry(fields: dict[bytes, bytes] | None) -> list[Request | MalformedMessage]:
    """Every request of one stream entry, in order: one for a plain entry, ``n`` for a
    batch entry. A part that can't be decoded is its :class:`MalformedMessage`, so the
    caller dead-letters that part alone; a batch entry whose ``n`` is unusable is one.
    """
    if fields is None or fields.get(b"type") != BATCH_TYPE:
        try:
            return [decode_request(fields)]
        except MalformedMessage as exc:
            return [exc]
    try:
        n = int(fields[b"n"])
    except (KeyError, ValueError):
        return [MalformedMessage("batch entry without a count 'n'", fields)]
    # n is the producer's word: a part is one field, so no entry holds more parts than
    # fields, and a forged count can't make a rank loop beyond what it read.
    if not 0 < n <= len(fields):
        return [MalformedMessage(f"batch entry count n={n} is outside 1..{len(fields)}", fields)]
    out: list[Request | MalformedMessage] = []
    for i in range(n):
        raw = fields.get(batch_field(i).encode())
        if raw is None:
            out.append(MalformedMessage(f"batch entry has no '{batch_field(i)}' field"))
            continue
        try:
            msg = _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            out.append(MalformedMessage(f"undecodable '{batch_field(i)}' field: {exc}", raw))
            continue
        if type(msg) is not LookupRequest:
            out.append(MalformedMessage(f"part '{batch_field(i)}' of a batch is not a lookup", raw))
            continue
        out.append(msg)
    return out


def decode_done(fields: dict[bytes, bytes], index: int = 0) -> DoneEvent:
    """Decode one completion of a done entry written by ``report.lua``: the first (``id``,
    ``gen``, ``result``), or with ``index`` > 0 the one under ``id.<index>`` and so on.

    Raises MalformedMessage if its ``id``, ``gen`` or ``result`` is missing or bad; the
    insight fields are optional, and dropped (the completion kept) if they do not parse.
    """
    suffix = b"" if not index else b".%d" % index
    try:
        lookup_id = fields[b"id" + suffix].decode()
        gen = int(fields[b"gen" + suffix])
        result = int(fields[b"result" + suffix])
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise MalformedMessage(f"bad completion entry: {exc!r}", fields) from None
    last = fields.get(b"last" + suffix)
    if last is None:
        return DoneEvent(lookup_id=lookup_id, gen=gen, result=result)
    try:
        ranks = tuple(int(r) for r in fields[b"ranks" + suffix].split(b","))
        hits = tuple(int(h) for h in fields[b"hits" + suffix].split(b","))
        lat = tuple(int(v) if v else None for v in fields[b"lat" + suffix].split(b","))
        if not len(ranks) == len(hits) == len(lat):
            raise ValueError("ranks, hits and lat differ in length")
        return DoneEvent(
            lookup_id=lookup_id,
            gen=gen,
            result=result,
            last=int(last),
            ranks=ranks,
            hits=hits,
            latency_us=lat,
        )
    except (KeyError, ValueError):
        return DoneEvent(lookup_id=lookup_id, gen=gen, result=result)


class Completions(NamedTuple):
    """What one done entry completes: every completion that decoded, in order, and why
    any did not (None when all did)."""

    events: list[DoneEvent]
    problem: str | None


def decode_completions(fields: dict[bytes, bytes]) -> Completions:
    """Every completion of a done entry (the module docstring's format); never raises.

    A completion that does not decode is left out and named in ``problem``; the rest
    still complete. A bad ``n`` reads as many completions as the entry holds.
    """
    count = fields.get(b"n")
    if count is None:  # one completion: the common entry
        try:
            return Completions([decode_done(fields)], None)
        except MalformedMessage as exc:
            return Completions([], str(exc))
    problems: list[str] = []
    # Each completion takes at least three fields (id, gen, result): a bigger count is a lie.
    most = len(fields) // 3
    try:
        n = int(count)
    except ValueError:
        n = -1
    guessed = not 0 < n <= most
    if guessed:
        problems.append(f"bad count n={count[:20]!r}")
        n = most
    events: list[DoneEvent] = []
    for index in range(n):
        if guessed and index and b"id.%d" % index not in fields:
            break  # no count to trust: the entry ends where its ids do
        try:
            events.append(decode_done(fields, index))
        except MalformedMessage as exc:
            problems.append(f"completion {index} of {n}: {exc.reason}")
    return Completions(events, "; ".join(problems) or None)


def wire_id_problem(lookup_id: object, max_length: int) -> str | None:
    """Why ``lookup_id`` can't cross the wire (None if it can): a non-empty ``str`` of at
    most ``max_length`` characters that encodes to UTF-8. Anything else a caller sends
    is legal: keys hold a digest of ids they should not hold verbatim."""
    if not isinstance(lookup_id, str):
        return f"lookup_id must be a str, got {type(lookup_id).__name__}"
    if not 0 < len(lookup_id) <= max_length:
        return f"lookup_id length {len(lookup_id)} is outside 1..{max_length}"
    if lookup_id.isascii():  # the common case, answered without encoding the id
        return None
    try:
        lookup_id.encode()
    except UnicodeEncodeError:
        return f"lookup_id {lookup_id[:64]!r} is not encodable as UTF-8 (a lone surrogate)"
    return None


def check_lookup_id(lookup_id: object, max_length: int) -> str | None:
    """Strict opt-in check (never on the scheduler's path): printable ASCII, no spaces.

    The reason ``lookup_id`` is not such an id, or None. Callers that want their own
    ids kept readable in every key use it; the protocol itself takes any ``str``.
    """
    if not isinstance(lookup_id, str):
        return f"lookup_id must be a str, got {type(lookup_id).__name__}"
    if not 0 < len(lookup_id) <= max_length:
        return f"lookup_id length {len(lookup_id)} is outside 1..{max_length}"
    if not (lookup_id.isascii() and lookup_id.isprintable()) or " " in lookup_id:
        return f"lookup_id {lookup_id[:64]!r} must be printable ASCII without spaces"
    return None


class ConfigsProblem(NamedTuple):
    """Why a ``request_configs`` value can't be sent or served."""

    kind: str  #: ``bad_configs`` (not a JSON-able dict with str keys) or ``configs_too_large``
    reason: str  #: the rule and the value, for a log line or a dead letter


_JSON = msgspec.json.Encoder()


def request_configs_problem(configs: object, max_bytes: int) -> ConfigsProblem | None:
    """Why ``configs`` breaks the wire's rule for ``request_configs`` (None if it does not):
    None, or a dict with ``str`` keys whose JSON encoding is at most ``max_bytes`` long.

    The client applies it before sending and every rank again after decoding, so an
    entry from an older or foreign producer is held to the same rule.
    """
    if configs is None:
        return None
    if not isinstance(configs, dict) or not all(isinstance(k, str) for k in configs):
        return ConfigsProblem("bad_configs", "request_configs must be a dict with str keys")
    try:
        size = len(_JSON.encode(configs))
    except (TypeError, ValueError, msgspec.EncodeError) as exc:
        return ConfigsProblem("bad_configs", f"request_configs must be JSON-serialisable: {exc}")
    if size > max_bytes:
        return ConfigsProblem(
            "configs_too_large",
            f"request_configs is {size} bytes, over max_request_configs_bytes={max_bytes}",
        )
    return None


def validate_request(msg: LookupRequest, *, max_chunks: int, max_id_length: int) -> str | None:
    """Semantic checks a worker applies after decoding; the reason, or None if valid."""
    reason = wire_id_problem(msg.lookup_id, max_id_length)
    if reason:
        return reason
    if msg.budget_ms < 0:
        return f"budget_ms={msg.budget_ms} is negative"
    if len(msg.hashes) != len(msg.offsets):
        return f"{len(msg.hashes)} hashes but {len(msg.offsets)} offsets"
    if not 0 < len(msg.hashes) <= max_chunks:
        return f"{len(msg.hashes)} chunks is outside 1..{max_chunks}"
    # Both lists are non-empty here: min/max run in C, where a generator over each
    # element cost a rank microseconds per lookup; they refuse exactly the same lists.
    if min(msg.offsets) <= 0:
        return "offsets must be positive token counts"
    hashes = msg.hashes
    if min(hashes) < _INT64_MIN or max(hashes) > _UINT64_MAX:
        return "a hash is outside the 64-bit range"
    if not msg.expected or min(msg.expected) < 0:
        return "expected ranks must be a non-empty list of ranks >= 0"
    if msg.tokens != sum(msg.offsets):
        return f"tokens={msg.tokens} does not equal the sum of offsets"
    return None
