"""The tiny default model: a few-layer Llama and a word-level tokenizer, saved in HF format.

It is written to disk (config.json, model.safetensors, tokenizer files) and then loaded
by ``AutoModelForCausalLM.from_pretrained(path)`` like any real model, so the default
run exercises the same loading path as Qwen or Llama checkpoints.

Building one imports torch and transformers, seconds before any rank starts; so a run
directory gets a copy of a cached build (``tiny_model``): the same bytes a build would
write, since the build is deterministic in its inputs, which name the cache entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_asyncppo.config import TinyModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CACHE_VARIABLE = "HPC_ASYNCPPO_CACHE"  # where built tiny models are kept
# Whatever else decides the bytes of a build: the code below and the libraries it calls.
_BUILD_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


def build_tokenizer(words: list[str], chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``words`` plus pad/bos/eos/unk; with the
    task's ``chat_template`` (a Jinja template over those words) when it has one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    words: list[str],
    size: TinyModelConfig,
    seed: int,
    chat_template: str | None = None,
) -> Path:
    """Write a randomly initialised tiny Llama and its tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(words, chat_template)
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


def build_tiny_qwen2(
    out_dir: str | Path, words: list[str], tied: bool, seed: int, dtype: str = "float32",
    **shape: int,
) -> Path:  # fmt: skip
    """Write a randomly initialised small Qwen2 (the Qwen2.5 recipes' architecture: q/k/v
    biases, grouped KV heads; ``tied``: the LM head is the embedding) and the word-level
    tokenizer over ``words`` to ``out_dir``. ``shape``: ``Qwen2Config`` sizes over the
    defaults (2 layers of 64, 2 heads of 32 and 1 KV head: vLLM's CPU kernels take heads
    of 32; the vocabulary the tokenizer's)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(words)
    sizes = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    config = Qwen2Config(
        **{**sizes, **shape},
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_model(
    out_dir: str | Path,
    words: list[str],
    size: TinyModelConfig,
    seed: int,
    cache: str | Path | None = None,
    chat_template: str | None = None,
) -> Path:
    """``build_tiny_model(out_dir, ...)``, copied from ``cache`` (default: ``cache_dir()``)
    when it holds a build of the same inputs, else built there first. A cache that cannot
    be written costs only the time: the model is then built in ``out_dir``."""
    out_dir = Path(out_dir)
    key = tiny_model_key(words, size, seed, chat_template)
    entry = Path(cache or cache_dir()) / "tiny-models" / key
    if not entry.is_dir():
        try:
            _build_entry(entry, words, size, seed, chat_template)
        except OSError as exc:
            log.warning("cannot cache the tiny model in %s (%s): building it in place", entry, exc)
            return build_tiny_model(out_dir, words, size, seed, chat_template)
    shutil.copytree(entry, out_dir, dirs_exist_ok=True)  # the run directory keeps its own copy
    return out_dir


def cache_dir() -> Path:
    """$HPC_ASYNCPPO_CACHE, else $XDG_CACHE_HOME/hpc_asyncppo, else ~/.cache/hpc_asyncppo."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc_asyncppo"


def tiny_model_key(
    words: list[str], size: TinyModelConfig, seed: int, chat_template: str | None = None
) -> str:
    """Names a build by everything its bytes depend on: the inputs, this file's code and the
    versions of the libraries it calls (read from their metadata, without importing them)."""
    inputs = {
        "words": words,
        "size": dataclasses.asdict(size),
        "seed": seed,
        **({"chat_template": chat_template} if chat_template else {}),
        "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "versions": {name: metadata.version(name) for name in _BUILD_PACKAGES},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _build_entry(
    entry: Path, words: list[str], size: TinyModelConfig, seed: int, chat_template: str | None
) -> None:
    """Build into a temporary folder beside ``entry``, then rename it: an entry is always
    whole, and of two processes building the same one, the second keeps the first's."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build_tiny_model(tmp, words, size, seed, chat_template)
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class TinyTokenizer:
    """The tiny model's tokenizer for measuring prompts, without importing transformers
    (seconds): its tokenizer.json in the ``tokenizers`` library that the model's
    ``PreTrainedTokenizerFast`` runs on, so the ids are the same. It has no chat template."""

    chat_template = None

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}
