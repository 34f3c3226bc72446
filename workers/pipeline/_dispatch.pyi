"""Stub of the optional C extension (``_dispatch.c``); see ``workers.pipeline.dispatch``."""

from broker_lookup.protocol.messages import LookupRequest, Request
from workers.pipeline.dispatch import Dispatcher
from workers.pipeline.reporter import Report, Reporter

def setup(
    request: type[LookupRequest], report: type[Report], buckets: tuple[float, ...], /
) -> None:
    """The request and report classes and the histogram's buckets (once, at import)."""

def handle(dispatcher: Dispatcher, msg: Request, remaining_ms: float, /) -> None:
    """``Dispatcher._handle``: a fresh id started here, anything else handed to Python."""

def report(dispatcher: Dispatcher, lookup_id: str, hits: object, /) -> None:
    """``Dispatcher._report``: a running job's report sent here, anything else to Python."""

def settle(dispatcher: Dispatcher, report: Report, answer: str, /) -> None:
    """``Dispatcher._settle``: a kept report held here, anything else handed to Python."""

def serve(dispatcher: Dispatcher, messages: list[tuple[Request, float]], /) -> list[Report]:
    """``Dispatcher._serve``: a batch through ``handle`` in the reporter's window, in C."""

def put(reporter: Reporter, report: Report, /) -> None:
    """``Reporter._put_report``, made in C."""
