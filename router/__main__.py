"""``python -m router``: the reference router (see ``router.app``).

    python -m router --redis-url redis://redis:6379/0 --listen 0.0.0.0:8000 \\
        --replica http://vllm-a:8000=llama-a --replica http://vllm-b:8000=llama-b

Each ``--replica URL=ENGINE_ID`` names a replica and the engine id it was started with
(``kv_connector_extra_config``'s, or ``BROKER_LOOKUP_ENGINE_ID``); ``chunk_size`` and the
hashing fields come from ``BROKER_LOOKUP_*`` as for the engines.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from broker_lookup import ConfigError, FleetClient, LookupConfig
from broker_lookup.ops.exporter import FleetCollector, serve
from broker_lookup.threads import set_from_signal
from broker_lookup.transport.connection import make_factory
from router.app import Replica, Router, Tokenize


def _replica(text: str) -> Replica:
    url, sep, engine_id = text.rpartition("=")
    if not sep or not url.startswith(("http://", "https://")) or not engine_id:
        raise argparse.ArgumentTypeError(f"{text!r} is not URL=ENGINE_ID")
    return Replica(url, engine_id)


def _hf_tokenizer(name: str) -> Tokenize:
    from transformers import AutoTokenizer  # type: ignore[import-not-found,unused-ignore]

    tok = AutoTokenizer.from_pretrained(name)

    def tokenize(doc: dict[str, Any]) -> list[int] | None:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, str):
            return list(tok.encode(prompt))
        if isinstance(doc.get("messages"), list):
            return list(tok.apply_chat_template(doc["messages"], add_generation_prompt=True))
        return None

    return tokenize


def _said(line: str) -> str:
    """The exporter's "serving" line, said by the router of its routes."""
    return line.replace("broker-lookup exporter", "python -m router").replace("/metrics", "/v1")


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    p.add_argument("--redis-url")
    p.add_argument("--replica", type=_replica, action="append", required=True)
    p.add_argument("--listen", default="0.0.0.0:8000", metavar="HOST:PORT")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer (default: vLLM's /tokenize)")
    p.add_argument("--deadline-ms", type=int, default=50)
    p.add_argument("--reserve-ms", type=int, default=5000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    host, _, port = args.listen.rpartition(":")
    try:
        flags = {"redis_url": args.redis_url} if args.redis_url else None
        config = LookupConfig.load(environ=os.environ, flags=flags)
    except ConfigError as exc:
        print(f"python -m router: {exc}", file=sys.stderr)
        return 2
    tokenize = _hf_tokenizer(args.tokenizer) if args.tokenizer else None
    fleet = FleetClient(config)
    router = Router(args.replica, fleet, tokenize, args.deadline_ms, args.reserve_ms)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop))
    try:
        return serve(
            FleetCollector(make_factory(config, "bl-router-metrics")),
            host,
            int(port),
            stop,
            announce=lambda line: print(_said(line), flush=True),
            routes=router.routes(),
        )
    except KeyboardInterrupt:
        return 130
    finally:
        fleet.close()


if __name__ == "__main__":
    sys.exit(main())
