"""The default synthetic task: answer with the digit after the prompt's last digit.

Prompt: 2-5 random digits and "=", e.g. "3 9 4 =". Correct response: the next digit (last + 1,
mod 10) written REPEATS times: "5 5 5 5". Reward: the fraction of the first REPEATS
response words that are that digit, so it lies in [0, 1] and gives partial credit.

Why this task: a randomly initialised tiny model scores about 1/15 (one token in its
15-word vocabulary), the answer depends on the prompt (no constant output wins), and the
dense per-position reward lets GRPO lift it above 0.8 within ~100 steps on two CPU cores.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hpc_asyncppo.config import DataConfig
from hpc_asyncppo.tasks import Prompt

REPEATS = 4
DIGITS = [str(d) for d in range(10)]


class NextDigitTask:
    def __init__(self, data: DataConfig, seed: int = 1234):
        rng = random.Random(seed)
        self._prompts = []
        for index in range(data.num_prompts):
            digits = [rng.choice(DIGITS) for _ in range(rng.randint(2, 5))]
            answer = str((int(digits[-1]) + 1) % 10)
            # "=" ends the prompt: without it "3 9 4" + response "5" would read exactly like
            # the prompt "3 9 4 5", and no policy could tell which answer is wanted.
            self._prompts.append(
                Prompt(index=index, text=" ".join(digits) + " =", ground_truth=answer)
            )

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def vocabulary(self) -> list[str]:
        return DIGITS + ["="]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        words = response_text.split()[:REPEATS]
        return sum(word == prompt.ground_truth for word in words) / REPEATS
