"""Where a rank's start-up goes: one line in its log per phase, with the wall-clock time it
ended, from the rank's Python process starting to its first weight sync.

    ... rank0 hpc_asyncppo.runtime.startup INFO: start-up: topology built at 1718000000.123456 (cpu 3.210 s)

The local launcher writes the same lines for itself into logs/mpirun.log;
``scripts/bench_startup.py`` reads them all to say where the seconds before the first
weight sync go.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import re
import time

log = logging.getLogger(__name__)
PHASE = re.compile(r"start-up: (.+) at (\d+\.\d+)(?: \(cpu (\d+\.\d+) s\))?$")


def line(phase: str, at: float | None = None) -> str:
    """The line saying that ``phase`` ended now, with the CPU time this process has used so
    far (on a shared machine a steadier measure than the wall clock); or that it ended at
    ``at``, a past ``time.time()``."""
    if at is not None:
        return f"start-up: {phase} at {at:.6f}"
    return f"start-up: {phase} at {time.time():.6f} (cpu {time.process_time():.3f} s)"


def mark(phase: str, at: float | None = None) -> None:
    """Log that ``phase`` ended now (or at ``at``)."""
    log.info(line(phase, at))


def process_started_at() -> float:
    """When this process started, by the clock of ``time.time()`` (to ~10 ms: the kernel
    counts a process's start in clock ticks since boot); now where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            # fields after the command name, which may hold spaces: starttime is the 20th
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def pause_collection() -> None:
    """Stop collecting cyclic garbage for the imports of a rank's start-up: they allocate
    most of a million objects and free few, and the collections among them cost about a
    fifth of their time."""
    gc.disable()


def resume_collection() -> None:
    """Collect again once the imports are done, leaving every object alive now (modules,
    classes, functions: alive as long as the process) out of all later collections, so
    that they never traverse them; the cyclic garbage of the imports stays too (~10 MB).
    The model is built after this: its garbage is collected as ever."""
    gc.freeze()
    gc.enable()
    # at exit everything is collected as usual (nanobind reports frozen objects as leaks)
    atexit.register(gc.unfreeze)
