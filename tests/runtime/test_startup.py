"""The start-up lines the launcher and the ranks write, read back by bench_startup.py."""

from __future__ import annotations

import time

from hpc_asyncppo.runtime.startup import PHASE, line, process_started_at


def test_a_line_names_its_phase_and_time() -> None:
    found = PHASE.search(f"2026-12-01 10:00:00,000 rank0 x INFO: {line('topology built', 12.5)}")
    assert found is not None
    assert found.groups() == ("topology built", "12.500000", None)


def test_a_line_of_now_has_the_cpu_time_so_far() -> None:
    before = time.process_time()
    found = PHASE.search(line("checkpoint found"))
    assert found is not None and found.group(1) == "checkpoint found"
    assert abs(float(found.group(2)) - time.time()) < 60
    assert before - 0.01 <= float(found.group(3)) <= time.process_time() + 0.01


def test_this_process_started_before_now_and_not_long_ago() -> None:
    # pytest has been running for a while, but not for hours
    assert time.time() - 3600 < process_started_at() <= time.time()
