"""A run's report: ``python -m hpc_asyncppo.report RUN_DIR`` writes RUN_DIR/report.png.

Panels: reward over steps (with the validation reward, when the run validates) and over
wall time; throughput; the staleness histogram of
the samples trained on (and dropped); queue depth; who waited (idle ratios); and a Gantt
chart of every rank's timeline, for the whole run and zoomed on a few steps in its
middle, showing where generation and training overlap and where each side waited. A
short text summary goes to stdout. Works on a live, finished, failed, killed or resumed
run: it reads only complete lines, and for a resumed run the last row of each step.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpc_asyncppo import timeline as tl
from hpc_asyncppo.paths import DROPPED, REPORT, TRAINED
from hpc_asyncppo.runlog import format_validation, read_jsonl
from hpc_asyncppo.status import Checkpoint, RankError, RunStatus, collect, goodput_lines

SPAN_COLORS = {
    "generate": "#2ca02c",
    "train": "#1f77b4",
    "wait": "#e45756",
    "send": "#17becf",
    "sync": "#9467bd",
    "checkpoint": "#222222",
}


@dataclass
class Summary:
    """The numbers the report shows; each from metrics.jsonl, the sample logs or the timeline."""

    state: str
    steps: int  # last step logged
    total_steps: int | None
    param_version: int | None
    samples_trained: int
    samples_dropped: int
    reward_first: float | None  # mean reward/mean over the first ``reward_window`` steps
    reward_last: float | None  # ... and over the last ones
    reward_window: int
    throughput: float | None  # samples/s since the first weight sync (logged, last step)
    staleness_mean: float | None  # over every sample trained on
    staleness_max: int | None
    idle_step: int | None  # the last step the timeline covers (a killed run loses <1 s of it)
    trainer_idle_logged: float | None  # that step's trainer/idle_ratio
    rollout_idle_logged: float | None  # that step's rollouter/idle_ratio
    trainer_idle_timeline: float | None  # the same, recomputed from the timeline
    rollout_idle_timeline: float | None
    attempts: int
    wall_s: float | None  # first rank ready (timeline opened) to the last recorded span
    checkpoint: Checkpoint | None
    errors: list[RankError] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)  # every validation row, step order
    collapse: list[str] = field(default_factory=list)  # the collapse signs named, step order


@dataclass
class RunData:
    """Everything read from the run directory, once."""

    status: RunStatus
    timeline: dict[int, list[tl.Session]]
    trained: list[dict]
    dropped: list[dict]

    @property
    def rows(self) -> list[dict]:
        return self.status.rows

    def restarts(self) -> list[float]:
        """When the ranks were started again (resumes): the leader's later sessions."""
        if self.leader is None:
            return []
        return [s.started for s in self.timeline[self.leader][1:]]

    @property
    def leader(self) -> int | None:
        trainers = [r for r, sessions in self.timeline.items() if _role(sessions) == "trainer"]
        return min(trainers) if trainers else None

    def rollout_ranks(self) -> list[int]:
        return [r for r, sessions in self.timeline.items() if _role(sessions) == "rollout"]

    def t0(self) -> float | None:
        """The run's time origin: the first rank's first start."""
        starts = [s[0].started for s in self.timeline.values() if s]
        if starts:
            return min(starts)
        stamped = [r["time/unix"] - r["time/elapsed_s"] for r in self.rows if "time/unix" in r]
        return min(stamped) if stamped else None


def _role(sessions: list[tl.Session]) -> str:
    return sessions[-1].role if sessions else "?"


def latest_attempt(rows: list[dict]) -> list[dict]:
    """Sample-log rows, keeping for each step only those its last attempt wrote (resume)."""
    attempt, prev, tagged = 0, None, []
    for row in rows:
        if prev is not None and row["step"] < prev:
            attempt += 1
        prev = row["step"]
        tagged.append((attempt, row))
    last = {}
    for attempt, row in tagged:
        last[row["step"]] = attempt
    return [row for attempt, row in tagged if last[row["step"]] == attempt]


def load(run_dir: Path) -> RunData:
    return RunData(
        status=collect(run_dir),
        timeline=tl.read_timeline(run_dir),
        trained=latest_attempt(read_jsonl(run_dir / TRAINED)),
        dropped=latest_attempt(read_jsonl(run_dir / DROPPED)),
    )


