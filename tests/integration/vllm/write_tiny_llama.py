"""Write a tiny random-weight Llama with a BPE tokenizer trained on text files (no download).

Run with the vLLM venv's python (it has torch, transformers and tokenizers):

    python write_tiny_llama.py OUT_DIR CORPUS_FILE...

The weights are random (fixed seed): the model's answers are gibberish, but they are
deterministic at temperature 0, and its tokenizer is a real subword BPE, so re-tokenizing
generated text can give other ids than the ones generated (what the proxy must avoid).
Writes into a temporary sibling of OUT_DIR and renames it, so a half-written model is never
used; when two writers race, the first rename wins and the other's copy is dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

VOCAB_SIZE = 2048  # small, but large enough for multi-byte merges
SEED = 0
# Weights drawn with std 0.1, not Llama's 0.02: at 0.02 greedy decoding of this 2-layer model
# repeats one token (7 distinct ids in 150 on one prompt), at 0.1 it varies (125 of 150),
# so a continuation that goes wrong shows.
INIT_STD = 0.1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(out: Path, corpus: list[Path]) -> int:
    """Train a byte-level BPE on the corpus and save it as a HF fast tokenizer; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in corpus], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def write_model(out: Path, vocab_size: int) -> None:
    """Save a 2-layer Llama with random weights drawn from a fixed seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=vocab_size, max_position_embeddings=2048,
        initializer_range=INIT_STD, bos_token_id=0, eos_token_id=1, pad_token_id=1, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    """Write the model directory named by argv[0] from the corpus files after it."""
    out, corpus = Path(argv[0]), [Path(p) for p in argv[1:]]
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab_size = write_tokenizer(tmp, corpus)
    write_model(tmp, vocab_size)
    (tmp / "ftctl-tiny-llama.json").write_text(json.dumps({"vocab_size": vocab_size}))
    try:
        tmp.rename(out)
    except OSError:  # another writer finished first: its model is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
