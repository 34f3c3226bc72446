"""Running the protocol's Lua scripts, called by SHA with NOSCRIPT recovery.

The script cache is volatile (restart, failover, ``SCRIPT FLUSH``), so every call goes
through :class:`ScriptSet`, which reloads and retries once on NOSCRIPT, in a pipeline too.
On Redis Cluster the pipeline is a ``ClusterPipeline`` and ``SCRIPT LOAD`` goes to every
primary. What a call is and the scripts themselves are :mod:`broker_lookup.protocol.scripts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError, ResponseError

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.scripts import Call, ScriptSource
from broker_lookup.transport.link import Link

__all__ = ["Before", "ScriptSet", "is_noscript"]

#: Queues extra commands on a pipeline ahead of the scripts; returns how many.
Before = Callable[[Any], int]


def is_noscript(result: object) -> bool:
    """True if ``result`` is the error Redis gives for a script missing from its cache."""
    return isinstance(result, NoScriptError) or (
        isinstance(result, ResponseError) and str(result).startswith("NOSCRIPT")
    )


class ScriptSet(ScriptSource):
    """The protocol's scripts, run: in pipelines and over lean links, reloaded on NOSCRIPT."""

    def load(self, client: redis.Redis) -> None:
        """Load every script into the server's cache (idempotent)."""
        with translate_redis_errors("loading Lua scripts"):
            for text in self.source.values():
                client.script_load(text)

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