def covered_row(data: RunData) -> dict | None:
    """The last metrics row logged before every rank's timeline ends (a killed or live
    rank's last second of spans may not be on disk)."""
    if not data.timeline or any(not sessions for sessions in data.timeline.values()):
        return None
    rows = [r for r in data.rows if "time/unix" in r]
    if not rows:
        return None
    at = rows[-1]["time/unix"]
    covered_until = min(session_at(s, at).end for s in data.timeline.values())
    covered = [r for r in rows if r["time/unix"] <= covered_until]
    return covered[-1] if covered else None


def timeline_idle(data: RunData, row: dict) -> tuple[float | None, float | None]:
    """(trainer, mean rollout) idle ratios recomputed from the timeline, as ``row`` logged them.

    The trainer's at the row's time. A rollout rank's at the end of its last generation
    before the leader last took in samples: the logged value is the one the rank's latest
    received group carried.
    """
    if data.leader is None or not data.timeline[data.leader]:
        return None, None
    leader = data.timeline[data.leader]
    at = row["time/unix"]
    trainer = tl.trainer_idle_ratio(leader, at)
    received = [s["end"] for s in session_at(leader, at).of("wait") if s["end"] <= at]
    rollout = []
    for rank in data.rollout_ranks():
        session = session_at(data.timeline[rank], at)
        ends = [
            s["end"] for s in session.of("generate") if not received or s["end"] <= received[-1]
        ]
        ratio = tl.idle_ratio(session, ends[-1]) if ends else None
        if ratio is not None:
            rollout.append(ratio)
    return trainer, (float(np.mean(rollout)) if rollout else None)


def session_at(sessions: list[tl.Session], at: float | None) -> tl.Session:
    """The session running at ``at`` (the last one started by then; default the last)."""
    started = [s for s in sessions if at is None or s.started <= at]
    return started[-1] if started else sessions[0]


