"""``broker-lookup query`` and the fleet query's HTTP endpoint (``POST /query``).

Both are faces of :class:`~broker_lookup.ops.fleet_query.FleetClient`. The endpoint is the
exporter's HTTP server with one POST route, for a router in any language. Its body is a
JSON object::

    {"tokens": [1, 2, ...]}             or "hashes": [...] (+ "offsets": [...]),
                                        or "text": "..." (only with --tokenizer)
    "engines": ["vllm-a@r1f2e3", ...]    explicit engine ids; or
    "configured": "vllm-a"              every live instance of a configured id;
                                        neither: every engine on the server
    "deadline_ms": 50                   optional (default --deadline-ms)
    "reserve_ms": 2000                  optional: keep the best engine's prefix pinned
                                        until its own lookup of the prompt (or this long)

and its answer ``FleetAnswer.to_json()``: 200 (Redis down too: every engine answers
``unavailable``, a router falls back), 400 for a body that is not a query. Its ``/metrics``
are its own (``ops.query_metrics``): the fleet's are the exporter's, and the endpoint's
``router`` ACL user may not read them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker_lookup.errors import ConfigError
from broker_lookup.ops.fleet_query import FleetAnswer, FleetClient

if TYPE_CHECKING:
    from broker_lookup.ops.query_metrics import QueryMetrics
from broker_lookup.processes import ExitCode

__all__ = ["QUERY_PORT", "query_route", "run", "setup"]

#: Default port of ``broker-lookup query --listen``.
QUERY_PORT = 9410
_JSON = "application/json"

#: Text to token ids (a tokenizer's ``encode``).
Tokenize = Callable[[str], list[int]]


def setup(p: argparse.ArgumentParser, url_help: str) -> None:
    """The ``query`` subcommand's flags."""
    p.description = (
        f"{p.description}. Each engine's ranks answer what they hold now (min over ranks), "
        "with the answer's age and, for 0, why (no_ranks, dead_rank, deadline, unavailable, "
        "miss). Token ids are hashed as LMCache does (chunk_size from the config)."
    )
    p.add_argument("--redis-url", help=url_help)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--tokens", help="the prompt's token ids, comma-separated")
    what.add_argument("--hashes", help="chunk hashes, comma-separated (chunk_size tokens each)")
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--engine", action="append", metavar="ID", help="an engine id to ask (repeatable)"
    )
    who.add_argument("--configured", metavar="ID", help="every live instance of this engine id")
    p.add_argument(
        "--deadline-ms", type=int, default=100, help="wait at most this long (default 100)"
    )
    p.add_argument(
        "--reserve-ms",
        type=int,
        default=0,
        help="keep the best engine's prefix pinned until its own lookup of the prompt "
        "arrives, or this long (default 0: no reservation)",
    )
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"serve POST /query (and its own /metrics) instead, e.g. 0.0.0.0:{QUERY_PORT}",
    )
    p.add_argument(
        "--tokenizer",
        metavar="NAME",
        help="with --listen: a Hugging Face tokenizer, so a query may send text",
    )


def query_route(
    fleet: FleetClient, tokenize: Tokenize | None = None, metrics: QueryMetrics | None = None
) -> Any:
    """The ``POST /query`` route: JSON body in, ``(status, body, content type)`` out;
    each answer counted in ``metrics``."""

    def route(body: bytes) -> tuple[int, bytes, str]:
        try:
            ask = _parse(body, tokenize)
        except ValueError as exc:
            if metrics is not None:
                metrics.requests.labels("bad_request").inc()
            return 400, json.dumps({"problem": str(exc)}).encode(), _JSON
        answer = fleet.query(**ask)
        if metrics is not None:
            metrics.record(answer, ask["reserve_ms"])
        code = 400 if answer.problem and answer.available else 200
        return code, json.dumps(answer.to_json()).encode(), _JSON

    return route


