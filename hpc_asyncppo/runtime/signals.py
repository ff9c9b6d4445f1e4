"""Stop requests: the warning signal before a Slurm time limit or preemption (USR2 by
default), SIGTERM, and the local launcher's forwarded Ctrl-C all set one flag. Every rank
installs the handler so that none dies of the signal. The trainer leader acts on it: it
stops waiting for samples (or ends the update in progress first), checkpoints, stops the
other ranks and exits cleanly. A rollout rank that sees it stops generating at once (the
hf engine between two tokens), keeping the tokens so far for the checkpoint. Processes a
rank starts (vLLM's engine) ignore the signals: their rank shuts them down.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_received: list[tuple[int, float]] = []  # (signal, wall time received)


def _note(signum: int, frame: object) -> None:
    _received.append((signum, time.time()))


def install_stop_handlers() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def stop_requested() -> str | None:
    """The name of the first stop signal received, or None."""
    return signal.Signals(_received[0][0]).name if _received else None


def stop_requested_at() -> float | None:
    """Wall time the first stop signal arrived, or None."""
    return _received[0][1] if _received else None


def forget_stop() -> None:
    """Clear the flag (a rollout rank whose leader never asked for the stop carries on)."""
    _received.clear()


@contextlib.contextmanager
def children_ignore_stop_signals() -> Iterator[None]:
    """Processes started inside inherit "ignore" for the stop signals (an ignored signal
    stays ignored across exec), so that a signal sent to every process of the job (Slurm
    does) reaches only the ranks; this process's own handlers are back afterwards."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
