"""What the client does with a request before it reaches Redis: admit, trim or answer 0.

The scheduler's contract path never raises on request data: vLLM
takes request ids from a client's ``X-Request-Id`` header and calls ``lookup()``
inside ``Scheduler.schedule()``, where an exception kills the engine. So a request
is either admitted (its chunk hashes and offsets), trimmed (a prompt with more than
``max_chunks_per_request`` chunks is looked up by its first that many: a prefix hit
is still a right answer), or rejected: answered 0, counted by kind in the client's
:class:`~broker_lookup.client.guard.Guard`, and logged the first time a kind occurs
and then at most once per ``LOG_EVERY_S`` of that kind.

:meth:`Admission.check` is the strict variant for callers that want an error naming
the limit and the value; nothing on the scheduler's path calls it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from broker_lookup.client.guard import LOG_EVERY_S, Guard
from broker_lookup.config import LookupConfig
from broker_lookup.errors import InvalidRequest
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.messages import (
    check_lookup_id,
    request_configs_problem,
    wire_id_problem,
)
from broker_lookup.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    import torch

__all__ = ["Admission", "Rejected"]

logger = logging.getLogger(__name__)


class Rejected(msgspec.Struct, frozen=True):
    """Why a request is answered 0 without asking the ranks."""

    kind: str  #: counter name, e.g. ``bad_id``, ``configs_too_large``, ``bad_tokens``
    detail: str  #: the limit and the value, for the log line


class Admission:
    """Turns a scheduler's request into hashes and offsets, or a :class:`Rejected`."""

    def __init__(self, config: LookupConfig, hasher: ChunkedTokenHasher, guard: Guard) -> None:
        self._config = config
        self._hasher = hasher
        #: Counts and logs the requests answered 0 (its ``counts`` feed ``stats()``).
        self.guard = guard
        #: Prompts looked up by their first ``max_chunks_per_request`` chunks only.
        self.truncated = 0
        self._truncated_log = RateLimitedLog(logger, LOG_EVERY_S)

    def admit(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: object,
        request_configs: object,
    ) -> tuple[list[int], list[int]] | Rejected:
        """Hashes and offsets to send (possibly trimmed), or why the answer is 0."""
        problem = self._problem(lookup_id, request_configs)
        if problem is None:
            try:
                hashes, offsets = self._hasher.hashes_and_offsets(token_ids)
            except Exception as exc:  # InvalidRequest, or whatever odd input raised
                problem = Rejected("bad_tokens", str(exc)[:200])
        if problem is not None:
            self.guard.rejected(problem.kind, lookup_id, problem.detail)
            return problem
        limit = self._config.max_chunks_per_request
        if len(hashes) > limit:
            self.truncated += 1
            self._truncated_log(
                logging.WARNING,
                "%d prompt(s) over max_chunks_per_request=%d looked up by their first "
                "%d chunks only (latest %.200r: %d chunks)",
                self.truncated,
                limit,
                limit,
                lookup_id,
                len(hashes),
            )
            del hashes[limit:], offsets[limit:]
        return hashes, offsets

    def check(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
    ) -> None:
        """Raise InvalidRequest for anything ``admit`` would reject or trim, or for an id
        that is not printable ASCII without spaces."""
        cfg = self._config
        reason = check_lookup_id(lookup_id, cfg.max_lookup_id_length)
        problem = self._problem(lookup_id, request_configs)
        if reason is None and problem is not None:
            reason = problem.detail
        if reason is not None:
            raise InvalidRequest(reason)
        hashes, _ = self._hasher.hashes_and_offsets(token_ids)
        if len(hashes) > cfg.max_chunks_per_request:
            raise InvalidRequest(
                f"{len(hashes)} chunks exceed max_chunks_per_request={cfg.max_chunks_per_request}"
            )

    def _problem(self, lookup_id: object, request_configs: object) -> Rejected | None:
        cfg = self._config
        reason = wire_id_problem(lookup_id, cfg.max_lookup_id_length)
        if reason is not None:
            return Rejected("bad_id", reason)
        configs = request_configs_problem(request_configs, cfg.max_request_configs_bytes)
        return None if configs is None else Rejected(configs.kind, configs.reason)
