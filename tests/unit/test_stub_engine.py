"""StubEngine, the library's stub of the engine seam: each mode, the records, the failures."""

from __future__ import annotations

import threading

import pytest

from broker_lookup.engine import LookupEngine
from broker_lookup.stub_engine import StubEngine


class Sink:
    """Stands in for the lookup server: keeps every report."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, int]] = []

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        self.reports.append((lookup_id, num_hit_tokens))


def wired(engine: StubEngine) -> Sink:
    sink = Sink()
    engine.post_init(async_lookup_server=sink)
    return sink


def test_it_is_a_lookup_engine() -> None:
    assert isinstance(StubEngine(), LookupEngine)


def test_manual_records_and_reports_only_when_told() -> None:
    engine = StubEngine()
    sink = wired(engine)
    engine.async_lookup_and_prefetch("a", [1, 2], [16, 16], request_configs={"k": "v"})
    assert engine.started == [("a", [1, 2], [16, 16], {"k": "v"})]
    assert sink.reports == []
    engine.report("a", 16)
    assert sink.reports == [("a", 16)]
    engine.cleanup_memory_objs("a")
    assert engine.released == ["a"]


def test_instant_with_hits_reports_at_most_the_tokens_asked() -> None:
    engine = StubEngine("instant", hits=24)
    sink = wired(engine)
    engine.async_lookup_and_prefetch("big", [1, 2], [16, 16])
    engine.async_lookup_and_prefetch("small", [1], [16])
    assert sink.reports == [("big", 24), ("small", 16)]
    assert engine.started_ids() == ["big", "small"]


@pytest.mark.parametrize(("fraction", "hits"), [(1.0, 48), (0.5, 16), (0.0, 0)])
def test_instant_with_a_fraction_reports_that_share_of_the_chunks(
    fraction: float, hits: int
) -> None:
    engine = StubEngine("instant", fraction=fraction)
    sink = wired(engine)
    engine.async_lookup_and_prefetch("f", [1, 2, 3], [16, 16, 16])
    assert sink.reports == [("f", hits)]


def test_mute_records_and_never_reports() -> None:
    engine = StubEngine("mute")
    sink = wired(engine)
    engine.async_lookup_and_prefetch("m", [1], [16])
    assert engine.started_ids() == ["m"]
    assert sink.reports == []


def test_fail_start_raises_before_recording() -> None:
    engine = StubEngine("instant", hits=1)
    sink = wired(engine)
    engine.fail_start = True
    with pytest.raises(RuntimeError, match="fail_start"):
        engine.async_lookup_and_prefetch("x", [1], [16])
    assert engine.started == [] and sink.reports == []


def test_without_records_nothing_grows() -> None:
    engine = StubEngine("instant", record=False)
    sink = wired(engine)
    engine.async_lookup_and_prefetch("r", [1], [16])
    engine.cleanup_memory_objs("r")
    assert engine.started == [] and engine.released == []
    assert sink.reports == [("r", 16)]


def test_report_without_a_server_says_how_to_wire_one() -> None:
    with pytest.raises(RuntimeError, match="post_init"):
        StubEngine().report("a", 1)


@pytest.mark.parametrize(
    "kwargs", [{"mode": "eager"}, {"hits": -1}, {"fraction": 1.5}, {"fraction": -0.1}]
)
def test_bad_arguments_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        StubEngine(**kwargs)  # type: ignore[arg-type]  # deliberately wrong values


def test_records_are_safe_from_several_threads() -> None:
    engine = StubEngine()
    wired(engine)

    def start(prefix: str) -> None:
        for i in range(500):
            engine.async_lookup_and_prefetch(f"{prefix}{i}", [i], [16])

    threads = [threading.Thread(target=start, args=(p,)) for p in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(engine.started_ids()) == 2000
