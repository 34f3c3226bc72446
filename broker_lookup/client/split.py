"""A split engine is loud in its scheduler.

Where the processes of one engine derive different namespaces (see
:mod:`broker_lookup.integrations.identity`), the scheduler sees ranks with no heartbeat
while those ranks live, with no scheduler, under another namespace of the same
configured id: every lookup then answers 0. :class:`SplitWatch` looks for that while
ranks are missing: it reads the configured id's live namespaces (:mod:`members`), and in
each one without a scheduler, the heartbeats of the ranks it misses; it logs an ERROR
naming both namespaces and the likely cause (another replica's ranks, whose namespace has
its own scheduler, are not a split).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from broker_lookup.config import env_name
from broker_lookup.errors import REDIS_ERRORS, BrokerLookupError
from broker_lookup.protocol.fingerprint import STALE_MS
from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace, configured_of, instance_of
from broker_lookup.protocol.members import LWS_PREFIX, RENDEZVOUS_PREFIX, live_namespaces

__all__ = ["CHECK_EVERY_S", "REPEAT_S", "SplitWatch", "split_cause"]

logger = logging.getLogger(__name__)

#: How often the namespaces are read while ranks are missing.
CHECK_EVERY_S = 2.0
#: How often one split is logged again while it lasts.
REPEAT_S = 300.0
#: At most this many other namespaces are looked into per check.
_MAX_NAMESPACES = 32
_ENV_INSTANCE = env_name("instance_id")


class SplitWatch:
    """The scheduler's split check, run from its listener's sweep (never the hot path).

    ``missing`` returns the ranks with no heartbeat, or None before the first heartbeat
    read. Never raises: a failed read is retried at the next check.
    """

    def __init__(self, keys: KeySpace, missing: Callable[[], frozenset[int] | None]) -> None:
        self._keys = keys
        self._missing = missing
        self._next = 0.0
        self._logged: dict[tuple[str, tuple[int, ...]], float] = {}
        #: The last check's finding: other namespace -> the missing ranks alive there.
        self.found: dict[str, tuple[int, ...]] = {}
        #: Checks completed (each one read every live namespace of our configured id).
        self.checks = 0

    def tick(self, client: redis.Redis) -> None:
        """:meth:`check` if ranks are missing and CHECK_EVERY_S has passed."""
        now = time.monotonic()
        missing = self._missing()
        if not missing:
            self.found = {}
            return
        if now < self._next:
            return
        self._next = now + CHECK_EVERY_S
        try:
            self.check(client, missing, now)
        except (BrokerLookupError, *REDIS_ERRORS) as exc:
            logger.debug("split check of engine %s failed: %s", self._keys.engine_id, exc)

    def check(self, client: redis.Redis, missing: frozenset[int], now: float) -> None:
        """Look for ``missing`` ranks alive under another namespace with no scheduler."""
        ours = self._keys.engine_id
        found: dict[str, tuple[int, ...]] = {}
        ranks = sorted(missing)
        for other in live_namespaces(client, ours, STALE_MS)[:_MAX_NAMESPACES]:
            keys = KeySpace(other)
            pipe = client.pipeline(transaction=False)
            pipe.get(keys.owner(SCHEDULER_ROLE))
            pipe.mget([keys.heartbeat(r) for r in ranks])
            scheduled, beats = pipe.execute()
            alive = tuple(r for r, beat in zip(ranks, beats, strict=True) if beat is not None)
            if alive and scheduled is None:
                found[other] = alive
        self.found = found
        self.checks += 1
        for other, alive in found.items():
            last = self._logged.get((other, alive))
            if last is not None and now - last < REPEAT_S:
                continue
            self._logged[(other, alive)] = now
            logger.error(
                "engine %s is SPLIT: rank(s) %s have no heartbeat in %s but are alive in %s, "
                "another namespace of configured id %s with no scheduler: their lookups "
                "answer 0. Likely cause: %s",
                ours,
                ",".join(map(str, alive)),
                ours,
                other,
                configured_of(ours),
                split_cause(ours, other),
            )


def _kind(namespace: str) -> str:
    instance = instance_of(namespace)
    if instance is None:
        return "configured"
    if instance.startswith(RENDEZVOUS_PREFIX):
        return "rendezvous"
    if instance.startswith(LWS_PREFIX):
        return "lws"
    if instance.split("-dp")[0].isdigit():
        return "vllm"
    return "setting"


def split_cause(ours: str, theirs: str) -> str:
    """The likely reason the processes of one engine derived ``ours`` and ``theirs``."""
    kinds = {_kind(ours), _kind(theirs)}
    fix = f"set {_ENV_INSTANCE} to one value in every process of this engine"
    if "configured" in kinds:
        return (
            "one side found no vLLM config above LMCache's factory (or runs without the "
            f"vLLM plugin) and uses the configured id as is; {fix}"
        )
    if kinds == {"rendezvous"}:
        return (
            "the nodes name the rendezvous differently: give every node the same "
            f"--master-addr and --master-port, or {fix}"
        )
    if kinds == {"lws"}:
        return f"the processes see different LWS_LEADER_ADDRESS values; {fix}"
    if kinds == {"vllm"}:
        return (
            "each side built its own vLLM config, so each drew its own instance id (a "
            "multi-node launch without --nnodes, vLLM's external launcher, or a rank "
            f"started on its own); {fix}"
        )
    if kinds == {"setting"}:
        return f"the processes were given different instance settings ({_ENV_INSTANCE})"
    return (
        "the processes derive their instance differently (--nnodes or LWS_* set on some "
        f"nodes only, or mixed broker-lookup versions); {fix}"
    )
