"""The Lua scripts of the protocol, called by SHA with NOSCRIPT recovery.

The script cache is volatile (restart, failover, ``SCRIPT FLUSH``), so every call
goes through :class:`ScriptSet`, which reloads and retries once on NOSCRIPT, in a
pipeline too. Every key a script touches arrives in ``KEYS``, which keeps the
scripts legal on Redis Cluster (all keys of one engine share one hash tag); there the
pipeline is a ``ClusterPipeline`` and ``SCRIPT LOAD`` goes to every primary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import msgspec
import redis
from redis.exceptions import NoScriptError, ResponseError

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest, request_fields
from broker_lookup.protocol.ownership import Identity
from broker_lookup.transport.lean import Command, Link

__all__ = [
    "CANCEL",
    "CLAIM",
    "DEADLINE",
    "KEEP",
    "PROGRESS",
    "REPORT",
    "SUBMIT",
    "Call",
    "ScriptSet",
    "cancel_args",
    "cancel_call",
    "claim_call",
    "deadline_call",
    "is_noscript",
    "keep_call",
    "progress_call",
    "release_call",
    "report_answer",
    "report_args",
    "report_call",
    "submit_args",
    "submit_call",
]

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
#: Queues extra commands on a pipeline ahead of the scripts; returns how many.
Before = Callable[[Any], int]


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
    done_ttl_ms: int,
    engine_ttl_ms: int,
    token: str | None = None,
) -> list[Arg]:
    """ARGV of ``report.lua``, in the order its header documents (``token``: fenced)."""
    args: list[Arg] = [rank, gen, hits, done_maxlen, lookup_id, done_ttl_ms, engine_ttl_ms]
    return args if token is None else [*args, token]


def report_call(
    keys: KeySpace,
    lookup_id: str,
    *,
    rank: int,
    gen: int,
    hits: int,
    done_maxlen: int,
    done_ttl_ms: int,
    engine_ttl_ms: int,
    fence: Fence | None = None,
) -> Call:
    """The ``report.lua`` call recording ``rank``'s ``hits`` for (``lookup_id``, ``gen``).

    ``done_maxlen`` is the done stream's approximate cap and ``engine_ttl_ms`` its TTL,
    ``done_ttl_ms`` the hash's PEXPIRE once the last expected rank completed it. With
    ``fence`` (the rank's lease key and token) nothing is recorded unless the lease holds
    that token (``fenced``).
    """
    args = report_args(
        rank=rank,
        gen=gen,
        hits=hits,
        done_maxlen=done_maxlen,
        lookup_id=lookup_id,
        done_ttl_ms=done_ttl_ms,
        engine_ttl_ms=engine_ttl_ms,
        token=None if fence is None else fence[1],
    )
    if fence is None:
        return Call(REPORT, (keys.lookup(lookup_id), keys.done), args)
    return Call(REPORT, (keys.lookup(lookup_id), keys.done, fence[0]), args)


def report_answer(answer: str) -> tuple[str, int | None]:
    """``report.lua``'s answer as (name, tokens): ``settled:<n>`` (the deadline answered the
    lookup ``n`` tokens before this report came) is ``("settled", n)``; any other answer
    is itself, with no tokens."""
    name, colon, tokens = answer.partition(":")
    if not colon:
        return answer, None
    return name, int(tokens) if tokens.isascii() and tokens.isdigit() else None


def is_noscript(result: object) -> bool:
    """True if ``result`` is the error Redis gives for a script missing from its cache."""
    return isinstance(result, NoScriptError) or (
        isinstance(result, ResponseError) and str(result).startswith("NOSCRIPT")
    )


class ScriptSet:
    """The protocol's scripts, loaded from ``broker_lookup/protocol/lua/*.lua``."""

    NAMES = (SUBMIT, REPORT, CANCEL, PROGRESS, DEADLINE, KEEP, CLAIM)

    def __init__(self) -> None:
        base = resources.files("broker_lookup.protocol") / "lua"
        self.source = {n: (base / f"{n}.lua").read_text() for n in self.NAMES}
        self.sha = {n: hashlib.sha1(t.encode()).hexdigest() for n, t in self.source.items()}

    def load(self, client: redis.Redis) -> None:
        """Load every script into the server's cache (idempotent)."""
        with translate_redis_errors("loading Lua scripts"):
            for text in self.source.values():
                client.script_load(text)

    def command(self, call: Call) -> Command:
        """The ``EVALSHA`` command that runs ``call``."""
        return ("EVALSHA", self.sha[call.script], len(call.keys), *call.keys, *call.args)

    def run_link(self, link: Link, client: redis.Redis, calls: Sequence[Call]) -> list[Any]:
        """:meth:`run` over a lean link: one round trip, per-call errors as values."""
        with translate_redis_errors("running Lua scripts"):
            results = link.call([self.command(c) for c in calls])
        return self.rerun_missing(link, client, calls, results)

    def rerun_missing(
        self, link: Link, client: redis.Redis, calls: Sequence[Call], results: list[Any]
    ) -> list[Any]:
        """``results`` of ``calls`` run over ``link``, with the ones that found no script run
        again once after :meth:`load` through ``client`` (which reaches every primary of a
        cluster). A NOSCRIPT call did not run, so running it again applies nothing twice."""
        redo = [i for i, res in enumerate(results) if is_noscript(res)]
        if not redo:
            return results
        self.load(client)
        with translate_redis_errors("running Lua scripts"):
            again = link.call([self.command(calls[i]) for i in redo])
        out = list(results)
        for i, res in zip(redo, again, strict=True):
            out[i] = res
        return out

    def call(self, client: redis.Redis, call: Call) -> Any:
        """Run one script now; reload and retry once if the server lost it."""
        return self.run(client, [call])[0]

    def run(
        self, client: redis.Redis, calls: Sequence[Call], before: Before | None = None
    ) -> list[Any]:
        """Run ``calls`` in one pipelined round trip; per-call errors come back as values.

        ``before`` may queue other commands ahead of the scripts in the same round trip
        (a rank's XACK); an error from one of those is raised, translated.
        Calls that failed with NOSCRIPT did not run, so re-running them after a
        reload cannot apply anything twice.
        """
        results = self._execute(client, calls, before)
        redo = [i for i, res in enumerate(results) if is_noscript(res)]
        if redo:
            self.load(client)
            again = self._execute(client, [calls[i] for i in redo])
            for i, res in zip(redo, again, strict=True):
                results[i] = res
        return results

    def _execute(
        self, client: redis.Redis, calls: Sequence[Call], before: Before | None = None
    ) -> list[Any]:
        with translate_redis_errors("running Lua scripts"):
            pipe = client.pipeline(transaction=False)
            ahead = before(pipe) if before is not None else 0
            for c in calls:
                # execute_command, not pipe.evalsha: redis-py's ClusterPipeline blocks its
                # evalsha method (it cannot reload scripts), and we handle NOSCRIPT here.
                pipe.execute_command(*self.command(c))  # type: ignore[no-untyped-call]
            results = list(pipe.execute(raise_on_error=False))
            for res in results[:ahead]:
                if isinstance(res, Exception):
                    raise res
        return results[ahead:]
