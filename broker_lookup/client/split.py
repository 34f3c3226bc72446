"""A split engine is loud in its scheduler.

Where the processes of one engine derive different namespaces (see
:mod:`broker_lookup.integrations.identity`), the scheduler sees ranks with no heartbeat
while those ranks live, with no scheduler, under another namespace of the same
configured id: every lookup then answers 0. :class:`SplitWatch` looks for that while
ranks are missing: it reads the configured id's live namespaces (:mod:`members`), and in
each one the heartbeats of all our ranks and the scheduler's lease. A namespace with no
scheduler that holds ranks we miss and none of those we have, for ``confirm_s`` (another
engine's scheduler starts after its ranks, minutes later for a large model), is the other
half: an ERROR names both namespaces and the likely cause. Another replica's ranks (its
namespace has a scheduler, or ranks we have too) and the other data-parallel engines of
our launch (namespaces that differ in ``-dp<k>`` only) are not a split.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import redis

from broker_lookup.config import env_name
from broker_lookup.errors import REDIS_ERRORS, BrokerLookupError
from broker_lookup.protocol.fingerprint import STALE_MS
from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace, configured_of, instance_of
from broker_lookup.transport.members import LWS_PREFIX, RENDEZVOUS_PREFIX, live_namespaces

__all__ = ["CHECK_EVERY_S", "CONFIRM_S", "REPEAT_S", "SplitWatch", "split_cause"]

logger = logging.getLogger(__name__)

#: How often the namespaces are read while ranks are missing.
CHECK_EVERY_S = 2.0
#: How often one split is logged again while it lasts.
REPEAT_S = 300.0
#: How long a namespace must look like our other half before it is called one.
CONFIRM_S = 20.0
#: At most this many other namespaces are looked into per check.
_MAX_NAMESPACES = 32
_ENV_INSTANCE = env_name("instance_id")
_DP_TAG = re.compile(r"-dp\d+$")


class SplitWatch:
    """The scheduler's split check, run from its listener's sweep (never the hot path).

    ``expected`` are the engine's ranks; ``missing`` returns those with no heartbeat, or
    None before the first heartbeat read. Never raises: a failed read is retried at the
    next check.
    """

    def __init__(
        self,
        keys: KeySpace,
        expected: tuple[int, ...],
        missing: Callable[[], frozenset[int] | None],
        confirm_s: float = CONFIRM_S,
    ) -> None:
        self._keys = keys
        self._expected = expected
        self._missing = missing
        #: How long a namespace must look like our other half (see the module).
        self.confirm_s = confirm_s
        self._next = 0.0
        self._logged: dict[tuple[str, tuple[int, ...]], float] = {}
        self._since: dict[tuple[str, tuple[int, ...]], float] = {}
        #: The last check's finding: other namespace -> the missing ranks alive there.
        self.found: dict[str, tuple[int, ...]] = {}
        #: Checks completed (each one read every live namespace of our configured id).
        self.checks = 0

    def tick(self, client: redis.Redis) -> None:
        """:meth:`check` if ranks are missing and CHECK_EVERY_S has passed."""
        now = time.monotonic()
        missing = self._missing()
        if not missing:
            self.found, self._since = {}, {}
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
        suspects: dict[tuple[str, tuple[int, ...]], float] = {}
        ranks = list(self._expected)
        for other in live_namespaces(client, ours, STALE_MS)[:_MAX_NAMESPACES]:
            if _DP_TAG.sub("", other) == _DP_TAG.sub("", ours):
                continue  # another data-parallel engine of our launch
            keys = KeySpace(other)
            pipe = client.pipeline(transaction=False)
            pipe.get(keys.owner(SCHEDULER_ROLE))
            pipe.mget([keys.heartbeat(r) for r in ranks])
            scheduler, beats = pipe.execute()
            there = {r for r, beat in zip(ranks, beats, strict=True) if beat is not None}
            alive = tuple(sorted(there & missing))
            if alive and scheduler is None and not there - missing:
                suspects[(other, alive)] = self._since.get((other, alive), now)
        self._since = suspects
        found = {o: a for (o, a), since in suspects.items() if now - since >= self.confirm_s}
        # Bounded: only splits logged within REPEAT_S are remembered.
        self._logged = {k: t for k, t in self._logged.items() if now - t < REPEAT_S}
        for other, alive in found.items():
            if (other, alive) in self._logged:
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
        self.found = found  # after the log: a reader that sees it finds the log line too
        self.checks += 1


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
