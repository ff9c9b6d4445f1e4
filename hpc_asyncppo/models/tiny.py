"""The tiny default model: a few-layer Llama and a word-level tokenizer, saved in HF format.

It is written to disk (config.json, model.safetensors, tokenizer files) and then loaded
by ``AutoModelForCausalLM.from_pretrained(path)`` like any real model, so the default
run exercises the same loading path as Qwen or Llama checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hpc_asyncppo.config import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``words`` plus pad/bos/eos/unk."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_tiny_model(
    out_dir: str | Path, words: list[str], size: TinyModelConfig, seed: int
) -> Path:
    """Write a randomly initialised tiny Llama and its tokenizer to ``out_dir``."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(words)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
