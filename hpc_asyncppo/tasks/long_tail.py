"""A synthetic task whose response lengths have a long tail: most answers are short, a
quarter are twelve times longer, and the reward needs the long ones right.

Prompt: 2-5 random digits, then "=" or, for a long answer, "long =": "3 9 4 =" or
"3 9 4 long =". Correct response: the next digit (last + 1, mod 10) written ``SHORT`` (4)
or ``LONG`` (48) times, then the end of the response: "5 5 5 5". Reward: the correct
words among the first ``need`` ones, divided by ``max(need, words written)``: a response
that stops early or runs on loses in proportion, so the model must learn where to stop.

Why: on ``next_digit`` every response is about as long as every other, and a
synchronous step has no tail to wait for. Here a batch of 64 responses holds about 16
long ones (49 tokens with the end, against 5): a synchronous trainer waits for the
longest response of its batch, and a padded trainer computes every row at the longest
row's length. Both are what a fully asynchronous pipeline and sequence packing win back.
A mean reward of ``LEARNED_REWARD`` (0.8) cannot be reached on the short prompts alone
(at most 0.75 with every long answer wrong).

Needs ``rollout.response_length`` of at least ``LONG + 1`` (the config check says so).
The prompts are generated (``data.num_prompts``) or read from ``data.train`` as
``next_digit``'s are (the ground truth is the digit; the length comes from the prompt).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from hpc_asyncppo.config import DataConfig
from hpc_asyncppo.tasks.base import Prompt
from hpc_asyncppo.tasks.next_digit import DIGITS, draw_digits, read_or_generate

SHORT, LONG = 4, 48  # repeats of the answer digit
LONG_SHARE = 0.25  # of the prompts ask for the long answer
MARKER = "long"


def need(prompt: Prompt) -> int:
    """How many times the prompt's answer must be written."""
    return LONG if MARKER in prompt.text.split() else SHORT


def generate_prompts(count: int, seed: int = 1234) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        digits, answer = draw_digits(rng)
        words = digits + ([MARKER] if rng.random() < LONG_SHARE else []) + ["="]
        prompts.append(Prompt(index=index, text=" ".join(words), ground_truth=answer))
    return prompts


def held_out_prompts(count: int, num_train: int | None = None) -> list[Prompt]:
    """``count`` prompts not among the default training prompts, half of them long (data
    source "short" or "long", so validation reports each): the same set every time."""
    if num_train is None:
        num_train = DataConfig().num_prompts
    train = {p.text for p in generate_prompts(num_train)}
    fresh = [p for p in generate_prompts(8 * count, seed=99) if p.text not in train]
    by_kind = {
        kind: [p for p in fresh if (need(p) == LONG) == (kind == "long")]
        for kind in ("short", "long")
    }
    held = by_kind["short"][: count - count // 2] + by_kind["long"][: count // 2]
    if len(held) < count:
        raise ValueError(f"only {len(held)} held-out prompts, {count} asked for")
    return [
        dataclasses.replace(p, index=i, data_source="long" if need(p) == LONG else "short")
        for i, p in enumerate(held)
    ]


class LongTailTask:
    min_response_length = LONG + 1  # the long answer and the end of the response

    def __init__(self, data: DataConfig, seed: int = 1234):
        self._prompts = read_or_generate(data, generate_prompts, seed)

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def vocabulary(self) -> list[str]:
        return DIGITS + ["=", MARKER]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        words = response_text.split()
        wanted = need(prompt)
        right = sum(word == prompt.ground_truth for word in words[:wanted])
        return right / max(wanted, len(words))
