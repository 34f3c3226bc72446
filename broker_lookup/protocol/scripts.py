"""The Lua scripts of the protocol: their text, their SHA1s and each one's argument builder.

Each builder returns a :class:`Call` (which script, its KEYS, its ARGV) in the order the
script's header documents; :meth:`ScriptSource.command` turns one into the ``EVALSHA`` that
runs it. Every key a script touches arrives in ``KEYS``, which keeps the scripts legal on
Redis Cluster (all keys of one engine share one hash tag). Running them, with NOSCRIPT
recovery, is :class:`broker_lookup.transport.script_runner.ScriptSet`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import NamedTuple

import msgspec

from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest, request_fields
from broker_lookup.protocol.ownership import Identity

__all__ = [
    "CANCEL",
    "CLAIM",
    "DEADLINE",
    "KEEP",
    "PROGRESS",
    "REPORT",
    "SUBMIT",
    "BatchItem",
    "Call",
    "ScriptSource",
    "cancel_args",
    "cancel_call",
    "claim_call",
    "deadline_call",
    "keep_call",
    "progress_call",
    "release_call",
    "report_answer",
    "report_answers",
    "report_args",
    "report_batch_call",
    "report_call",
    "submit_answers",
    "submit_args",
    "submit_batches",
    "submit_call",
]

#: Most submits one ``submit.lua`` batch carries: the server runs a script to its end
#: before anything else, so a burst of thousands is cut into calls of this many.
SUBMIT_BATCH_MAX = 64

SUBMIT = "submit"
REPORT = "report"
CANCEL = "cancel"
PROGRESS = "progress"
DEADLINE = "deadline"
KEEP = "keep"
CLAIM = "claim"

Arg = str | bytes | int
#: A rank's fencing: its lease key and the token it holds (``report.lua``'s KEYS[3], ARGV[7]).
Fence = tuple[str, str]


class Call(msgspec.Struct, frozen=True, gc=False):
    """One script invocation: which script, its KEYS and its ARGV."""

    # gc=False: a submit's call waits in the client's queue for its round trip, so a
    # tracked one would count towards the scheduler process's collections. KEYS and
    # ARGV hold only strings, bytes and numbers: no cycle.

    script: str
    keys: Sequence[str]
    args: Sequence[Arg]


def submit_args(
    *,
    gen: int,
    expected: str,
    created_ms: int,
    deadline_ms: int,
    tokens: int,
    ttl_ms: int,
    maxlen: int,
    lookup_id: str,
    fields: dict[str, Arg],
    engine_ttl_ms: int,
    insights: bool = False,
) -> list[Arg]:
    """ARGV of ``submit.lua``, in the order its header documents.

    ``insights``: stamp the server's clock at submit, so each rank's report is timed.
    ``engine_ttl_ms``: the request stream's TTL (the submit may create it).
    """
    args: list[Arg] = [gen, expected, created_ms, deadline_ms, tokens, ttl_ms, maxlen, lookup_id]
    args.append("1" if insights else "0")
    args.append(engine_ttl_ms)
    return args + _pairs(fields)


def submit_call(
    keys: KeySpace,
    request: LookupRequest,
    *,
    expected: str,
    created_ms: int,
    ttl_ms: int,
    maxlen: int,
    engine_ttl_ms: int,
    insights: bool = False,
) -> Call:
    """The ``submit.lua`` call registering ``request`` and broadcasting it to every rank.

    ``expected`` is the comma-separated rank list, ``ttl_ms`` the hash's PEXPIRE,
    ``maxlen`` the request stream's approximate cap and ``engine_ttl_ms`` its TTL;
    ``insights`` (``rank_insights``) stamps ``submitted_us`` so ``report.lua`` times each
    rank on the server's clock.
    """
    args = submit_args(
        gen=request.gen,
        expected=expected,
        created_ms=created_ms,
        deadline_ms=request.deadline_ms,
        tokens=request.tokens,
        ttl_ms=ttl_ms,
        maxlen=maxlen,
        lookup_id=request.lookup_id,
        fields=request_fields(request),
        engine_ttl_ms=engine_ttl_ms,
        insights=insights,
    )
    # A tuple: untracked by the GC at its first collection, unlike a list.
    return Call(SUBMIT, (keys.lookup(request.lookup_id), keys.requests), tuple(args))


def _submit_batch(calls: Sequence[Call], horizon_ms: int) -> Call:
    """One ``submit.lua`` batch call doing what ``calls`` (single submits to one stream,
    with one expected list, stream cap and stream TTL) do, in their order, trimming the
    entries older than ``horizon_ms`` (0: none)."""
    head = calls[0].args
    # The single ARGV's order (submit_args): gen, expected, created_ms, deadline_ms,
    # tokens, ttl ms, maxlen, lookup id, insights, stream ttl ms, then the entry's pairs,
    # whose last is the msgpack ``m`` (request_fields): a batch entry carries it alone.
    args: list[Arg] = ["batch", head[1], head[6], head[9], horizon_ms]
    for call in calls:
        a = call.args
        args += [a[0], a[2], a[3], a[4], a[5], a[7], a[8], a[-1]]
    return Call(SUBMIT, (calls[0].keys[1], *(call.keys[0] for call in calls)), tuple(args))


def _same_batch(a: Call, b: Call) -> bool:
    """Whether submits ``a`` and ``b`` can ride one batch: one stream, one expected list,
    one stream cap and TTL (a batch carries those once)."""
    return (
        a.keys[1] == b.keys[1]
        and a.args[1] == b.args[1]
        and a.args[6] == b.args[6]
        and a.args[9] == b.args[9]
    )


def submit_batches(
    calls: Sequence[Call], most: int = SUBMIT_BATCH_MAX, horizon_ms: int = 0
) -> list[tuple[Call, int]]:
    """``calls`` as sent: each run of consecutive :func:`submit_call` calls (at most
    ``most``) as one ``submit.lua`` batch, every other call as it is, in order; each with
    the count of ``calls`` it stands for (:func:`submit_answers` gives theirs back).
    ``horizon_ms``: a batch trims the request entries older than this (the longest a
    lookup hash lives, ``key_ttl_ms``: no rank can serve them); 0 trims none.

    The order on the wire is kept, so a cancel queued between two submits still runs
    between them. A run of one is sent as the single call it is.
    """
    out: list[tuple[Call, int]] = []
    run: list[Call] = []

    def flush() -> None:
        if len(run) == 1:
            out.append((run[0], 1))
        elif run:
            out.append((_submit_batch(run, horizon_ms), len(run)))
        run.clear()

    for call in calls:
        # A submit whose entry does not end with ``m`` (one not built by submit_call) has
        # no part to give a batch entry: it goes alone.
        batchable = call.script == SUBMIT and call.args[-2] == "m"
        if not batchable or (run and (len(run) >= most or not _same_batch(run[0], call))):
            flush()
        if batchable:
            run.append(call)
        else:
            out.append((call, 1))
    flush()
    return out


def submit_answers(results: Sequence[object], counts: Sequence[int]) -> list[object]:
    """The answers of the calls :func:`submit_batches` packed, one per original call, from
    the ``results`` of the calls it returned (``counts``: how many each stands for)."""
    out: list[object] = []
    for result, n in zip(results, counts, strict=True):
        if n == 1:
            out.append(result)
        else:
            out += report_answers(result, n)
    return out


def cancel_args(*, gen: int, maxlen: int, engine_ttl_ms: int, fields: dict[str, Arg]) -> list[Arg]:
    """ARGV of ``cancel.lua``, in the order its header documents."""
    args: list[Arg] = [gen, maxlen, engine_ttl_ms]
    return args + _pairs(fields)


def cancel_call(keys: KeySpace, abort: Abort, *, maxlen: int, engine_ttl_ms: int) -> Call:
    """The ``cancel.lua`` call forgetting ``abort``'s generation and telling every rank
    (``engine_ttl_ms``: the request stream's TTL)."""
    args = cancel_args(
        gen=abort.gen, maxlen=maxlen, engine_ttl_ms=engine_ttl_ms, fields=request_fields(abort)
    )
    return Call(CANCEL, (keys.lookup(abort.lookup_id), keys.requests), args)


def deadline_call(
    keys: KeySpace,
    abort: Abort,
    *,
    maxlen: int,
    ttl_ms: int,
    engine_ttl_ms: int,
    answer: bool = True,
) -> Call:
    """The ``deadline.lua`` call for ``abort``'s generation at its deadline: with ``answer``,
    the prefix every expected rank confirmed (a partial answer), or a cancel if that is 0;
    without (the client answered 0 already), a cancel. Either way it names the ranks that
    had not reported.

    ``ttl_ms`` is the hash's PEXPIRE once answered, ``engine_ttl_ms`` the request stream's
    TTL; ``abort`` is the entry sent if it is 0.
    """
    fields = _pairs(request_fields(abort))
    args: list[Arg] = [abort.gen, maxlen, ttl_ms, int(answer), engine_ttl_ms, *fields]
    return Call(DEADLINE, (keys.lookup(abort.lookup_id), keys.requests), args)


def keep_call(keys: KeySpace, keep: Keep, *, maxlen: int, engine_ttl_ms: int) -> Call:
    """The ``keep.lua`` call telling every rank to keep ``keep.tokens`` of a partial answer
    pinned and release the rest (sent once ``deadline.lua`` answered it); ``engine_ttl_ms``
    is the request stream's TTL."""
    args: list[Arg] = [keep.gen, maxlen, engine_ttl_ms, *_pairs(request_fields(keep))]
    return Call(KEEP, (keys.lookup(keep.lookup_id), keys.requests), args)


def progress_call(
    keys: KeySpace,
    lookup_id: str,
    *,
    rank: int,
    gen: int,
    tokens: int,
    fence: Fence | None = None,
) -> Call:
    """The ``progress.lua`` call recording that ``rank`` holds ``tokens`` of the prefix of
    (``lookup_id``, ``gen``) loaded and pinned so far; with ``fence``, only while the
    rank's lease holds its token (else ``fenced``)."""
    if fence is None:
        return Call(PROGRESS, (keys.lookup(lookup_id),), [rank, gen, tokens])
    return Call(PROGRESS, (keys.lookup(lookup_id), fence[0]), [rank, gen, tokens, fence[1]])


def claim_call(
    keys: KeySpace,
    role: str,
    identity: Identity,
    *,
    lease_ms: int,
    epochs_ttl_ms: int,
    heartbeat: tuple[str, int] | None = None,
) -> Call:
    """The ``claim.lua`` call claiming or renewing ``role``'s lease for ``identity``.

    ``heartbeat`` (a rank's: body, TTL ms) is written with the claim, by the holder only.
    """
    base = ("claim", role, identity.encode(), identity.nonce, lease_ms, epochs_ttl_ms)
    keys_ = (keys.owner(role), keys.epochs, keys.contender(role))
    if heartbeat is None:
        return Call(CLAIM, keys_, base)
    return Call(CLAIM, (*keys_, keys.heartbeat(int(role))), (*base, *heartbeat))


def release_call(keys: KeySpace, role: str, identity: Identity, *, rank: bool) -> Call:
    """The ``claim.lua`` call releasing ``role``'s lease if ``identity`` holds it (a clean
    stop: the next process takes over at once); a rank's heartbeat goes with it."""
    keys_: tuple[str, ...] = (keys.owner(role), keys.epochs, keys.contender(role))
    if rank:
        keys_ = (*keys_, keys.heartbeat(int(role)))
    return Call(CLAIM, keys_, ("release", role, identity.encode(), identity.nonce, 0, 0))


def _pairs(fields: dict[str, Arg]) -> list[Arg]:
    """A stream entry's fields as the flat name, value, ... list XADD takes."""
    out: list[Arg] = []
    for name, value in fields.items():
        out.append(name)
        out.append(value)
    return out


def report_args(
    *,
    rank: int,
    gen: int,
    hits: int,
    done_maxlen: int,
    lookup_id: str,
    engine_ttl_ms: int,
    token: str | None = None,
) -> list[Arg]:
    """ARGV of ``report.lua``, in the order its header documents (``token``: fenced)."""
    # The 0 fills the slot that once held the completed hash's TTL (report.lua: unused).
    args: list[Arg] = [rank, gen, hits, done_maxlen, lookup_id, 0, engine_ttl_ms]
    return args if token is None else [*args, token]


def report_call(
    keys: KeySpace,
    lookup_id: str,
    *,
    rank: int,
    gen: int,
    hits: int,
    done_maxlen: int,
    engine_ttl_ms: int,
    fence: Fence | None = None,
) -> Call:
    """The ``report.lua`` call recording ``rank``'s ``hits`` for (``lookup_id``, ``gen``).

    ``done_maxlen`` is the done stream's approximate cap and ``engine_ttl_ms`` its TTL.
    A completed hash keeps the TTL its submit gave it (its deadline plus
    ``key_grace_ms``), which costs no command. With ``fence``
    (the rank's lease key and token) nothing is recorded unless the lease holds that
    token (``fenced``).
    """
    args = report_args(
        rank=rank,
        gen=gen,
        hits=hits,
        done_maxlen=done_maxlen,
        lookup_id=lookup_id,
        engine_ttl_ms=engine_ttl_ms,
        token=None if fence is None else fence[1],
    )
    if fence is None:
        return Call(REPORT, (keys.lookup(lookup_id), keys.done), args)
    return Call(REPORT, (keys.lookup(lookup_id), keys.done, fence[0]), args)


class BatchItem(NamedTuple):
    """One report of a batch: which lookup, which generation, how many hits."""

    lookup_id: str
    gen: int
    hits: int


def report_batch_call(
    keys: KeySpace,
    items: Sequence[BatchItem],
    *,
    rank: int,
    done_maxlen: int,
    engine_ttl_ms: int,
    fence: Fence | None = None,
) -> Call:
    """One ``report.lua`` call recording every report of ``items`` for ``rank``, in order:
    the rank's lease is read once for them all (with ``fence``), the server pays one
    script call, and the answer is a list, one per item (:func:`report_answers`). Every
    lookup the batch completes goes in one done-stream entry (one XADD a batch; its format
    is :mod:`~broker_lookup.protocol.messages`'). The other arguments are
    :func:`report_call`'s."""
    token = "" if fence is None else fence[1]
    args: list[Arg] = ["batch", rank, done_maxlen, 0, engine_ttl_ms, token]  # 0: unused slot
    for item in items:
        args += [item.gen, item.hits, item.lookup_id]
    head = (keys.done,) if fence is None else (keys.done, fence[0])
    return Call(REPORT, (*head, *(keys.lookup(item.lookup_id) for item in items)), args)


def report_answers(result: object, n: int) -> list[object]:
    """The ``n`` answers of a :func:`report_batch_call`: its list, or, where the call
    failed as a whole (an error, a reply of another shape), that result for each."""
    if isinstance(result, list) and len(result) == n:
        return result
    return [result] * n


def report_answer(answer: str) -> tuple[str, int | None]:
    """``report.lua``'s answer as (name, tokens): ``settled:<n>`` (the deadline answered the
    lookup ``n`` tokens before this report came) is ``("settled", n)``; any other answer
    is itself, with no tokens."""
    name, colon, tokens = answer.partition(":")
    if not colon:
        return answer, None
    return name, int(tokens) if tokens.isascii() and tokens.isdigit() else None


class ScriptSource:
    """The protocol's scripts, read from ``broker_lookup/protocol/lua/*.lua``: their text and
    SHA1s, and the ``EVALSHA`` of a :class:`Call`."""

    NAMES = (SUBMIT, REPORT, CANCEL, PROGRESS, DEADLINE, KEEP, CLAIM)

    def __init__(self) -> None:
        base = resources.files("broker_lookup.protocol") / "lua"
        self.source = {n: (base / f"{n}.lua").read_text() for n in self.NAMES}
        self.sha = {n: hashlib.sha1(t.encode()).hexdigest() for n, t in self.source.items()}

    def command(self, call: Call) -> Command:
        """The ``EVALSHA`` command that runs ``call``."""
        return ("EVALSHA", self.sha[call.script], len(call.keys), *call.keys, *call.args)
