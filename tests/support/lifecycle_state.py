"""Everything a rank's :class:`~workers.pipeline.lifecycle.Lifecycle` holds, as plain data:
for tests that run two rank pipelines side by side (one with a C extension, one without)
and compare them after every step."""

from __future__ import annotations

from typing import Any

import msgspec

from workers.pipeline.lifecycle import Job, Lifecycle


def job_fields(job: Job | None) -> tuple[Any, ...] | None:
    """Every field of ``job`` (None for none)."""
    return None if job is None else msgspec.structs.astuple(job)


def lifecycle_state(life: Lifecycle) -> dict[str, Any]:
    """Every map of ``life``, comparable across two instances."""
    state = vars(life)
    return {
        "jobs": {i: job_fields(j) for i, j in state["_jobs"].items()},
        "waiting": {i: (w.req, w.deadline) for i, w in state["_waiting"].items()},
        "held": list(state["_held"].items()),
        "progressed": {i: job_fields(j) for i, j in state["_progressed"].items()},
        "timers": sorted(state["_timers"]),
        "unsettled": list(state["_unsettled"].items()),
        "seen": list(state["_seen"].items()),
        "aborted": list(state["_aborted"].items()),
        "late": list(state["_late"].items()),
        "states": dict(state["_states"]),
        "events": dict(state["_events"]),
        "plan": (state["_wake_at"], state["_soonest"], state["_progress_due"]),
    }
