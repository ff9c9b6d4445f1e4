"""Bounded waits on MPI requests.

Blocking MPI calls spin a core at 100% in Open MPI; on an oversubscribed node that starves
the ranks doing real work. Every wait here polls with short sleeps and has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mpi4py import MPI


class PeerTimeout(TimeoutError):
    """A peer rank did not answer within its deadline."""


def poll_until(ready: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Call ``ready()`` until true; return the seconds waited. PeerTimeout after ``timeout_s``."""
    start = time.monotonic()
    delay = 1e-4
    while not ready():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise PeerTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)
    return time.monotonic() - start


def wait_request(request: MPI.Request, timeout_s: float, what: str) -> float:
    return poll_until(request.Test, timeout_s, what)
