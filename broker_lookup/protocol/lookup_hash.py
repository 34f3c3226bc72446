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
    "PENDING",
    "RESULT",
    "STATE",
    "STATUS_FIELDS",
    "TOKENS",
    "LookupHash",
    "decode",
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

#: Values of ``state``.
PENDING = "pending"
DONE = "done"

#: The fields a reader needs to tell whether a generation completed, and with what
#: (the client's reconciliation reads only these, with one HMGET).
STATUS_FIELDS = (STATE, GEN, RESULT)

_RANK_PREFIX = "r"


def rank_field(rank: int) -> str:
    """Field holding one rank's hit count: ``r<rank>``."""
    return f"{_RANK_PREFIX}{rank}"


@dataclass(frozen=True, slots=True)
class LookupHash:
    """What one lookup hash says; a field that is absent or not a number is None.

    ``hits`` holds the expected ranks that reported; ``missing`` the ones still awaited.
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
    )
