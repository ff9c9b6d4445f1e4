"""The sizes of the model ``model.path`` names, from its ``config.json`` (an HF decoder of
the Llama/Qwen2 family): what the config's validation checks against (a tied LM head,
sliding-window layers) and what ``memory.py``'s estimates count."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpc_asyncppo.config.schema import lora_targets


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory, from an HF decoder's config.json (Llama/Qwen2 family)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    tied: bool

    @classmethod
    def of(cls, model_path: str) -> ModelShape | None:
        """None where ``model_path`` has no readable config.json (nothing to check then)."""
        path = Path(model_path) / "config.json"
        try:
            return cls.from_config(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    @classmethod
    def from_config(cls, c: dict) -> ModelShape:
        """From the fields of an HF config.json."""
        heads = c["num_attention_heads"]
        return cls(
            vocab=c["vocab_size"],
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            intermediate=c["intermediate_size"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    @property
    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        biases = self.hidden + 2 * self.kv_heads * head_dim  # Qwen2's q/k/v biases
        return attention + biases + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Embeddings, the LM head when untied, and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def lora_params(self, rank: int, targets: str) -> int:
        """Adapter parameters of LoRA ``rank`` on ``targets`` (``actor.target_modules``: names
        separated by commas, ``all-linear`` for every layer matrix): rank x (in + out) each."""
        kv = self.kv_heads * (self.hidden // self.heads)
        h, i = self.hidden, self.intermediate
        matrices = {"q_proj": h + h, "k_proj": h + kv, "v_proj": h + kv, "o_proj": h + h,
                    "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}  # fmt: skip
        names = set(lora_targets(targets))
        if "all-linear" in names:
            names |= set(matrices)
        per_layer = sum(rank * sides for name, sides in matrices.items() if name in names)
        head = rank * (h + self.vocab) if "lm_head" in names else 0
        return self.layers * per_layer + head

    @property
    def largest_tensor(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


def attention_kinds(model_path: str) -> set[str]:
    """The kinds of attention layer ``model_path``'s config.json declares ("full_attention",
    "sliding_attention", ...: transformers' ``layer_types``, or ``use_sliding_window``);
    empty where it has no readable config.json."""
    try:
        c = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return set()
    if c.get("layer_types"):
        return set(c["layer_types"])
    return {"sliding_attention" if c.get("use_sliding_window") else "full_attention"}
