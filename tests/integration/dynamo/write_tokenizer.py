"""Write the tiny Llama's tokenizer and config.json, no weights, for Dynamo's mocker.

Run with the Dynamo venv's python (transformers and tokenizers, no torch):

    python write_tokenizer.py OUT_DIR CORPUS_FILE...

The tokenizer is the one tests/integration/vllm/write_tiny_llama.py trains (same corpus,
same vocabulary); the mocker reads the tokenizer and config.json and loads no weights.
Written into a temporary sibling of OUT_DIR and renamed, as write_tiny_llama.py does.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))

from write_tiny_llama import INIT_STD, write_tokenizer


def main(argv: list[str]) -> int:
    from transformers import LlamaConfig

    out, corpus = Path(argv[0]), [Path(p) for p in argv[1:]]
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab_size = write_tokenizer(tmp, corpus)
    LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=vocab_size, max_position_embeddings=2048,
        initializer_range=INIT_STD, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        architectures=["LlamaForCausalLM"]).save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another writer finished first: its directory is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
