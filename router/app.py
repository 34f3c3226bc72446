"""A reference router: OpenAI-compatible HTTP in front of N vLLM replicas on one Redis.

Each request goes to the replica whose engine holds the longest prefix of its prompt, as
the fleet query answers it, with that prefix reserved until the replica's own lookup of
the prompt arrives (``reserve_ms``); where no replica holds any, to the least loaded one
(fewest requests this router has in flight there; ties in turn). It serves ``POST
/v1/completions`` and ``POST /v1/chat/completions`` on the exporter's HTTP server (beside
``/metrics``, ``/healthz``, ``/readyz``) and forwards the body unchanged; the answer comes
back whole (a streamed answer is buffered: this is a reference, not a production proxy).

The prompt's token ids: a completion's ``prompt`` given as token ids is used as is; text
goes through ``tokenize`` (a Hugging Face tokenizer, ``--tokenizer``) or, without one,
through the first replica's vLLM ``/tokenize`` endpoint. Chat messages need one of them
to apply the chat template: with ``--tokenizer``, its ``apply_chat_template``; otherwise
vLLM's ``/tokenize`` with ``messages``.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker_lookup import FleetClient
from broker_lookup.protocol.keys import configured_of

__all__ = ["Replica", "Router"]

logger = logging.getLogger(__name__)

_JSON = "application/json"
#: Token ids of a request body (None: it has no prompt the router can read).
Tokenize = Callable[[dict[str, Any]], list[int] | None]


@dataclass(frozen=True)
class Replica:
    """One vLLM replica: its base URL and the engine id it was configured with (its
    ranks' namespaces are ``<engine_id>@<instance>``)."""

    url: str
    engine_id: str


class Router:
    """Chooses a replica per request and forwards it (see the module docstring).

    Args:
        replicas: the replicas, each with its own configured engine id.
        fleet: the fleet query's client (the replicas' Redis and ``chunk_size``).
        tokenize: a body's token ids; None: the first replica's ``/tokenize``.
        deadline_ms: the fleet query's deadline per request.
        reserve_ms: how long the chosen replica keeps the prefix for the request.
        timeout_s: the forwarded request's timeout.
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        fleet: FleetClient,
        tokenize: Tokenize | None = None,
        deadline_ms: int = 50,
        reserve_ms: int = 5000,
        timeout_s: float = 600.0,
    ) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self._by_id = {r.engine_id: r for r in self.replicas}
        self._fleet = fleet
        self._tokenize = tokenize or self._tokenize_remotely
        self._deadline_ms, self._reserve_ms, self._timeout_s = deadline_ms, reserve_ms, timeout_s
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()
        self._turn = itertools.count()
        #: Requests routed, by (replica engine id, why: prefix, least_loaded).
        self.routed: Counter[tuple[str, str]] = Counter()
        #: Per request routed by prefix: the replica and the tokens found and reserved.
        self.last_receipt: dict[str, Any] | None = None

    def routes(self) -> dict[str, Callable[[bytes], tuple[int, bytes, str]]]:
        """The POST routes to serve (``ExporterServer(..., routes=router.routes())``)."""
        return {
            "/v1/completions": lambda body: self.handle("/v1/completions", body),
            "/v1/chat/completions": lambda body: self.handle("/v1/chat/completions", body),
        }

    def choose(self, tokens: list[int] | None) -> tuple[Replica, str, dict[str, Any]]:
        """The replica for a prompt, why (``prefix`` or ``least_loaded``), and the receipt."""
        receipt: dict[str, Any] = {"found": 0, "reserved": 0}
        if tokens:
            answer = self._fleet.query(
                tokens,
                configured=list(self._by_id),
                deadline_ms=self._deadline_ms,
                reserve_ms=self._reserve_ms,
            )
            best = answer.best()
            replica = None if best is None else self._by_id.get(configured_of(best.engine_id))
            if best is not None and replica is not None:
                receipt = {"found": best.tokens, "reserved": best.reserved, "age_ms": best.age_ms}
                return replica, "prefix", receipt
        return self._least_loaded(), "least_loaded", receipt

    def handle(self, path: str, body: bytes) -> tuple[int, bytes, str]:
        """Route one request and forward it; (status, body, content type) of the answer."""
        try:
            doc = json.loads(body)
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(doc, dict):
            return _error(400, "the body must be a JSON object")
        try:
            tokens = self._tokenize(doc)
        except (OSError, ValueError) as exc:  # a replica's /tokenize failed: route anyway
            logger.warning("router: cannot tokenize the prompt (%s); least loaded", exc)
            tokens = None
        replica, why, receipt = self.choose(tokens)
        with self._lock:
            self._inflight[replica.engine_id] += 1
            self.routed[(replica.engine_id, why)] += 1
            self.last_receipt = {"replica": replica.engine_id, "why": why, **receipt}
        logger.info("router: %s -> %s (%s, %s)", path, replica.url, why, receipt)
        try:
            return self._forward(replica, path, body)
        finally:
            with self._lock:
                self._inflight[replica.engine_id] -= 1

    def _least_loaded(self) -> Replica:
        with self._lock:
            turn = next(self._turn)
            n = len(self.replicas)
            order = [self.replicas[(turn + i) % n] for i in range(n)]
            return min(order, key=lambda r: self._inflight[r.engine_id])

    def _forward(self, replica: Replica, path: str, body: bytes) -> tuple[int, bytes, str]:
        request = urllib.request.Request(
            replica.url.rstrip("/") + path, data=body, headers={"Content-Type": _JSON}
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as reply:
                return reply.status, reply.read(), reply.headers.get("Content-Type", _JSON)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers.get("Content-Type", _JSON)
        except OSError as exc:
            return _error(502, f"replica {replica.url} did not answer: {exc}")

    def _tokenize_remotely(self, doc: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: given, or from the first replica's vLLM ``/tokenize``."""
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        ask: dict[str, Any] = {"model": doc.get("model")}
        if isinstance(prompt, str):
            ask["prompt"] = prompt
        elif isinstance(doc.get("messages"), list):
            ask["messages"] = doc["messages"]
        else:
            return None
        request = urllib.request.Request(
            self.replicas[0].url.rstrip("/") + "/tokenize",
            data=json.dumps(ask).encode(),
            headers={"Content-Type": _JSON},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            tokens = json.loads(reply.read()).get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("/tokenize answered no token list")
        return [int(t) for t in tokens]


def _error(code: int, message: str) -> tuple[int, bytes, str]:
    return code, json.dumps({"error": {"message": message, "code": code}}).encode(), _JSON
