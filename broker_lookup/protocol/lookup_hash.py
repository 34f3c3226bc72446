"""The lookup hash ``bl:{E}:lookup:<id>``: its field names and a typed decode.

``submit.lua`` creates the hash, ``report.lua`` records each rank's hits in it and
completes it, ``cancel.lua`` deletes it; Python only reads it (the client's
reconciliation, ``inspect``, the demo). Every Python reader names the fields through
this module, and the Lua scripts' headers point here: a field renamed in one place
is renamed in all.

==============  ==========================================================
field           value (plain ASCII, so ``redis-cli HGETALL`` reads it)
==============  ==========================================================
``id``          the caller's lookup id (the key may hold a digest of it)
``state``       ``pending`` until every expected rank reported, then ``done``
``gen``         generation of the attempt the hash belongs to
``expected``    comma-separated ranks whose reports complete it, e.g. ``0,1,2``
``r<rank>``     one rank's hit count (see :func:`rank_field`)
``result``      minimum over the expected ranks, once ``done``
``created_ms``  client's epoch ms when the submit was built
``deadline_ms`` client's epoch ms after which the answer is worthless
``tokens``      prompt tokens looked up: the largest valid hit count
``submitted_us`` server's clock (epoch µs) when ``submit.lua`` ran
``l<rank>``     µs from the submit to that rank's report, on the server's clock
                (see :func:`latency_field`; only with ``rank_insights``)
``p<rank>``     prefix tokens that rank confirmed loaded and pinned so far
                (``progress.lua``; see :func:`progress_field`)
``partial``     ``1`` once ``deadline.lua`` answered the lookup at its deadline
                with the prefix every expected rank confirmed (``result``)
``owed``        expected ranks whose report is still owed (``report.lua``
                completes the lookup when it reaches 0, without reading the
                other ranks' fields again)
``lowest``      the fewest hits reported so far (``tokens`` before any): the
                ``result`` once ``owed`` is 0
==============  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "CREATED_MS",
    "DEADLINE_MS",
    "DONE",
    "EXPECTED",
    "GEN",
    "ID",
    "LOWEST",
    "OWED",
    "PARTIAL",
    "PENDING",
    "RESULT",
    "STATE",
    "STATUS_FIELDS",
    "SUBMITTED_US",
    "TOKENS",
    "LookupHash",
    "decode",
    "latency_field",
    "progress_field",
    "rank_field",
]

ID = "id"
STATE = "state"
GEN = "gen"
EXPECTED = "expected"
RESULT = "result"
CREATED_MS = "created_ms"
DEADLINE_MS = "deadline_ms"
TOKENS = "tokens"
SUBMITTED_US = "submitted_us"
PARTIAL = "partial"
OWED = "owed"
LOWEST = "lowest"

#: Values of ``state``.
PENDING = "pending"
DONE = "done"

#: The fields a reader needs to tell whether a generation completed, and with what
#: (the client's reconciliation reads only these, with one HMGET).
STATUS_FIELDS = (STATE, GEN, RESULT, PARTIAL)

_RANK_PREFIX = "r"
_LATENCY_PREFIX = "l"
_PROGRESS_PREFIX = "p"


def rank_field(rank: int) -> str:
    """Field holding one rank's hit count: ``r<rank>``."""
    return f"{_RANK_PREFIX}{rank}"


def latency_field(rank: int) -> str:
    """Field holding µs from the submit to one rank's report: ``l<rank>``."""
    return f"{_LATENCY_PREFIX}{rank}"


def progress_field(rank: int) -> str:
    """Field holding the prefix one rank confirmed loaded and pinned so far: ``p<rank>``."""
    return f"{_PROGRESS_PREFIX}{rank}"


@dataclass(frozen=True, slots=True)
class LookupHash:
    """What one lookup hash says; a field that is absent or not a number is None.

    ``hits`` holds the expected ranks that reported; ``missing`` the ones still awaited;
    ``progress`` the prefix each rank confirmed loaded so far (engines that report it).
    """

    lookup_id: str | None = None
    state: str | None = None
    gen: int | None = None
    expected: tuple[int, ...] = ()
    hits: dict[int, int | None] = field(default_factory=dict)
    result: int | None = None
    created_ms: int | None = None
    deadline_ms: int | None = None
    tokens: int | None = None
    progress: dict[int, int | None] = field(default_factory=dict)
    partial: bool = False

    @property
    def exists(self) -> bool:
        """False when the key was missing (HGETALL of no key is empty)."""
        return self.state is not None

    @property
    def missing(self) -> list[int]:
        """Expected ranks that have not reported."""
        return [r for r in self.expected if r not in self.hits]

    def done_for(self, gen: int) -> int | None:
        """The result if generation ``gen`` completed, else None."""
        if self.state == DONE and self.gen == gen:
            return self.result
        return None


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def decode(raw: Mapping[str, object] | Mapping[bytes, object]) -> LookupHash:
    """A typed view of an ``HGETALL`` reply (or of HMGET values zipped with their names).

    Never raises: whatever the hash holds (a hand-edited field, a foreign writer) is
    shown as None where it is not what the scripts write.
    """
    fields: dict[str, str] = {}
    for name, value in raw.items():
        if value is not None:
            fields[_text(name)] = _text(value)
    expected = tuple(int(r) for r in fields.get(EXPECTED, "").split(",") if r.isdigit())
    hits = {r: _int(fields[rank_field(r)]) for r in expected if rank_field(r) in fields}
    progress = {r: _int(fields[progress_field(r)]) for r in expected if progress_field(r) in fields}
    return LookupHash(
        lookup_id=fields.get(ID),
        state=fields.get(STATE),
        gen=_int(fields.get(GEN)),
        expected=expected,
        hits=hits,
        result=_int(fields.get(RESULT)),
        created_ms=_int(fields.get(CREATED_MS)),
        deadline_ms=_int(fields.get(DEADLINE_MS)),
        tokens=_int(fields.get(TOKENS)),
        progress=progress,
        partial=fields.get(PARTIAL) == "1",
    )
