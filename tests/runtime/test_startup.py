"""The start-up lines the launcher and the ranks write, read back by bench_startup.py."""

from __future__ import annotations

import subprocess
import sys
import time

from hpc_asyncppo.runtime.startup import PHASE, line, process_started_at

# /proc counts a process's start in clock ticks (10 ms) and the uptime in hundredths
TICKS_S = 0.05


def test_a_line_names_its_phase_and_time() -> None:
    found = PHASE.search(f"2026-12-01 10:00:00,000 rank0 x INFO: {line('topology built', 12.5)}")
    assert found is not None
    assert found.groups() == ("topology built", "12.500000", None)


def test_a_line_of_now_has_the_cpu_time_so_far() -> None:
    before, cpu_before = time.time(), time.process_time()
    found = PHASE.search(line("checkpoint found"))
    after = time.time()
    assert found is not None and found.group(1) == "checkpoint found"
    assert before - 1e-6 <= float(found.group(2)) <= after + 1e-6
    assert cpu_before - 0.01 <= float(found.group(3)) <= time.process_time() + 0.01


def test_a_process_start_is_the_time_it_was_started() -> None:
    """A child reports its own start: after the moment this test started it, before it
    exited (to the kernel's clock ticks)."""
    code = "from hpc_asyncppo.runtime.startup import process_started_at as s; print(repr(s()))"
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    after = time.time()
    assert before - TICKS_S <= float(out.stdout) <= after
    assert process_started_at() <= before  # this process started before it
