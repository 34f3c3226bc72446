"""The tiny model of the vLLM tests: :mod:`broker_lookup.tools.tiny_model`, runnable from
here as ``python tests/vllm/tiny_model.py OUT_DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

from broker_lookup.tools.tiny_model import MARKER, WORDS, build, prompt_text

__all__ = ["MARKER", "WORDS", "build", "prompt_text"]

if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
