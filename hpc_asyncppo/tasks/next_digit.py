"""The default synthetic task: answer with the digit after the prompt's last digit.

Prompt: 2-5 random digits and "=", e.g. "3 9 4 =". Correct response: the next digit (last + 1,
mod 10) written REPEATS times: "5 5 5 5". Reward: the fraction of the first REPEATS
response words that are that digit, so it lies in [0, 1] and gives partial credit.

Why this task: a randomly initialised tiny model scores about 1/15 (one token in its
15-word vocabulary), the answer depends on the prompt (no constant output wins), and the
dense per-position reward lets GRPO lift it above ``LEARNED_REWARD`` on two CPU cores.

The prompts are generated (``data.num_prompts`` of them), or read from ``data.train`` when it
is set: a JSONL file of {"prompt", "ground_truth"} rows (``tasks/jsonl.py``), which is also
how a held-out ``data.val`` set is given (``write_prompts`` writes one).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks.base import Prompt
from hpc_asyncppo.tasks.jsonl import read_jsonl_prompts

REPEATS = 4
DIGITS = [str(d) for d in range(10)]

# Whether the default job (this task, the default config, its 300 steps) learns, as the
# tests, gpu_check and scripts/bench_time_to_reward.py judge it:
UNTRAINED_REWARD_MAX = 0.2  # the first 10 steps' mean reward stays below (random: about 1/15)
# The benchmarks' target for the rolling sampled reward (most runs pass it in about 220
# steps), what a GPU run must reach, and what the default job's greedy validation on
# held-out prompts must reach at its end: the learning tests' bar. With the defaults, 5
# seeds of 5 ended at greedy validation 0.977-1.0 (BENCHMARKS.md, "Defaults over five
# seeds, second round"). Greedy validation over 128 prompts, not the last steps' sampled
# reward: one unlucky group moves the latter by a few hundredths.
LEARNED_REWARD = 0.8


def draw_digits(rng: random.Random) -> tuple[list[str], str]:
    """2-5 random digits and the answer: the digit after the last one (mod 10)."""
    digits = [rng.choice(DIGITS) for _ in range(rng.randint(2, 5))]
    return digits, str((int(digits[-1]) + 1) % 10)


def generate_prompts(count: int, seed: int = 1234) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        digits, answer = draw_digits(rng)
        # "=" ends the prompt: without it "3 9 4" + response "5" would read exactly like
        # the prompt "3 9 4 5", and no policy could tell which answer is wanted.
        prompts.append(Prompt(index=index, text=" ".join(digits) + " =", ground_truth=answer))
    return prompts


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    """A JSONL dataset of ``prompts`` (with their data_source when set), for data.train/val."""
    rows = [
        {"prompt": p.text, "ground_truth": p.ground_truth}
        | ({"data_source": p.data_source} if p.data_source else {})
        for p in prompts
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def held_out_prompts(count: int, num_train: int | None = None) -> list[Prompt]:
    """``count`` prompts of the task that are not among its default training prompts (the
    first ``num_train``, default ``data.num_prompts``), for a held-out ``data.val``: data
    source "short" (2-3 digits) or "long" (4-5 digits). The same set every time: the
    learning tests and ``scripts/bench_time_to_reward.py`` judge on it."""
    if num_train is None:
        num_train = DataConfig().num_prompts
    train = {p.text for p in generate_prompts(num_train)}
    held = [p for p in generate_prompts(4 * count, seed=99) if p.text not in train][:count]
    if len(held) < count:
        raise ValueError(f"only {len(held)} held-out prompts, {count} asked for")
    return [
        dataclasses.replace(p, index=i, data_source="short" if len(p.text.split()) <= 4 else "long")
        for i, p in enumerate(held)
    ]


def read_or_generate(
    data: DataConfig, generate: Callable[[int, int], list[Prompt]], seed: int
) -> list[Prompt]:
    """``data.train``'s prompts (JSONL) when it is set, else ``generate(data.num_prompts,
    seed)``: how this task and its variants (``long_tail.py``) get theirs."""
    if not data.train:
        return generate(data.num_prompts, seed)
    if not Path(data.train).is_file():
        raise ConfigError(f"data.train={data.train!r}: no such file")
    return read_jsonl_prompts(Path(data.train))


class NextDigitTask:
    def __init__(self, data: DataConfig, seed: int = 1234):
        self._prompts = read_or_generate(data, generate_prompts, seed)

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def vocabulary(self) -> list[str]:
        return DIGITS + ["="]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        words = response_text.split()[:REPEATS]
        return sum(word == prompt.ground_truth for word in words) / REPEATS
