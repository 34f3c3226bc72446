"""Running the protocol's Lua scripts over a link, called by SHA with NOSCRIPT recovery.

The script cache is volatile (restart, failover, ``SCRIPT FLUSH``), so every call goes
through :meth:`ScriptSet.run`, which reloads and runs again once the calls that found no
script: one runner, one recovery, whatever the link (a
:class:`~broker_lookup.transport.link.LeanLink`, or a ``ClientLink`` over redis-py's
pipeline, a ``ClusterPipeline`` on Redis Cluster, where ``SCRIPT LOAD`` goes to every
primary). What a call is and the scripts themselves are
:mod:`broker_lookup.protocol.scripts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError, ResponseError

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.scripts import Call, ScriptSource
from broker_lookup.transport.link import ClientLink, Link

__all__ = ["ScriptSet", "is_noscript"]


def is_noscript(result: object) -> bool:
    """True if ``result`` is the error Redis gives for a script missing from its cache."""
    return isinstance(result, NoScriptError) or (
        isinstance(result, ResponseError) and str(result).startswith("NOSCRIPT")
    )


class ScriptSet(ScriptSource):
    """The protocol's scripts, run over a link and reloaded on NOSCRIPT."""

    def load(self, client: redis.Redis) -> None:
        """Load every script into the server's cache (idempotent)."""
        with translate_redis_errors("loading Lua scripts"):
            for text in self.source.values():
                client.script_load(text)

    def run(
        self,
        link: Link,
        client: redis.Redis,
        calls: Sequence[Call],
        ahead: Sequence[Command] = (),
        read: Command | None = None,
    ) -> list[Any]:
        """Run ``calls`` in one write on ``link``; their results, per-call errors as values.

        ``ahead``: commands written before the scripts in the same write (a rank's dead
        letters and XACK); an error reply to one of those is raised. ``read``: a read
        written last, its reply left on ``link`` (:meth:`Link.take_read`). Transport
        errors come out as redis-py raised them; the caller translates them.

        Calls that found no script (NOSCRIPT) did not run: they run again once, after
        :meth:`load` through ``client`` (which reaches every primary of a cluster), so
        nothing is applied twice.
        """
        replies = link.call([*ahead, *(self.command(c) for c in calls)], read)
        for reply in replies[: len(ahead)]:
            if isinstance(reply, ResponseError):
                raise reply
        results = replies[len(ahead) :]
        redo = [i for i, res in enumerate(results) if is_noscript(res)]
        if not redo:
            return results
        link.settle_read()  # the connection is needed now: take the read's reply first
        self.load(client)
        again = link.call([self.command(calls[i]) for i in redo])
        for i, res in zip(redo, again, strict=True):
            results[i] = res
        return results

    def call(self, client: redis.Redis, call: Call) -> Any:
        """Run one script now through ``client`` (a one-off: a release at close)."""
        with translate_redis_errors("running Lua scripts"):
            return self.run(ClientLink(client), client, [call])[0]
