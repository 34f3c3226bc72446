"""One process's claim on one role of an engine (a rank, or the scheduler): one owner each.

:class:`Lease` keeps what ``claim.lua`` told this process and what its own clock says;
it does no I/O itself: its owner thread, the process's beat
(:class:`~broker_lookup.transport.beat.Beat`, never a loop that serves), runs
:meth:`Lease.claim_call` with :func:`run_claim` every heartbeat interval and hands the
reply to :meth:`Lease.on_reply`. The threads that serve read :meth:`Lease.held` and
:attr:`Lease.fence`, and wait on :meth:`Lease.wait_held` while it is not held.

The rules it enforces locally, on top of the server's:

* A lease counts as held only for ``lease_ms`` after the last claim that succeeded was
  *sent* (not answered): a process paused or cut off longer than that stops serving
  before any other process can have taken over, until a renewal succeeds.
* A process that finds another live holder says so once per episode at ERROR, naming
  both processes, and counts it (``conflicts``); one that loses its lease to another
  (``lost``) stops serving and goes back to claiming.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.ownership import Holder, Identity, parse_claim_reply
from broker_lookup.protocol.scripts import Call, Fence, claim_call, release_call
from broker_lookup.protocol.stats import Ownership
from broker_lookup.transport.link import Link
from broker_lookup.transport.script_runner import ScriptSet

__all__ = ["Lease", "run_claim"]

logger = logging.getLogger(__name__)


class Lease:
    """This process's lease on ``role`` of ``keys``' engine, as far as it knows.

    Args:
        keys: the engine's key space.
        role: ``rank_role(r)`` or ``SCHEDULER_ROLE``.
        what: how log lines name the role, e.g. ``"rank 0"`` or ``"the scheduler"``.
        lease_ms: the lease (``LookupConfig.lease_ms``).
        epochs_ttl_ms: PEXPIRE of the epoch counter (``LookupConfig.epochs_ttl_ms``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        keys: KeySpace,
        role: str,
        what: str,
        lease_ms: int,
        epochs_ttl_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys
        self.role = role
        self.identity = Identity.mine()
        self._what = f"{what} of engine {keys.engine_id}"
        self._lease_ms = lease_ms
        self._lease_s = lease_ms / 1000
        self._epochs_ttl_ms = epochs_ttl_ms
        self._clock = clock
        self._key = keys.owner(role)
        #: The token held (None: not held); kept through a lapse until a reply says more.
        self.token: str | None = None
        #: The other process holding the role, when a claim last found one.
        self.holder: Holder | None = None
        self._renewed = -float("inf")  # send time of the last claim that succeeded
        self._unheld_since: float | None = clock()
        self._contended_since: float | None = None  # first 'held' of this episode
        self._lapse_logged = False
        #: ``conflicts``: episodes of finding another live holder; ``lost``: leases lost
        #: to another process; ``claims``: leases taken (first or after an expiry).
        self.counts = {"conflicts": 0, "lost": 0, "claims": 0}
        self._changed = threading.Condition()  # notified on every claim reply
        #: Claims and renewals that succeeded: a report fenced under an older token waits
        #: for the next one (it learns the token Redis holds, or that another process does).
        self.renewals = 0

    # -- what the owner thread sends -----------------------------------------------------

    def claim_call(self, heartbeat: tuple[str, int] | None = None) -> Call:
        """The ``claim.lua`` call claiming or renewing the lease (with a rank's heartbeat)."""
        return claim_call(
            self.keys,
            self.role,
            self.identity,
            lease_ms=self._lease_ms,
            epochs_ttl_ms=self._epochs_ttl_ms,
            heartbeat=heartbeat,
        )

    def release_call(self, rank: bool) -> Call:
        """The ``claim.lua`` call releasing the lease if held (and a rank's heartbeat)."""
        return release_call(self.keys, self.role, self.identity, rank=rank)

    @property
    def fence(self) -> Fence:
        """``report.lua``'s fence: the lease key and the token held ("" fences everything)."""
        return (self._key, self.token or "")

    # -- state ---------------------------------------------------------------------------

    def held(self, now: float | None = None) -> bool:
        """Whether this process may serve the role now: it holds a token, renewed within
        the lease by its own clock."""
        if self.token is None:
            return False
        t = self._clock() if now is None else now
        return t - self._renewed < self._lease_s

    def wait_held(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until this process may serve the role, or a claim found
        another holder; True if it may serve then."""
        with self._changed:
            self._changed.wait_for(lambda: self.held() or self.holder is not None, timeout_s)
        return self.held()

    def wait_renewed(self, after: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a renewal beyond the ``after``-th (see
        :attr:`renewals`), or a claim that found another holder; True if this process may
        serve the role then."""
        with self._changed:
            self._changed.wait_for(
                lambda: self.renewals > after or self.holder is not None, timeout_s
            )
        return self.held()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def unheld_for(self, now: float | None = None) -> float:
        """Seconds since this process last could serve the role (0.0 while it can)."""
        t = self._clock() if now is None else now
        if self.held(t):
            return 0.0
        since = self._unheld_since
        if since is None:  # it just lapsed: count from the lapse
            since = self._unheld_since = self._renewed + self._lease_s
        return max(0.0, t - since)

    def contended_for(self, now: float | None = None) -> float:
        """Seconds since a claim first found another live holder, without this process
        holding the lease since (0.0: no other holder seen; Redis being away is not one)."""
        since = self._contended_since
        if since is None:
            return 0.0
        return max(0.0, (self._clock() if now is None else now) - since)

    def state(self) -> Ownership:
        """For stats, metrics and readiness: held, epoch, the other holder, counts."""
        holder = self.holder
        return Ownership(
            owner=self.held(),
            epoch=_epoch(self.token),
            holder=holder.describe() if holder is not None else None,
            conflicts=self.counts["conflicts"],
            lost=self.counts["lost"],
            claims=self.counts["claims"],
        )

    def not_serving_reason(self) -> str:
        """Why the role is not served by this process (for ``/readyz`` and logs)."""
        if self.holder is not None:
            return f"{self._what} is held by another process ({self.holder.describe()})"
        if self.token is not None:
            return f"the lease of {self._what} lapsed: renewing it"
        return f"the lease of {self._what} is not claimed yet"

    # -- replies ---------------------------------------------------------------------------

    def on_reply(self, reply: Any, sent_at: float) -> bool:
        """Apply ``claim.lua``'s reply to a claim sent at monotonic ``sent_at``; True if held
        now. False with no other :attr:`holder`: ours, but the reply came back later than the
        lease (a stalled server): claim again at once.

        Raises:
            ValueError: Not a reply ``claim.lua`` gives (a server error).
        """
        if isinstance(reply, Exception):
            raise ValueError(f"claim.lua failed: {reply}")
        parsed = parse_claim_reply(reply)
        if parsed.status == "held":
            self._on_held(parsed.holder)
            self._notify()
            return False
        if parsed.status == "claimed" or self.token is None:
            # (a first "renewed": a claim retried after its reply was lost)
            self._on_claimed(parsed.token)
        elif not self.held(sent_at) and self._lapse_logged:
            logger.warning("%s: lease renewed after a lapse; serving again", self._what)
        self.token = parsed.token
        self.holder = None
        self._renewed = sent_at
        self._unheld_since = None
        self._contended_since = None
        self._lapse_logged = False
        self.renewals += 1
        self._notify()
        return self.held()

    def _on_claimed(self, token: str | None) -> None:
        self.counts["claims"] += 1
        before = self.holder
        if self.token is not None:
            logger.warning(
                "%s: this process's lease had expired (paused or cut off?); claimed it again "
                "as epoch %s: reports made under the old one are fenced",
                self._what,
                _epoch(token),
            )
        elif before is not None:
            logger.warning(
                "%s: took over (epoch %s) after the lease of %s expired",
                self._what,
                _epoch(token),
                before.describe(),
            )
        else:
            logger.info("%s: this process holds the lease (epoch %s)", self._what, _epoch(token))

    def _on_held(self, holder: Holder | None) -> None:
        if self.token is not None:
            self.counts["lost"] += 1
            logger.error(
                "%s: lost its lease to %s; this process (%s) stops serving it and waits",
                self._what,
                holder.describe() if holder else "?",
                self.identity.describe(),
            )
        new = holder is None or self.holder is None or holder.token != self.holder.token
        if new:
            # Logged before it is counted: whoever sees the count (stats, a test) finds the line.
            logger.error(
                "%s is already served by %s; this process (%s) does not serve it and takes "
                "over only once that lease expires. Two processes were started for one role: "
                "check the engine id and the rank",
                self._what,
                holder.describe() if holder else "?",
                self.identity.describe(),
            )
            self.counts["conflicts"] += 1
        now = self._clock()
        if self._unheld_since is None:
            self._unheld_since = now
        if self._contended_since is None:
            self._contended_since = now
        self.token = None
        self.holder = holder

    def note_lapse(self, now: float) -> None:
        """Log once that a held lease lapsed by this process's clock (it stops reading)."""
        if self.token is not None and not self.held(now) and not self._lapse_logged:
            self._lapse_logged = True
            logger.warning(
                "%s: no renewal succeeded for %.1fs (lease %d ms): not serving until one does",
                self._what,
                now - self._renewed,
                self._lease_ms,
            )


def _epoch(token: str | None) -> int | None:
    head = (token or "").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def run_claim(scripts: ScriptSet, client: redis.Redis, link: Link | None, call: Call) -> Any:
    """Run one ``claim.lua`` call over ``link`` (None: through ``client``); NOSCRIPT-safe."""
    if link is None:
        return scripts.call(client, call)
    with translate_redis_errors("running Lua scripts"):
        return scripts.run(link, client, [call])[0]
