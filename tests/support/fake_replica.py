"""A stand-in for a vLLM replica's OpenAI server, for the router's tests (no vLLM).

``POST /v1/completions`` (and ``/v1/chat/completions``) runs the replica's own lookup of the
prompt's token ids through the scheduler's client, as vLLM's scheduler does through
LMCache, and answers its hit count as vLLM reports it:
``usage.prompt_tokens_details.cached_tokens``. ``POST /tokenize`` maps text to token ids
through a fixed table.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from broker_lookup import RedisAsyncLookupClient

__all__ = ["FakeReplica"]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        owner = self.server.owner
        if self.path == "/tokenize":
            text = doc.get("prompt") or json.dumps(doc.get("messages"))
            body: dict[str, Any] = {"tokens": owner.vocabulary[text]}
        else:
            prompt = doc.get("prompt")
            tokens = prompt if isinstance(prompt, list) else owner.vocabulary[str(prompt)]
            body = {
                "id": f"cmpl-{owner.name}",
                "replica": owner.name,
                "usage": {"prompt_tokens_details": {"cached_tokens": owner.lookup(tokens)}},
            }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FakeReplica


class FakeReplica:
    """One replica: its name, its engine's scheduler client and a tokenizer table."""

    def __init__(
        self, name: str, client: RedisAsyncLookupClient, vocabulary: dict[str, list[int]]
    ) -> None:
        self.name, self.client, self.vocabulary = name, client, vocabulary
        self._ids = itertools.count()
        self._http = _Server(("127.0.0.1", 0), _Handler)
        self._http.owner = self
        # A short poll: shutdown() waits for serve_forever's next poll (0.5 s by default).
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def lookup(self, tokens: list[int]) -> int:
        """The engine's own lookup of ``tokens``, answered (then released, as vLLM does
        once it has loaded)."""
        lookup_id = f"{self.name}-{next(self._ids)}"
        self.client.lookup(tokens, lookup_id)
        deadline = time.monotonic() + 10
        while (hits := self.client.lookup_cache(lookup_id)) is None:
            assert time.monotonic() < deadline, "the replica's lookup never answered"
            time.sleep(0.002)
        self.client.cancel_lookup(lookup_id)
        self.client.clear_lookup_status(lookup_id)
        return hits

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(5)
