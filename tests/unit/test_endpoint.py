"""The one HTTP endpoint a rank and the exporter both serve: its three paths, what a failing
check answers, draining, and that no other HTTP server is left in the product."""

from __future__ import annotations

import http.client
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_lookup.ops.endpoint import Endpoint, Pinger

PRODUCT = Path(__file__).resolve().parents[2]


def _get(port: int, path: str) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("Content-Type") or ""
    finally:
        conn.close()


class _State:
    def __init__(self) -> None:
        self.dead: str | None = None
        self.unready: str | None = None


@pytest.fixture
def served() -> Iterator[tuple[Endpoint, _State]]:
    state = _State()
    endpoint = Endpoint(
        "127.0.0.1",
        0,
        lambda: (200, b"m 1\n", "text/plain; version=0.0.4"),
        alive=lambda: state.dead,
        ready=lambda: state.unready,
    ).start()
    try:
        yield endpoint, state
    finally:
        assert endpoint.stop(), "the HTTP thread ends within the stop's timeout"


def test_each_path_answers_from_its_own_callable(served: tuple[Endpoint, _State]) -> None:
    endpoint, _ = served
    assert _get(endpoint.port, "/metrics") == (200, b"m 1\n", "text/plain; version=0.0.4")
    assert _get(endpoint.port, "/healthz")[:2] == (200, b"ok\n")
    assert _get(endpoint.port, "/readyz?verbose")[:2] == (200, b"ready\n")
    status, body, _ = _get(endpoint.port, "/nope")
    assert status == 404 and b"/metrics" in body


def test_a_failing_check_answers_503_with_its_reason(served: tuple[Endpoint, _State]) -> None:
    endpoint, state = served
    state.unready = "Redis PING failed: gone"
    assert _get(endpoint.port, "/readyz")[:2] == (503, b"not ready: Redis PING failed: gone\n")
    assert _get(endpoint.port, "/healthz")[0] == 200, "liveness does not follow readiness"
    state.dead = "the loop is not running"
    assert _get(endpoint.port, "/healthz")[:2] == (503, b"not alive: the loop is not running\n")


def test_draining_fails_readiness_first(served: tuple[Endpoint, _State]) -> None:
    endpoint, _ = served
    endpoint.draining.set()
    assert _get(endpoint.port, "/readyz")[:2] == (503, b"not ready: shutting down\n")
    assert _get(endpoint.port, "/metrics")[0] == 200, "still scraped while it drains"


def test_stop_before_start_returns_at_once_and_frees_the_port() -> None:
    endpoint = Endpoint("127.0.0.1", 0, lambda: (200, b"", "text/plain"))
    stopped: list[bool] = []
    stopper = threading.Thread(target=lambda: stopped.append(endpoint.stop()), daemon=True)
    stopper.start()
    stopper.join(5)
    assert stopped == [True], "stop() of a server never started must not wait for serve_forever"


def test_a_pinger_reports_why_redis_did_not_answer() -> None:
    def refused() -> object:
        raise ConnectionRefusedError("connection refused")

    pinger = Pinger(refused)  # type: ignore[arg-type]
    reason = pinger.ping(5.0)
    assert reason is not None and "connection refused" in reason
    pinger.join(1.0)


def test_no_other_http_server_in_the_product() -> None:
    """A second ``BaseHTTPRequestHandler`` would be a second endpoint to keep in step."""
    defining = sorted(
        str(path.relative_to(PRODUCT))
        for package in ("broker_lookup", "workers")
        for path in (PRODUCT / package).rglob("*.py")
        if "BaseHTTPRequestHandler" in path.read_text()
    )
    assert defining == ["broker_lookup/ops/endpoint.py"]


def test_post_routes_answer_and_a_failing_one_is_a_500() -> None:
    def echo(body: bytes) -> tuple[int, bytes, str]:
        return 200, body.upper(), "text/plain"

    def broken(body: bytes) -> tuple[int, bytes, str]:
        raise RuntimeError("a bug")

    endpoint = Endpoint(
        "127.0.0.1", 0, lambda: (200, b"", "text/plain"), routes={"/e": echo, "/b": broken}
    ).start()
    try:

        def post(path: str) -> tuple[int, bytes]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{endpoint.port}{path}", data=b"hi", method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    return reply.status, reply.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        assert post("/e") == (200, b"HI")
        assert post("/b")[0] == 500
        assert post("/nowhere")[0] == 404
        assert post("/e") == (200, b"HI")  # it still serves
    finally:
        assert endpoint.stop()
