"""The rank's reader always reads new entries: the timed replay of its own pending entries
comes between reads of new ones, never instead of them, however long a turn takes."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from workers.pipeline import reader as reader_module
from workers.pipeline.clock import ServerClock
from workers.pipeline.reader import REPLAY_EVERY_S, Reader


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reads(turn_s: float, turns: int, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each read asks for ('0': the own pending entries, '>': new ones) when every
    turn takes ``turn_s`` and nothing is pending."""
    clock = _Clock()
    # The reader's clock alone (its module's ``time``), not every thread's.
    monkeypatch.setattr(reader_module, "time", SimpleNamespace(monotonic=clock))
    reader = Reader(LookupConfig(), KeySpace("e"), 0, ServerClock())
    asked = []
    for _ in range(turns):
        command = reader.read_command()
        asked.append(str(command[-1]))
        reader.parse([])  # nothing pending, nothing new
        clock.now += turn_s
    return asked


@pytest.mark.parametrize("turn_s", [0.01, 0.5, REPLAY_EVERY_S, 1.5, 5.0])
def test_every_other_read_at_least_reads_new_entries(
    turn_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _reads(turn_s, 40, monkeypatch)
    assert asked[0] == "0"  # a (re)started rank first finishes what it had been given
    assert all(">" in pair for pair in itertools.pairwise(asked[1:]))
    if turn_s * len(asked) > 2 * REPLAY_EVERY_S:
        assert "0" in asked[2:]  # and it still replays, once a second at most


def test_a_replay_comes_at_most_once_a_second_on_a_fast_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _reads(0.01, 500, monkeypatch)  # 5 s of 10 ms turns
    assert 4 <= asked.count("0") <= 6
