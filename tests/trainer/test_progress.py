"""The trainer leader's counters (trainer/progress.py) on an injected clock: the waiting and
elapsed seconds behind ``trainer/idle_ratio`` and a checkpoint's record of them, exactly,
across a resume."""

from __future__ import annotations

from hpc_asyncppo.trainer.progress import Progress


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_waits_and_elapsed_time_count_from_the_start_of_the_attempt() -> None:
    clock = Clock()
    progress = Progress(clock=clock)
    clock.now = 103.0
    since = clock()
    clock.now = 104.5
    progress.add_wait(since)
    clock.now = 110.0
    assert progress.elapsed_s() == 10.0 and progress.idle_s == 1.5


def test_a_checkpoint_records_the_counters_as_taken_and_a_resume_carries_them_on() -> None:
    clock = Clock()
    progress = Progress(clock=clock)
    progress.step, progress.version, progress.synced_step, progress.samples_trained = 7, 3, 6, 224
    progress.add_wait(clock())  # no time passed: nothing waited
    clock.now = 102.0
    progress.add_wait(100.5)
    clock.now = 108.0
    meta = progress.state_dict()
    clock.now = 150.0  # the parts take their time to write; the record stays as taken
    assert (meta["elapsed_s"], meta["idle_s"]) == (8.0, 1.5)
    assert meta["step"] == 7 and meta["param_version"] == 3 and meta["synced_step"] == 6

    later = Clock(5000.0)  # another attempt, another process's clock
    resumed = Progress(clock=later)
    resumed.load_state_dict(meta)
    assert resumed.elapsed_s() == 8.0 and resumed.idle_s == 1.5
    assert resumed.unsynced  # trained past version 3's broadcast: sent as a new version
    later.now = 5002.0
    resumed.add_wait(5001.0)
    later.now = 5004.0
    assert resumed.elapsed_s() == 12.0 and resumed.idle_s == 2.5
    assert resumed.state_dict()["samples_trained"] == 224
