"""The timeline recorder and reader, without MPI: spans, merging, flushing, idle ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_asyncppo import timeline as tl


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_spans_are_written_with_a_session_marker_and_fields(tmp_path: Path) -> None:
    t = tl.Timeline(tmp_path, 3, "trainer")
    t.record("wait", 10.0, 11.0, step=1)
    t.record("train", 11.0, 12.5, step=1)
    t.close()
    rows = lines(tl.timeline_path(tmp_path, 3))
    assert rows[0]["span"] == "session" and rows[0]["role"] == "trainer"
    assert rows[1:] == [
        {"span": "wait", "start": 10.0, "end": 11.0, "step": 1},
        {"span": "train", "start": 11.0, "end": 12.5, "step": 1},
    ]


def test_back_to_back_waits_merge_into_one_span(tmp_path: Path) -> None:
    t = tl.Timeline(tmp_path, 0, "rollout")
    for i in range(100):  # a wait loop: 2 ms sleeps, polls in between
        t.record("wait", 100.0 + i * 0.0021, 100.0 + i * 0.0021 + 0.002)
    t.record("generate", 101.0, 102.0)
    t.record("wait", 102.0, 102.5)
    t.record("wait", 104.0, 104.5)  # a gap of 1.5 s: a separate wait
    t.close()
    rows = lines(tl.timeline_path(tmp_path, 0))[1:]
    assert [r["span"] for r in rows] == ["wait", "generate", "wait", "wait"]
    assert rows[0]["start"] == 100.0 and rows[0]["end"] == pytest.approx(
        100.0 + 99 * 0.0021 + 0.002
    )


def test_flush_writes_all_but_a_span_that_may_still_grow(tmp_path: Path) -> None:
    t = tl.Timeline(tmp_path, 0, "rollout")
    t.record("generate", 1.0, 2.0)
    t.record("wait", 2.0, 3.0)
    t.flush()
    path = tl.timeline_path(tmp_path, 0)
    assert [r["span"] for r in lines(path)] == ["session", "generate"]
    t.record("wait", 3.0, 4.0)  # still merges into the kept span
    t.close()
    assert lines(path)[-1] == {"span": "wait", "start": 2.0, "end": 4.0}


def test_flushes_about_every_second_on_its_own(tmp_path: Path, monkeypatch) -> None:
    t = tl.Timeline(tmp_path, 0, "trainer")
    t.record("train", 1.0, 2.0, step=1)
    path = tl.timeline_path(tmp_path, 0)
    assert len(lines(path)) == 1  # buffered
    monkeypatch.setattr(tl, "FLUSH_EVERY_S", 0.0)
    t.record("train", 2.0, 3.0, step=2)
    assert len(lines(path)) == 3
    t.close()


def test_a_span_that_raises_is_recorded_and_flushed(tmp_path: Path) -> None:
    t = tl.Timeline(tmp_path, 1, "trainer")
    with pytest.raises(RuntimeError), t.span("train", step=7):
        raise RuntimeError("boom")
    # not closed: the rank is dying, but its last span is on disk
    row = lines(tl.timeline_path(tmp_path, 1))[-1]
    assert row["span"] == "train" and row["step"] == 7 and row["error"] is True


def test_reader_splits_sessions_and_skips_a_torn_line(tmp_path: Path) -> None:
    for _ in range(2):  # a run and its resume append to one file
        t = tl.Timeline(tmp_path, 0, "rollout")
        t.record("sync", 5.0, 6.0, version=0)
        t.close()
    with tl.timeline_path(tmp_path, 0).open("a") as f:
        f.write('{"span":"generate","start":7.0,"en')  # killed mid-write
    sessions = tl.read_timeline(tmp_path)[0]
    assert len(sessions) == 2
    assert [s["span"] for s in sessions[1].spans] == ["sync"]


def test_idle_ratio_counts_waits_from_the_first_sync() -> None:
    session = tl.Session(rank=1, role="trainer", pid=1, started=0.0)
    session.spans = [
        {"span": "wait", "start": 0.0, "end": 5.0},  # before the first sync: not counted
        {"span": "sync", "start": 5.0, "end": 6.0, "version": 0},
        {"span": "wait", "start": 6.0, "end": 7.0, "step": 1},
        {"span": "train", "start": 7.0, "end": 9.0, "step": 1},
        {"span": "wait", "start": 9.0, "end": 12.0, "step": 2},
        {"span": "train", "start": 12.0, "end": 16.0, "step": 2},
    ]
    assert tl.idle_ratio(session) == pytest.approx(4.0 / 10.0)
    assert tl.idle_ratio(session, at=10.0) == pytest.approx(2.0 / 4.0)  # a wait cut at `at`
    assert tl.idle_ratio(session, at=5.5) is None  # before the sync ended


def session(started: float, spans: list[tuple]) -> tl.Session:
    s = tl.Session(rank=1, role="trainer", pid=1, started=started)
    s.spans = [
        {"span": k, "start": a, "end": b, **({"step": x} if x else {})} for k, a, b, x in spans
    ]
    return s


def test_a_resumed_leader_carries_on_from_its_checkpoint() -> None:
    first = session(
        0.0,
        [
            ("sync", 0.0, 1.0, None),
            ("wait", 1.0, 2.0, 1),
            ("train", 2.0, 3.0, 1),
            ("checkpoint", 3.0, 3.5, 1),  # at 3.0: waited 1 of 2 s
            ("wait", 3.5, 5.5, 2),
            ("train", 5.5, 6.0, 2),  # killed here: step 2 is trained again
        ],
    )
    resumed = session(
        100.0,
        [("sync", 100.0, 101.0, None), ("wait", 101.0, 104.0, 2), ("train", 104.0, 105.0, 2)],
    )
    assert tl.trainer_idle_ratio([first]) == pytest.approx(3.0 / 5.0)
    assert tl.trainer_idle_ratio([first, resumed]) == pytest.approx((1 + 3) / (2 + 4))
    started_over = session(
        200.0, [("sync", 200.0, 201.0, None), ("wait", 201.0, 202.0, 1), ("train", 202.0, 205.0, 1)]
    )
    assert tl.trainer_idle_ratio([first, resumed, started_over]) == pytest.approx(1 / 4)
    just_started = session(300.0, [("sync", 300.0, 301.0, None)])
    # nothing logged since the last start: the logged ratio is still the earlier session's
    assert tl.trainer_idle_ratio([first, just_started]) == pytest.approx(3.0 / 5.0)
    assert tl.trainer_idle_ratio([first, resumed], at=4.0) == pytest.approx(1.5 / 3.0)
