"""A tiny random-weight Llama and a byte-level BPE tokenizer, built locally (no hub).

2 layers, hidden 256, 4 heads, 2 KV heads, bf16: about 1.4 M parameters, loads in vLLM
in seconds. Used by the vLLM tests (session fixture) and ``broker-lookup demo --vllm``.
Build one with ``python -m broker_lookup.tools.tiny_model OUT_DIR`` (or
``python tests/vllm/tiny_model.py OUT_DIR``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = (
    "the cache broker lookup token chunk prefix worker scheduler engine stream "
    "redis valkey request answer memory block layer tensor prompt model hit miss "
    "load store retrieve pin release abort timeout circuit breaker heartbeat rank"
).split()
VOCAB_SIZE = 512
MARKER = "tiny-llama.json"


def _corpus(lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))) for _ in range(lines)]


def _build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def build(out: Path, seed: int = 0) -> Path:
    """Write the model and tokenizer into ``out`` (skipped when already built there)."""
    out = Path(out)
    if (out / MARKER).exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = _build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / MARKER).write_text(json.dumps({"vocab": vocab, "seed": seed}))
    return out


def prompt_text(n_words: int = 300, seed: int = 1) -> str:
    """A deterministic prompt of the corpus' words (about 1.2 tokens a word)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
