"""GSM8K's reward: the number after the response's final "####" against the ground truth.

The same rule as verl's ``gsm8k.compute_score`` in its strict mode: the answer counts only in
the "#### 42" form the prompt asks for; commas and a leading "$" are ignored.
"""

from __future__ import annotations

import re

from hpc_asyncppo.tasks.base import Prompt

_FINAL = re.compile(r"#### *(-?[$0-9.,]+)")


def extract_answer(response_text: str) -> str | None:
    """The number after the last "####", normalised ("1,234" -> "1234"), or None."""
    found = _FINAL.findall(response_text)
    if not found:
        return None
    answer = found[-1].replace(",", "").replace("$", "").rstrip(".")
    return answer or None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def gsm8k_reward(prompt: Prompt, response_text: str) -> float:
    """1.0 for the right final answer, 0.0 otherwise (no format score)."""
    answer = extract_answer(response_text)
    truth = prompt.ground_truth.replace(",", "").strip()
    return float(answer is not None and _same_number(answer, truth))