def summarize(data: RunData) -> Summary:
    rows, last, st = data.rows, data.status.last, data.status
    n = min(10, max(1, len(rows) // 2))
    staleness = [r["staleness"] for r in data.trained]
    checked = covered_row(data)
    trainer_tl, rollout_tl = timeline_idle(data, checked) if checked else (None, None)
    t0 = data.t0()
    ends = [s.end for sessions in data.timeline.values() for s in sessions]
    return Summary(
        state=st.state,
        steps=last["step"] if last else 0,
        total_steps=st.total_steps,
        param_version=last["param_version"] if last else None,
        samples_trained=last["samples/total"] if last else 0,
        samples_dropped=last["samples/dropped"] if last else 0,
        reward_first=float(np.mean([r["reward/mean"] for r in rows[:n]])) if rows else None,
        reward_last=float(np.mean([r["reward/mean"] for r in rows[-n:]])) if rows else None,
        reward_window=n,
        throughput=last["throughput/samples_per_s"] if last else None,
        staleness_mean=float(np.mean(staleness)) if staleness else None,
        staleness_max=int(max(staleness)) if staleness else None,
        idle_step=checked["step"] if checked else None,
        trainer_idle_logged=checked["trainer/idle_ratio"] if checked else None,
        rollout_idle_logged=checked["rollouter/idle_ratio"] if checked else None,
        trainer_idle_timeline=trainer_tl,
        rollout_idle_timeline=rollout_tl,
        attempts=st.attempts,
        wall_s=(max(ends) - t0) if ends and t0 is not None else None,
        checkpoint=st.checkpoint,
        errors=st.errors,
        validation=st.validation,
        collapse=[r["collapse/line"] for r in rows if "collapse/line" in r],
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def format_summary(s: Summary, run_dir: Path) -> str:
    total = s.total_steps or "?"
    lines = [
        f"run {run_dir}: {s.state}, step {s.steps}/{total}, param version {s.param_version}"
        + (f", {s.attempts} attempts (resumed)" if s.attempts > 1 else "")
        + (f", {s.wall_s:.0f}s on the timeline" if s.wall_s is not None else ""),
    ]
    if s.reward_first is not None:
        lines.append(
            f"  reward      {s.reward_first:.3f} (first {s.reward_window} steps) -> "
            f"{s.reward_last:.3f} (last {s.reward_window})"
        )
        lines.append(
            f"  samples     {s.samples_trained} trained, {s.samples_dropped} dropped; "
            f"{s.throughput:.1f} samples/s"
        )
    if s.staleness_mean is not None:
        lines.append(f"  staleness   mean {s.staleness_mean:.2f}, max {s.staleness_max} versions")
    if s.idle_step is not None:
        lines.append(
            f"  idle        trainer {_pct(s.trainer_idle_logged)} (timeline {_pct(s.trainer_idle_timeline)}), "
            f"rollout {_pct(s.rollout_idle_logged)} (timeline {_pct(s.rollout_idle_timeline)}) "
            f"at step {s.idle_step}"
        )
    if s.validation:
        first, last = s.validation[0], s.validation[-1]
        lines.append(f"  validation  {format_validation(first)}")
        if last is not first:
            lines.append(f"              -> {format_validation(last)}")
        lines.append(f"              {len(s.validation)} validations")
    for line in s.collapse:  # trainer/collapse.py
        lines.append(f"  warning     {line}")
    if s.checkpoint is not None:
        lines.append(f"  checkpoint  {s.checkpoint.path.name}")
    lines += goodput_lines(run_dir, indent="  ")  # the timeline of attempts
    for err in s.errors:
        lines.append(f"  {'error' if err.current else 'old error'}   {err.line}")
    return "\n".join(lines)


# --- plots ----------------------------------------------------------------------------


def windowed_throughput(
    rows: list[dict], restarts: list[float], window: int = 5
) -> tuple[list[int], list[float]]:
    """Samples/s over the last ``window`` steps, where no restart falls between them."""
    steps, rates = [], []
    for i in range(window, len(rows)):
        a, b = rows[i - window], rows[i]
        if "time/unix" not in a or "time/unix" not in b:
            continue
        dt = b["time/unix"] - a["time/unix"]
        dn = b["samples/total"] - a["samples/total"]
        if dt > 0 and dn > 0 and not any(a["time/unix"] < t <= b["time/unix"] for t in restarts):
            steps.append(b["step"])
            rates.append(dn / dt)
    return steps, rates


def zoom_window(data: RunData) -> tuple[float, float] | None:
    """A few steps in the middle of the last session, where the two sides' overlap shows."""
    if data.leader is None or not data.timeline[data.leader]:
        return None
    trains = data.timeline[data.leader][-1].of("train")
    if len(trains) < 2:
        return None
    k = min(len(trains), 8)
    first = len(trains) // 2 - k // 2
    start, end = trains[first]["start"], trains[first + k - 1]["end"]
    pad = 0.05 * (end - start)
    return start - pad, end + pad


def draw_gantt(ax, data: RunData, t0: float, window: tuple[float, float] | None) -> None:
    ranks = sorted(data.timeline)
    labels = []
    for y, rank in enumerate(ranks):
        sessions = data.timeline[rank]
        role = _role(sessions)
        labels.append(f"rank {rank} {role}" + (" (leader)" if rank == data.leader else ""))
        for kind, color in SPAN_COLORS.items():
            bars = [
                (s["start"] - t0, s["end"] - s["start"])
                for session in sessions
                for s in session.spans
                if s["span"] == kind
                and (window is None or (s["end"] >= window[0] and s["start"] <= window[1]))
            ]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, linewidth=0)
        for session in sessions[1:]:
            ax.axvline(session.started - t0, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(ranks)), labels)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("wall time since the first rank started (s)")
    if window is not None:
        ax.set_xlim(window[0] - t0, window[1] - t0)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in SPAN_COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )


def learning_panels(fig, grid, rows: list[dict], steps: list[int]) -> None:
    """Why a run stalls: the policy's entropy and the groups with no GRPO signal; the
    rollout's log-probs against the trainer's (rollout_corr) and responses cut at the
    maximum length. Rows without a metric (older runs) are left out of its line."""

    def line(ax, key: str, label: str) -> None:
        xs = [s for s, r in zip(steps, rows, strict=True) if key in r]
        ax.plot(xs, [r[key] for r in rows if key in r], lw=1, label=label)

    ax = fig.add_subplot(grid[3, 0])
    line(ax, "actor/entropy", "policy entropy (nats)")
    line(ax, "batch/zero_variance_groups", "share of groups with equal rewards")
    ax.set(title="entropy and groups without a learning signal", xlabel="step")
    ax.legend(fontsize="small")

    ax = fig.add_subplot(grid[3, 1])
    line(ax, "rollout_corr/kl", "kl: mean(old - rollout log-prob)")
    line(ax, "rollout_corr/k3_kl", "k3 kl")
    line(ax, "response_length/clip_ratio", "responses cut at the max length")
    ax.set(title="rollout vs trainer log-probs, clipped responses", xlabel="step")
    ax.legend(fontsize="small")


def plot(data: RunData, summary: Summary, out: Path) -> None:
    figure(data, summary).savefig(out, dpi=72)


