"""``printable.shown`` (a caller's id on a terminal or in a log line) and ``split`` (which
namespaces of one configured id form a split engine)."""

from __future__ import annotations

from broker_lookup.ops.split import View, find_splits
from broker_lookup.printable import shown
from broker_lookup.protocol.keys import configured_of


def test_shown_escapes_what_a_terminal_acts_on_and_cuts_nothing() -> None:
    assert shown("vllm-0@1796611533336466837") == "vllm-0@1796611533336466837"
    assert shown("é 東京 id") == "é 東京 id"  # printable: kept as it is
    assert shown("a\nb\r\x1b[2J\x9b\u202e\x00") == r"a\nb\r\x1b[2J\x9b\u202e\x00"
    long = "x" * 10_000 + "\n"
    assert shown(long) == "x" * 10_000 + r"\n"
    assert shown(12) == "12"


def test_configured_id_of_a_namespace() -> None:
    assert configured_of("mn@1796611254403740308") == "mn"
    assert configured_of("vllm-engine") == "vllm-engine"


def _v(ns: str, sched: bool, *ranks: int, dead: frozenset[int] | None = None) -> View:
    return View(ns, sched, frozenset(ranks), dead)


def test_a_split_needs_a_scheduler_missing_ranks_that_serve_a_namespace_without_one() -> None:
    (split,) = find_splits([_v("mn@1", True, 0), _v("mn@2", False, 1)])
    assert (split.configured, split.scheduler_ns, split.ranks_ns, split.ranks) == (
        "mn",
        "mn@1",
        "mn@2",
        (1,),
    )
    # Two whole replicas; a replica whose ranks started before its scheduler.
    assert find_splits([_v("mn@1", True, 0, 1), _v("mn@2", True, 0, 1)]) == []
    assert find_splits([_v("mn@1", True, 0, 1), _v("mn@2", False, 0, 1)]) == []
    # Other configured ids never pair; a known-dead rank set decides when published.
    assert find_splits([_v("a@1", True, 0), _v("b@2", False, 1)]) == []
    assert find_splits([_v("mn@1", True, dead=frozenset()), _v("mn@2", False, 1)]) == []
    (split,) = find_splits([_v("mn@1", True, 1, dead=frozenset({0})), _v("mn@2", False, 0)])
    assert split.ranks == (0,) and "rank(s) 0" in split.message()
