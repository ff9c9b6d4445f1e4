"""Stop requests: the warning signal before a Slurm time limit or preemption (USR2 by
default), SIGTERM, and the local launcher's forwarded Ctrl-C all set one flag. Every rank
installs the handler so that none dies of the signal; only the trainer leader acts on the
flag, at the next step boundary: it checkpoints, stops the other ranks and exits cleanly.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_received: list[int] = []


def _note(signum: int, frame: object) -> None:
    _received.append(signum)


def install_stop_handlers() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def stop_requested() -> str | None:
    """The name of the first stop signal received, or None."""
    return signal.Signals(_received[0]).name if _received else None
