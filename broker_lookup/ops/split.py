"""A split engine: one engine's processes in two namespaces of one configured id.

Every process of one vLLM engine must share one key namespace. Where a launch gives
its processes different ones (a multi-node launch whose nodes drew different instance
ids, ``<engine_id>@<instance>``), the scheduler waits for ranks that serve another
namespace: every lookup misses, and each half looks healthy alone. The fleet-wide
readers (``inspect``, ``doctor``, the exporter) compare the namespaces of each
configured id and name such a pair: a namespace whose scheduler misses ranks beside one
whose ranks have no scheduler.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from broker_lookup.protocol.keys import PREFIX, SCHEDULER_ROLE, configured_of

__all__ = [
    "EVERY_SCHEDULER_LEASE",
    "Split",
    "View",
    "find_splits",
]

#: SCAN pattern of every engine's scheduler lease: a namespace with a scheduler and, until
#: its first lookup, no request stream.
EVERY_SCHEDULER_LEASE = f"{PREFIX}:{{*}}:owner:{SCHEDULER_ROLE}"


@dataclass(frozen=True)
class View:
    """What a reader saw of one namespace: whether a scheduler holds it, its live ranks
    and, where the scheduler published them, the ranks it finds dead (None: unknown)."""

    namespace: str
    scheduler: bool
    ranks: frozenset[int]
    dead: frozenset[int] | None = None


@dataclass(frozen=True)
class Split:
    """A scheduler in ``scheduler_ns`` missing ``ranks``, which live in ``ranks_ns``."""

    configured: str
    scheduler_ns: str
    ranks_ns: str
    ranks: tuple[int, ...]

    def message(self) -> str:
        """One line naming both namespaces and the likely cause."""
        ranks = ",".join(map(str, self.ranks))
        return (
            f"engine {self.configured} is split: the scheduler of {self.scheduler_ns} misses "
            f"rank(s) {ranks}, which serve {self.ranks_ns} (no scheduler there), so its "
            "lookups never reach them. Likely a multi-node launch whose nodes drew different "
            "instance ids: give every process of the engine the same explicit engine id"
        )


def find_splits(views: Iterable[View]) -> list[Split]:
    """Every (scheduler namespace, rank namespace) pair of one configured id where ranks
    the scheduler misses serve the other namespace, which has no scheduler."""
    groups: dict[str, list[View]] = defaultdict(list)
    for view in views:
        groups[configured_of(view.namespace)].append(view)
    found = []
    for configured, group in sorted(groups.items()):
        heads = [v for v in group if v.scheduler]
        orphans = [v for v in group if not v.scheduler and v.ranks]
        for orphan in orphans:
            for head in heads:
                # Known dead ranks say what the scheduler misses; else any it lacks.
                lacking = head.dead if head.dead is not None else orphan.ranks - head.ranks
                missing = tuple(sorted(orphan.ranks & lacking))
                if missing:
                    found.append(Split(configured, head.namespace, orphan.namespace, missing))
    return found
