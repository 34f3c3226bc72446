"""vLLM's OpenAI HTTP server on the broker, and a request id no Redis key should hold.

vLLM takes the request id from the client's ``X-Request-Id`` header and the scheduler
hands it to our client as the lookup id; spaces and non-ASCII characters must be
served (the client keys such ids by digest), nothing may crash, and the engine goes on
serving. The server is the session's ``served`` fixture (conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from scenario import prompt_ids
from vllm_harness import healthy, post

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

HOSTILE_ID = "bl test ü 日本 ✓ {x}:*?\t end".encode()  # raw UTF-8 bytes on the wire


def _client_stats(served: dict[str, Any]) -> dict[str, Any]:
    clients = [c for p in served["probe"](want=2) for c in p["clients"]]
    assert clients, "no broker client in vLLM's EngineCore"
    return dict(clients[0])


def test_hostile_request_id_is_served_and_the_engine_goes_on(served: dict[str, Any]) -> None:
    port, vocab = served["port"], served["vocab"]
    body = {"model": "tiny", "prompt": prompt_ids(7, vocab), "max_tokens": 4, "temperature": 0}
    first = post(port, body, HOSTILE_ID)
    assert first[0] == 200, first
    again = post(port, body, HOSTILE_ID)  # the same id again: a repeat, served from LMCache
    assert again[0] == 200, again
    assert again[1]["choices"][0]["text"] == first[1]["choices"][0]["text"]
    other = post(port, {**body, "prompt": prompt_ids(8, vocab)}, b"plain-id-1")
    assert other[0] == 200, other
    # no header at all (a fresh prompt: LMCache 0.5.6 frees a chunk on its second load)
    assert post(port, {**body, "prompt": prompt_ids(9, vocab)})[0] == 200
    stats = _client_stats(served)
    assert stats["outcomes"]["hit"] >= 1 and stats["hit_tokens"] >= 256, stats
    assert stats["unexpected_errors"] == 0 and stats["rejected"] == {}, stats
    assert served["proc"].poll() is None and healthy(port)
    log = Path(served["log"]).read_bytes().decode(errors="replace")
    assert "Traceback" not in log, log[-4000:]
