"""Reward functions that misbehave on one rank, to test that the whole job still ends.

Used as ``data.reward_fn=tests.launch.faulty_reward:fail_on_rank1`` (importable from the
repository root, the job's working directory).
"""

from __future__ import annotations

import logging
import os
import threading

_calls = 0


def fail_on_rank1(prompt: object, response_text: str) -> float:
    """0.0, except that world rank 1 raises after a few calls (once the job is under way)."""
    global _calls
    if os.environ.get("SLURM_PROCID") == "1":  # srun's world rank of this task
        _calls += 1
        if _calls > 50:
            raise RuntimeError("injected failure on rank 1")
    return 0.0


def linger_on_rank1(prompt: object, response_text: str) -> float:
    """0.0; on world rank 1 it also adds a logging handler whose close never returns, so
    that rank finishes its work (state "done") but its process never exits: a rank flushes
    and closes its logs last, then leaves without the interpreter's teardown (a lingering
    thread would not hold it). The job must end anyway."""
    global _calls
    if os.environ.get("SLURM_PROCID") == "1" and _calls == 0:
        _calls += 1
        logging.getLogger().addHandler(_Lingering())
    return 0.0


class _Lingering(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        threading.Event().wait()  # never set