def figure(data: RunData, summary: Summary):
    """The report's panels (a matplotlib ``Figure``, each panel's axes titled)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = data.rows
    steps = [r["step"] for r in rows]
    t0 = data.t0()
    fig = Figure(figsize=(13, 20), layout="constrained")
    grid = fig.add_gridspec(6, 2, height_ratios=[1, 1, 1, 1, 1.1, 1.1])
    title = f"{data.status.run_dir.name}: {summary.state}, step {summary.steps}/{summary.total_steps or '?'}"
    fig.suptitle(title)

    ax = fig.add_subplot(grid[0, 0])
    ax.plot(steps, [r["reward/mean"] for r in rows], lw=1, label="training samples")
    vals = [r for r in summary.validation if "val/reward/mean" in r]
    if vals:
        ax.plot(
            [r["step"] for r in vals],
            [r["val/reward/mean"] for r in vals],
            "o-",
            ms=4,
            label="validation (data.val)",
        )
        ax.legend(fontsize="small")
    ax.set(title="reward (mean over the step's samples)", xlabel="step")

    ax = fig.add_subplot(grid[0, 1])
    if t0 is not None and rows and "time/unix" in rows[-1]:
        xs, ys = [], []
        restarts = data.restarts()
        for r in rows:
            if "time/unix" not in r:
                continue
            if xs and any(xs[-1] + t0 < t <= r["time/unix"] for t in restarts):
                xs.append(np.nan)  # no line across the time the job was down
                ys.append(np.nan)
            xs.append(r["time/unix"] - t0)
            ys.append(r["reward/mean"])
        ax.plot(xs, ys, ".-", ms=3, lw=0.5)
        ax.set(xlabel="wall time since the first rank started (s)")
    else:
        ax.plot(
            [r["time/elapsed_s"] for r in rows],
            [r["reward/mean"] for r in rows],
            ".-",
            ms=3,
            lw=0.5,
        )
        ax.set(xlabel="seconds since the first weight sync")
    ax.set(title="reward over wall time")

    ax = fig.add_subplot(grid[1, 0])
    ax.plot(steps, [r["throughput/samples_per_s"] for r in rows], label="average since start")
    ws, wr = windowed_throughput(rows, data.restarts())
    ax.plot(ws, wr, lw=0.8, alpha=0.7, label="over the last 5 steps")
    ax.set(title="throughput (samples trained / s)", xlabel="step")
    ax.legend(fontsize="small")

    ax = fig.add_subplot(grid[1, 1])
    trained = [r["staleness"] for r in data.trained]
    dropped = [r["staleness"] for r in data.dropped]
    top = max(trained + dropped, default=0)
    bins = np.arange(-0.5, top + 1.5, 1.0)
    ax.hist([trained, dropped], bins=bins, label=["trained", "dropped"], stacked=True)
    ax.set(title="staleness of samples (versions behind the trainer)", xlabel="staleness")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")

    ax = fig.add_subplot(grid[2, 0])
    ax.step(steps, [r.get("queue/groups", 0) for r in rows], where="post")
    ax.set(title="queue depth at the end of each step (groups)", xlabel="step")

    ax = fig.add_subplot(grid[2, 1])
    ax.plot(steps, [r["trainer/idle_ratio"] for r in rows], label="trainer (waits for samples)")
    ax.plot(steps, [r["rollouter/idle_ratio"] for r in rows], label="rollout (waits for credits)")
    ax.set(title="idle ratio since the first weight sync", xlabel="step", ylim=(0, 1))
    ax.legend(fontsize="small")

    learning_panels(fig, grid, rows, steps)

    ax = fig.add_subplot(grid[4, :])
    if t0 is not None and data.timeline:
        draw_gantt(ax, data, t0, None)
    ax.set_title("timeline of every rank (whole run; dashed: a rank restarted)")

    ax = fig.add_subplot(grid[5, :])
    window = zoom_window(data)
    if t0 is not None and window is not None:
        draw_gantt(ax, data, t0, window)
    ax.set_title("timeline, zoomed on a few steps in the middle of the run")
    return fig


def main(argv: list[str] | None = None, prog: str = "python -m hpc_asyncppo.report") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write RUN_DIR/report.png and print a summary of the run.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument(
        "--out", type=Path, default=None, help="image path (default RUN_DIR/report.png)"
    )
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    data = load(args.run_dir)
    summary = summarize(data)
    out = args.out or args.run_dir / REPORT
    plot(data, summary, out)
    print(format_summary(summary, args.run_dir))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
