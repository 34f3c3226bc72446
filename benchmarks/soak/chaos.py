"""The chaos soak's fault scheduler: rank kills, server restarts and network faults.

Every process of the soak (the client, each rank) reaches the server through its own
fault proxy (:class:`~benchmarks.soak.rig.Proxies`), so a network fault hits one
process, as a broken node or a flaky link does, while the rest run on.

:class:`Chaos` injects one fault every ``every_s`` (random within the range), drawn
from a shuffled deck of every kind, so each kind comes up once per round and a short
soak sees them all; a lost reply whose command was not sent in time is dealt again.
Kinds: ``rank_kill`` (SIGKILL, restart), ``server_restart``,
``hold`` (a stall without RST, 0.5-3 s), ``reset`` (RST of every connection),
``delay`` (50-300 ms of latency for 2-4 s), and lost replies: ``lose_evalsha`` (a
submit or report that ran but whose reply was lost), ``lose_xreadgroup_hold`` and
``lose_xreadgroup_reset`` (a delivery lost between read and ack), ``lose_xack``,
``lose_xread`` (a completion read lost). At most one network fault per proxy at a
time, so each one's end (and so its effect) is known. Each fault goes into the
:class:`~benchmarks.soak.faults.FaultLog` with the interval it was in effect: a
killed rank's or a restarted server's lasts until the rank (every rank) beats again,
with its new pid; a lost reply's from arming until it happened, plus the socket
timeout of the connection it left hanging (``then="hold"``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.soak.faults import Fault, FaultLog
from benchmarks.soak.rig import Beats, Proxies, Ranks
from broker_lookup.config import LookupConfig
from broker_lookup.tools.embedded import EmbeddedServer
from faultproxy.proxy import FaultProxy

__all__ = ["KINDS", "NETWORK_KINDS", "Chaos", "ChaosTiming"]

#: Lost-reply kinds: (command, then); None means hold or reset at random.
_LOSES: dict[str, tuple[str, str | None]] = {
    "lose_evalsha": ("EVALSHA", None),
    "lose_xreadgroup_hold": ("XREADGROUP", "hold"),
    "lose_xreadgroup_reset": ("XREADGROUP", "reset"),
    "lose_xack": ("XACK", None),
    "lose_xread": ("XREAD", None),
}
NETWORK_KINDS = ("hold", "reset", "delay", *_LOSES)
KINDS = ("rank_kill", "server_restart", *NETWORK_KINDS)
_RETRY_S = 0.2  #: every proxy busy with a fault: try the next one this soon


@dataclass(frozen=True)
class ChaosTiming:
    """How often faults come and how long the timed ones last (seconds, ms for delays)."""

    every_s: tuple[float, float] = (3.0, 8.0)
    hold_s: tuple[float, float] = (0.5, 3.0)
    delay_ms: tuple[float, float] = (50.0, 300.0)
    delay_s: tuple[float, float] = (2.0, 4.0)
    lose_wait_s: float = 5.0  #: a lost reply not triggered by then is disarmed


@dataclass
class _Effect:
    """A fault in effect: ``over(now)`` is the time its effect ended once it has, else None."""

    fault: Fault
    proxy: str | None  #: the proxy it occupies, if any
    over: Callable[[float], float | None]


class Chaos:
    """Injects faults at random and records each one's interval of effect in ``log``.

    Driven by :meth:`tick` from the soak's loop (no thread of its own); :meth:`finish`
    ends every network fault. ``server`` None (an external server): no restarts.
    """

    def __init__(
        self,
        rng: random.Random,
        log: FaultLog,
        proxies: Proxies,
        ranks: Ranks,
        server: EmbeddedServer | None,
        beats: Beats,
        config: LookupConfig,
        timing: ChaosTiming,
    ) -> None:
        self.rng = rng
        self.log = log
        self.proxies = proxies
        self.ranks = ranks
        self.server = server
        self.beats = beats
        self.timing = timing
        # How long a lost reply with then="hold" leaves its connection silent: the
        # client's writer uses the socket timeout, every loop connection (the client's
        # listener, all of a rank's) BLOCK + the breaker's threshold.
        self._hang_s = {
            "writer": config.socket_timeout_ms / 1000,
            "loop": config.loop_timeout_s,
        }
        self._kinds = [k for k in KINDS if server is not None or k != "server_restart"]
        self._deck: list[str] = []
        self._effects: list[_Effect] = []
        self.next_at = 0.0
        #: Each kind's injector: the fault's effect, or None if every target is busy.
        self._inject: dict[str, Callable[[str, float], _Effect | None]] = {
            "rank_kill": self._kill,
            "server_restart": self._restart,
            "hold": self._hold,
            "reset": self._reset,
            "delay": self._delay,
            **{kind: self._lose for kind in _LOSES},
        }

    def start(self, now: float) -> None:
        """The first fault comes one interval from ``now``."""
        self.next_at = now + self.rng.uniform(*self.timing.every_s)

    def tick(self, now: float) -> None:
        """End the faults that are over; inject the next one when it is due."""
        self.settle(now)
        if now >= self.next_at:
            self._inject_next(now)

    def settle(self, now: float) -> None:
        """End the faults that are over (and inject none)."""
        for effect in list(self._effects):
            ended = effect.over(now)
            if ended is not None:
                self.log.end(effect.fault, ended)
                self._effects.remove(effect)
                if not effect.fault.took_effect:
                    # Its command was not sent in time (its rank was down, say): deal
                    # the kind again this round, so a short soak still sees it happen.
                    self._deck.append(effect.fault.kind)

    def _inject_next(self, now: float) -> None:
        """The deck's first kind that has a free target now; refilled when empty."""
        if not self._deck:
            self._deck = self.rng.sample(self._kinds, len(self._kinds))
        for i, kind in enumerate(self._deck):
            injected = self._inject[kind](kind, now)
            if injected is not None:
                del self._deck[i]
                self._effects.append(injected)
                # A restart blocks a while: the interval counts from when it is done.
                self.next_at = time.monotonic() + self.rng.uniform(*self.timing.every_s)
                return
        self.next_at = now + _RETRY_S

    def finish(self, now: float) -> None:
        """End every network fault now; killed ranks and a restarted server come back alone."""
        for effect in list(self._effects):
            if effect.proxy is not None:
                self.proxies.by_name[effect.proxy].clear()
                self.log.end(effect.fault, now)
                self._effects.remove(effect)

    def _kill(self, kind: str, now: float) -> _Effect:
        rank = self.rng.randrange(self.ranks.n)
        fault = self.log.begin(kind, f"rank{rank}", now)
        self.ranks.kill_and_restart(rank)
        return _Effect(fault, None, self._beating([rank]))

    def _restart(self, kind: str, now: float) -> _Effect:
        assert self.server is not None  # not in the deck without one
        fault = self.log.begin(kind, "server", now)
        self.server.restart()  # same port: the proxies' upstream stays right
        return _Effect(fault, None, self._beating(list(range(self.ranks.n))))

    def _beating(self, ranks: list[int]) -> Callable[[float], float | None]:
        """Over once every rank of ``ranks`` beats from its current process again."""

        def over(now: float) -> float | None:
            pids = self.beats.pids(now)
            back = all(pids[r] == self.ranks.pid(r) for r in ranks)
            return now if back else None

        return over

    def _free(self, names: Sequence[str], running: bool = False) -> str | None:
        """A target among ``names`` whose proxy has no fault now, at random.

        ``running``: only a process that is up (a lost reply needs its command sent).
        """
        busy = {e.proxy for e in self._effects}
        if running:
            down = {e.fault.target for e in self._effects if e.proxy is None}
            busy |= set(names) if "server" in down else down
        free = [n for n in names if n not in busy]
        return self.rng.choice(free) if free else None

    def _hold(self, kind: str, now: float) -> _Effect | None:
        return self._timed(kind, now, self.timing.hold_s, FaultProxy.hold, FaultProxy.release)

    def _delay(self, kind: str, now: float) -> _Effect | None:
        ms = self.rng.uniform(*self.timing.delay_ms)
        return self._timed(
            kind,
            now,
            self.timing.delay_s,
            lambda p: p.delay(ms),
            lambda p: p.delay(0),
            f"{ms:.0f}ms",
        )

    def _timed(
        self,
        kind: str,
        now: float,
        lasts_s: tuple[float, float],
        begin: Callable[[FaultProxy], None],
        end: Callable[[FaultProxy], None],
        detail: str = "",
    ) -> _Effect | None:
        """A fault on one free proxy from now for a random time in ``lasts_s``."""
        name = self._free(list(self.proxies.by_name))
        if name is None:
            return None
        proxy = self.proxies.by_name[name]
        until = now + self.rng.uniform(*lasts_s)
        begin(proxy)
        fault = self.log.begin(kind, name, now, f"{detail} for {until - now:.1f}s".strip())

        def over(now: float) -> float | None:
            if now < until:
                return None
            end(proxy)
            return now

        return _Effect(fault, name, over)

    def _reset(self, kind: str, now: float) -> _Effect | None:
        name = self._free(list(self.proxies.by_name))
        if name is None:
            return None
        count = self.proxies.by_name[name].reset()
        fault = self.log.instant(kind, name, now, f"{count} connections")
        return _Effect(fault, None, lambda _now: now)

    def _lose(self, kind: str, now: float) -> _Effect | None:
        command, then = _LOSES[kind]
        then = then or self.rng.choice(("hold", "reset"))
        ranks = [f"rank{r}" for r in range(self.ranks.n)]
        # XREAD is the client's listener alone, XREADGROUP and XACK the ranks'; EVALSHA
        # is a submit (client) or a report (rank).
        names = ["client"] if command == "XREAD" else ranks
        name = self._free(["client", *ranks] if command == "EVALSHA" else names, running=True)
        if name is None:
            return None
        proxy = self.proxies.by_name[name]
        before = proxy.stats["replies_lost"]
        proxy.lose_reply(command, then=then)
        fault = self.log.begin(kind, name, now, f"{command} then={then}")
        fault.took_effect = False
        writer = name == "client" and command != "XREAD"
        hang_s = self._hang_s["writer" if writer else "loop"] if then == "hold" else 0.0
        give_up = now + self.timing.lose_wait_s

        def over(now: float) -> float | None:
            if proxy.stats["replies_lost"] > before:
                fault.took_effect = True
                return now + hang_s  # the hung connection lasts until its socket timeout
            if now >= give_up:
                proxy.clear()
                return now
            return None

        return _Effect(fault, name, over)