def _parse(body: bytes, tokenize: Tokenize | None) -> dict[str, Any]:
    try:
        doc = json.loads(body or b"null")
    except ValueError as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object")
    known = {
        "tokens",
        "hashes",
        "offsets",
        "text",
        "engines",
        "configured",
        "deadline_ms",
        "reserve_ms",
    }
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    ask: dict[str, Any] = {
        "token_ids": doc.get("tokens"),
        "hashes": doc.get("hashes"),
        "offsets": doc.get("offsets"),
        "engines": doc.get("engines"),
        "configured": doc.get("configured"),
        "deadline_ms": doc.get("deadline_ms"),
        "reserve_ms": doc.get("reserve_ms", 0),
    }
    if "text" in doc:
        if tokenize is None:
            raise ValueError("'text' needs a tokenizer: start the endpoint with --tokenizer")
        if not isinstance(doc["text"], str) or ask["token_ids"] is not None:
            raise ValueError("'text' must be a string, without 'tokens'")
        ask["token_ids"] = tokenize(doc["text"])
    for name in ("engines", "token_ids", "hashes", "offsets"):
        if ask[name] is not None and not isinstance(ask[name], list):
            raise ValueError(f"'{name.removesuffix('_ids')}' must be a list")
    if ask["deadline_ms"] is not None and not isinstance(ask["deadline_ms"], int):
        raise ValueError("'deadline_ms' must be an integer")
    if not isinstance(ask["reserve_ms"], int) or ask["reserve_ms"] < 0:
        raise ValueError("'reserve_ms' must be an integer >= 0")
    return ask


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: not comma-separated integers") from None


def _tokenizer(name: str) -> Tokenize:
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise ConfigError(f"--tokenizer={name!r}: needs the transformers package") from None
    tok = AutoTokenizer.from_pretrained(name)
    return lambda text: list(tok.encode(text))


def render(answer: FleetAnswer) -> str:
    """The human-readable answer."""
    if answer.problem and answer.available:
        return f"no query: {answer.problem}"
    lines = [f"prompt: {answer.tokens} tokens in whole chunks; {answer.elapsed_ms:.1f} ms"]
    if answer.problem:
        lines.append(answer.problem)
    lines.append(
        f"  {'engine':<40}{'tokens':>8}{'reserved':>10}  {'ranks':<8}{'age ms':>8}  reason"
    )
    for e in answer.engines:
        ranks = f"{len(e.answered)}/{len(e.expected)}"
        age = "-" if e.age_ms is None else f"{e.age_ms:.1f}"
        lines.append(
            f"  {e.engine_id:<40}{e.tokens:>8}{e.reserved:>10}  {ranks:<8}{age:>8}  "
            f"{e.reason or ''}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``broker-lookup query``."""
    from broker_lookup.config import LookupConfig

    try:
        flags = {"redis_url": args.redis_url} if args.redis_url else None
        config = LookupConfig.load(environ=os.environ, flags=flags)
        if args.listen:
            return _listen(config, args)
        if args.tokens is None and args.hashes is None:
            raise ConfigError("give --tokens or --hashes (or --listen)")
        tokens = _ints(args.tokens, "--tokens") if args.tokens is not None else None
        hashes = _ints(args.hashes, "--hashes") if args.hashes is not None else None
    except ConfigError as exc:
        print(f"broker-lookup query: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    fleet = FleetClient(config)
    try:
        answer = fleet.query(
            tokens,
            hashes=hashes,
            engines=args.engine,
            configured=args.configured,
            deadline_ms=args.deadline_ms,
            reserve_ms=args.reserve_ms,
        )
    finally:
        fleet.close()
    print(json.dumps(answer.to_json()) if args.json else render(answer))
    if answer.problem:
        return ExitCode.USAGE if answer.available else ExitCode.UNREACHABLE
    return ExitCode.OK


def _renamed(line: str, command: str) -> str:
    """The exporter's "serving" line, said by ``broker-lookup <command>`` of its route."""
    return line.replace("exporter", command).replace("/metrics", "/" + command)


def _listen(config: Any, args: argparse.Namespace) -> int:
    import signal
    import threading

    from broker_lookup.ops.exporter import serve
    from broker_lookup.ops.query_metrics import QueryMetrics
    from broker_lookup.threads import set_from_signal
    from broker_lookup.transport.connection import make_factory

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen={args.listen!r}: not HOST:PORT")
    tokenize = _tokenizer(args.tokenizer) if args.tokenizer else None
    fleet = FleetClient(config, deadline_ms=args.deadline_ms)
    metrics = QueryMetrics(make_factory(config, "bl-query-ready"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop))
    try:
        return serve(
            metrics,
            host,
            int(port),
            stop,
            announce=lambda line: print(_renamed(line, "query"), flush=True),
            routes={"/query": query_route(fleet, tokenize, metrics)},
        )
    except OSError as exc:
        print(f"broker-lookup query: cannot serve --listen {args.listen}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    finally:
        fleet.close()
