"""A reward function that fails on one rank, to test that one dying rank ends the whole job.

Used as ``data.reward_fn=tests.launch.faulty_reward:fail_on_rank1`` (importable from the
repository root, the job's working directory).
"""

from __future__ import annotations

import os

_calls = 0


def fail_on_rank1(prompt: object, response_text: str) -> float:
    """0.0, except that world rank 1 raises after a few calls (once the job is under way)."""
    global _calls
    if os.environ.get("SLURM_PROCID") == "1":  # srun's world rank of this task
        _calls += 1
        if _calls > 50:
            raise RuntimeError("injected failure on rank 1")
    return 0.0
