"""One script runner over any link: ``ScriptSet.run`` on a lean link and on redis-py's
pipeline (the ``ClientLink`` Redis Cluster gets), its one NOSCRIPT recovery (also with a
rank's XACK ahead and its next read behind), and the rank's queued reports sent through
it on the reporter thread's own link."""

from __future__ import annotations

import uuid

import pytest
import redis
from helpers import Backend, wait_until

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import CANCEL, Call
from broker_lookup.transport.link import ClientLink, Link, open_link, stream_entries
from broker_lookup.transport.script_runner import ScriptSet
from workers.pipeline.reporter import Report, Reporter


def _cancel(ks: KeySpace, lookup_id: str) -> Call:
    return Call(CANCEL, (ks.lookup(lookup_id), ks.requests), [1, 100, 60_000, "type", "abort"])


def _open(backend: Backend, kind: str) -> tuple[redis.Redis, Link, KeySpace]:
    """A client, a link of ``kind`` on it, and keys no other test uses."""
    client = backend.factory()
    link: Link = open_link(client) if kind == "lean" else ClientLink(client)
    return client, link, KeySpace("sr-" + uuid.uuid4().hex[:8])


@pytest.mark.parametrize("kind", ["lean", "client"])
def test_a_flushed_script_is_loaded_and_run_once_over_either_link(
    backend: Backend, kind: str
) -> None:
    client, link, ks = _open(backend, kind)
    try:
        backend.factory().script_flush()
        assert ScriptSet().run(link, client, [_cancel(ks, "a"), _cancel(ks, "b")]) == [0, 0]
        assert client.xlen(ks.requests) == 2  # each ran once: NOSCRIPT applied nothing
    finally:
        link.close()


@pytest.mark.parametrize("kind", ["lean", "client"])
def test_an_error_ahead_of_the_scripts_is_raised(backend: Backend, kind: str) -> None:
    client, link, ks = _open(backend, kind)
    try:
        with pytest.raises(redis.ResponseError):
            ScriptSet().run(link, client, [_cancel(ks, "a")], ahead=[("NO-SUCH-COMMAND",)])
        assert ScriptSet().run(link, client, [_cancel(ks, "a")]) == [0]  # still in step
    finally:
        link.close()


@pytest.mark.parametrize("kind", ["lean", "client"])
def test_the_recovery_keeps_the_read_behind_the_scripts(backend: Backend, kind: str) -> None:
    client, link, ks = _open(backend, kind)
    client.xadd(ks.done, {"k": "v"})
    read = ("XREAD", "COUNT", 10, "STREAMS", ks.done, "0-0")
    try:
        backend.factory().script_flush()
        results = ScriptSet().run(link, client, [_cancel(ks, "a")], ahead=[("PING",)], read=read)
        assert results == [0]
        assert link.reading
        [(_, fields)] = stream_entries(link.take_read())  # the read's reply, not a script's
        assert fields == {b"k": b"v"} and not link.reading
    finally:
        link.close()


def test_a_direct_write_is_declined_by_a_client_link(backend: Backend) -> None:
    link = ClientLink(backend.factory())
    assert not link.accepts_direct
    assert link.send_nowait([("PING",)]) is None  # nothing written: the caller queues
    assert link.replies(1) == []
    link.drop()
    assert link.call([("PING",)]) == [True]  # redis-py's callback shapes the reply


def test_queued_reports_go_through_the_runner_on_the_reporter_link(backend: Backend) -> None:
    """A report sent from the reporter's own thread after the server lost its scripts is
    answered by report.lua (an unknown lookup: ``dropped``), not ``error``."""
    settled: list[tuple[Report, str]] = []
    ks = KeySpace("sr-" + uuid.uuid4().hex[:8])
    reporter = Reporter(LookupConfig(), ks, 0, backend.factory, lambda r, a: settled.append((r, a)))
    backend.factory().script_flush()
    reporter.start()
    try:
        reporter.put(Report("gone", 1, 4))
        wait_until(lambda: settled, message="the report answered")
        assert settled == [(Report("gone", 1, 4), "dropped")]
        assert reporter.errors == 0
    finally:
        assert reporter.stop(5)
