"""The rollout rank's loop as far as the gateway's sessions go, for the gateway's tests
(``Loop``), and the tiny model made a machine whose turns are known (``bigram``)."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import torch

from hpc_asyncppo.rollout.gateway.sessions import Sessions
from hpc_asyncppo.rollout.hf_engine import HFEngine
from hpc_asyncppo.tasks import Prompt
from tests.harness import HANG_S


def bigram(model_dir: Path, next_word: dict[str, str], default: str = "<eos>") -> None:
    """Make the tiny Llama a machine whose next token depends only on the current one:
    the layers' outputs zeroed (the residual stream is the token's embedding, one-hot),
    the LM head mapping each word to ``next_word``'s (``default`` otherwise), logits 40
    apart: sampling at temperature 1 picks it with probability 1 - 1e-16."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    vocab = tokenizer.get_vocab()
    hidden = model.config.hidden_size
    assert len(vocab) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        for word, i in vocab.items():
            model.model.embed_tokens.weight[i, i] = 1.0
            target = vocab[next_word.get(word, default)]
            model.lm_head.weight[target, i] = 40.0 / hidden**0.5
    model.save_pretrained(model_dir)


class Loop(threading.Thread):
    """The rollout rank's loop, as far as sessions go (``Rollouter.step_and_send``): groups
    opened, ``Sessions.step`` (the engine stepped between the sessions' calls), the groups
    whose sessions ended scored."""

    def __init__(self, engine: HFEngine, sessions: Sessions):
        super().__init__(daemon=True)
        self.engine, self.sessions = engine, sessions
        self.opening: queue.Queue = queue.Queue()
        self.done: dict = {}
        self.halt = False

    def open(self, key, n: int, prompt: Prompt, recorded=None) -> list[str]:
        self.opening.put((key, n, prompt, recorded))
        deadline = time.monotonic() + HANG_S
        while not self.sessions.live(key) and key not in self.done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return [f"s1-e0-p{prompt.index}-r{j}" for j in range(n)]

    def run(self) -> None:
        while not self.halt:
            while not self.opening.empty():
                key, n, prompt, recorded = self.opening.get()
                if callable(key):  # ``cut``: done here, between two steps
                    key(n)
                    continue
                self.sessions.open_group(key, f"s1-e0-p{prompt.index}", prompt, n, recorded)
            for key, gen in self.sessions.step(self.engine, self.engine.step):
                self.done[key] = (gen, *self.sessions.finish(key))

    def cut(self, key):
        """The group as a checkpoint cuts it (its tokens so far), and gone from this rank
        as after a stop."""
        done: queue.Queue = queue.Queue()

        def cut_here(_):
            if key in self.engine.groups:
                done.put(
                    self.engine.groups.pop(key).partial(self.sessions.width, self.engine.pad_id)
                )
            else:  # the engine finished it: its sessions' rewards are awaited
                done.put(dict(self.sessions.unsubmitted(self.sessions.width, self.engine.pad_id,
                                                        self.engine))[key])  # fmt: skip
            self.sessions.forget(key, "the run stopped")

        self.opening.put((cut_here, None, None, None))
        return done.get(timeout=HANG_S)

    def result(self, key):
        deadline = time.monotonic() + HANG_S
        while key not in self.done:
            assert time.monotonic() < deadline, "the group never finished"
            time.sleep(0.01)
        return self.done[key]
