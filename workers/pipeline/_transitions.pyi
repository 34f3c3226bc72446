"""Stub of the optional C extension (``_transitions.c``); see ``workers.pipeline.lifecycle``."""

from broker_lookup.protocol.messages import LookupRequest
from workers.pipeline.lifecycle import Job, Lifecycle

def setup(job: type[Job], /) -> None:
    """The job class the transitions make (called once, where ``Job`` is defined)."""

def start(lifecycle: Lifecycle, req: LookupRequest, now: float, deadline: float, /) -> bool:
    """``on_request``'s start of a fresh id, made; False: not that case, nothing changed."""

def report(lifecycle: Lifecycle, lookup_id: str, now: float, /) -> Job | None:
    """``on_report``'s report, made (the job, now reporting); None: not that case."""

def hold(lifecycle: Lifecycle, lookup_id: str, gen: int, now: float, /) -> bool:
    """``on_settled``'s hold of a kept report, made; False: not that case, nothing changed."""
