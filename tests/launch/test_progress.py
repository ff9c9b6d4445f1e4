"""The live progress display: plain lines for logs, a bar on a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hpc_asyncppo.launch.progress import follow
from hpc_asyncppo.paths import METRICS


def row(step: int) -> dict:
    return {
        "step": step,
        "param_version": step // 4,
        "reward/mean": 0.25,
        "staleness/mean": 0.5,
        "staleness/max": 1,
        "throughput/samples_per_s": 100.0,
        "queue/groups": 3,
        "trainer/idle_ratio": 0.3,
        "rollouter/idle_ratio": 0.1,
    }


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def appending_run(path: Path, steps: range, before: int = 0):
    """is_running() that appends one more row per poll, then returns False."""
    with path.open("a") as f:
        for s in range(1, before + 1):
            f.write(json.dumps(row(s)) + "\n")
    pending = list(steps)

    def is_running() -> bool:
        if not pending:
            return False
        with path.open("a") as f:
            line = json.dumps(row(pending.pop(0))) + "\n"
            f.write(line)
        return True

    return is_running


def test_plain_lines_every_tenth_of_the_run(tmp_path: Path) -> None:
    out = io.StringIO()
    last = follow(tmp_path, appending_run(tmp_path / METRICS, range(1, 21)), 20, 0.0, stream=out)
    lines = out.getvalue().splitlines()
    assert last["step"] == 20
    assert [line.split()[1] for line in lines] == [f"{s}/20" for s in range(2, 21, 2)]
    assert "reward 0.250" in lines[-1] and "queue 3" in lines[-1]


def test_without_console_in_trainer_logger_nothing_is_shown(tmp_path: Path) -> None:
    out = io.StringIO()
    metrics = appending_run(tmp_path / METRICS, range(1, 21))
    last = follow(tmp_path, metrics, 20, 0.0, stream=out, console=False)
    assert last["step"] == 20 and out.getvalue() == ""


def test_a_resumed_run_starts_from_its_last_step(tmp_path: Path) -> None:
    out = io.StringIO()
    follow(
        tmp_path, appending_run(tmp_path / METRICS, range(9, 21), before=10), 20, 0.0, stream=out
    )
    lines = out.getvalue().splitlines()
    assert lines[0] == "resuming at step 10/20"
    assert lines[-1].startswith("step 20/20")


def test_a_bar_on_a_terminal(tmp_path: Path) -> None:
    out = Terminal()
    last = follow(tmp_path, appending_run(tmp_path / METRICS, range(1, 6)), 5, 0.0, stream=out)
    assert last["step"] == 5
    screen = out.getvalue()
    assert "5/5" in screen and "100%" in screen and "idle trainer 30%" in screen


def val_row(step: int) -> dict:
    return {
        "step": step,
        "val/param_version": step // 4,
        "val/reward/mean": 0.5,
        "val/pass@1": 0.25,
    }


def appending_rows(path: Path, rows: list[dict]):
    """is_running() that appends the next of ``rows`` per poll, then returns False."""
    pending = list(rows)

    def is_running() -> bool:
        if not pending:
            return False
        with path.open("a") as f:
            f.write(json.dumps(pending.pop(0)) + "\n")
        return True

    return is_running


def test_validation_rows_get_their_own_line_and_sit_beside_the_bar(tmp_path: Path) -> None:
    """A validation's row comes in late (after later steps'): a line of its own in the plain
    display, beside the bar on a terminal; the last row returned is a step's."""
    rows = [row(1), row(2), val_row(0), row(3), row(4), val_row(4), row(5)]
    out = io.StringIO()
    last = follow(tmp_path, appending_rows(tmp_path / METRICS, rows), 5, 0.0, stream=out)
    assert last["step"] == 5
    lines = out.getvalue().splitlines()
    assert "validation reward 0.500  pass@1 0.25  at step 0 (v0)" in lines
    assert "validation reward 0.500  pass@1 0.25  at step 4 (v1)" in lines
    (tmp_path / METRICS).unlink()
    terminal = Terminal()
    follow(tmp_path, appending_rows(tmp_path / METRICS, rows), 5, 0.0, stream=terminal)
    assert "val reward 0.500  pass@1 0.25" in terminal.getvalue()


def rewriting_run(run_dir: Path, resumed_at: int, steps: range):
    """is_running() of a resumed attempt: its first poll cuts the log back to the
    checkpoint's step as the leader does (a new file), the next ones append a row each."""
    from hpc_asyncppo.runlog import truncate_to_step

    pending = list(steps)
    cut = False

    def is_running() -> bool:
        nonlocal cut
        if not cut:
            truncate_to_step(run_dir, resumed_at)
            cut = True
            return True
        if not pending:
            return False
        with (run_dir / METRICS).open("a") as f:
            f.write(json.dumps(row(pending.pop(0))) + "\n")
        return True

    return is_running


def test_a_restarted_run_resumes_at_its_checkpoint_and_shows_the_steps_trained_again(
    tmp_path: Path,
) -> None:
    """The failed attempt logged steps 1-9, its newest checkpoint is of step 6: the restart
    resumes at 6 (not 9), and steps 7-9, trained again after the leader cut the log back
    (a new file), are followed like any other."""
    (tmp_path / METRICS).write_text("".join(json.dumps(row(s)) + "\n" for s in range(1, 10)))
    out = io.StringIO()
    last = follow(tmp_path, rewriting_run(tmp_path, 6, range(7, 11)), 10, 0.0, out, 6)
    lines = out.getvalue().splitlines()
    assert lines[0] == "resuming at step 6/10"
    assert [line.split()[1] for line in lines[1:]] == ["7/10", "8/10", "9/10", "10/10"]
    assert last["step"] == 10
