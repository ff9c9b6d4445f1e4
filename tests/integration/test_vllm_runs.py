"""Real runs under mpirun with ``rollout.engine=vllm`` (vLLM's CPU build): the default task
learns, every sync reaches the vLLM worker, and partial rollout stamps cut groups.

Each run starts one vLLM engine per rollout rank (~25 s on two cores) before training.
The tiny model gets 2 attention heads: vLLM's CPU attention has no kernel for head size 16.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest

from hpc_asyncppo.checkpoint.protocol import checkpoint_step, list_checkpoints
from hpc_asyncppo.checkpoint.store import CheckpointReader
from hpc_asyncppo.runlog import read_jsonl, read_rank_info
from tests.conftest import vllm_environment
from tests.harness import Run, check_audit, check_weights_match

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh --with-vllm)")
pytestmark = pytest.mark.mpi

VLLM = [
    "rollout.engine=vllm",
    "model.tiny.num_heads=2",
    "checkpoint.save_every=0",
    "trainer.record_weight_digests=true",
    "rollout.record_sent_groups=true",
    "timeouts.sample_wait_s=120",
]


@pytest.fixture(autouse=True)
def vllm_env(tmp_path, monkeypatch, vllm_cache):
    for key, value in vllm_environment(tmp_path, vllm_cache).items():
        monkeypatch.setenv(key, value)


def mean_reward(metrics: list[dict], steps: range) -> float:
    rows = [m["reward/mean"] for m in metrics if m["step"] in steps]
    return sum(rows) / len(rows)


def test_tool_task_learns_with_vllm(tmp_path):
    """The multi-turn tool task (``tasks/tool_lookup.py``) on vLLM, 60 steps: turns stop at
    the call's end, trajectories wait for the lookup tool while vLLM generates the others,
    and continue from their observations (its prefix cache on). The policy learns to call
    the tool (over the last 20 steps four times as often as over the first 20, for four
    times the reward; the learning over seeds: BENCHMARKS.md "Multi-turn tool task"), every
    sync reaches vLLM's worker (digests at every version) and every sample is trained once
    at its true staleness. The default task's curve on vLLM: 0.07 -> 0.45 in 150 steps."""
    run_dir, steps = tmp_path / "run", 60
    args = [*VLLM, "data.task=tool_lookup", "rollout.multi_turn.enable=true",
            "rollout.multi_turn.tool_config_path=tools/lookup.yaml", "rollout.response_length=10",
            f"trainer.total_steps={steps}"]  # fmt: skip
    proc = Run.start(run_dir, *args, rollout_ranks=1).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    # A rise, not a pace (how far a run gets by a step moves with its timing): over three
    # runs the call rate rose 6.5-7.1x from steps 1-20 (0.105-0.118) to steps 41-60, and
    # the reward 6.3-7.5x (8.1-9.2x and 14-18x by steps 81-100). The bars: a 4x rise of both.
    rate = [m["multi_turn/tool_call_rate"] for m in metrics]
    assert sum(rate[-20:]) >= 4 * sum(rate[:20]), rate
    first, last = range(1, 21), range(steps - 19, steps + 1)
    assert mean_reward(metrics, last) >= 4 * mean_reward(metrics, first), metrics
    # versions 0..15: the initial sync, then one every 4 steps
    check_weights_match(run_dir, rollout_ranks=1, versions=16)
    check_audit(run_dir, sync_every=4, max_staleness=4)


def test_your_own_agent_runs_through_the_gateway_on_vllm(tmp_path):
    """The lookup task as the user's own agent (``examples/lookup_agent.py``: the openai
    client and OpenAI tool calling), its calls through the rollout rank's gateway into
    vLLM, 8 steps: every session ends with its reward (no group dropped but for
    staleness), the agent's own number is logged at every step, every sync reaches vLLM's
    worker and every sample is trained once at its true staleness. Its learning (to 0.8
    over seeds, hf engine): BENCHMARKS.md "Bring your own agent"; the exact tokens of each
    call: tests/rollout/test_gateway.py."""
    run_dir, steps = tmp_path / "run", 8
    args = [*VLLM, "data.task=tool_lookup", "data.agent=examples.lookup_agent:run",
            "rollout.response_length=10", f"trainer.total_steps={steps}"]  # fmt: skip
    proc = Run.start(run_dir, *args, rollout_ranks=1).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(0 <= m["agent/tool_calls"] <= 4 for m in metrics), metrics
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    assert all(r["reason"] == "stale" for r in dropped), dropped
    check_weights_match(run_dir, rollout_ranks=1, versions=3)  # v0, then every 4 steps
    check_audit(run_dir, sync_every=4, max_staleness=4)


def digests(run_dir: Path, rank: int, skip: int = 0) -> dict[int, str]:
    """Version -> weights digest that rank recorded at each sync, past its first ``skip``."""
    rows = read_jsonl(run_dir / "weights" / f"rank{rank}.jsonl")[skip:]
    return {r["version"]: r["digest"] for r in rows}


def _descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue  # a thread that just ended
        for child in children:
            out += [int(child), *_descendants(int(child))]
    return out


def ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (its SigIgn mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(
        next(line for line in status.splitlines() if line.startswith("SigIgn")).split()[1], 16
    )
    return {sig for sig in range(1, 64) if mask >> (sig - 1) & 1}


def descendants_of(run_dir: Path, rollout_rank: int) -> list[int]:
    info = next(i for i in read_rank_info(run_dir) if i["rank"] == rollout_rank)
    return _descendants(info["pid"])


def engine_processes(pids: list[int]) -> list[int]:
    """vLLM's engine core and workers among ``pids``: vLLM titles them ``VLLM::...``. Not
    Python's helpers a rank may also have started (multiprocessing's resource tracker)."""
    engine = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::"):
                engine.append(pid)
        except OSError:
            continue  # ended
    return engine


@pytest.mark.timeout(1500)  # two attempts and engine restarts: see tests/harness.py HANG_S
def test_partial_rollout_stop_signals_and_dead_engines_lose_nothing(tmp_path):
    """vLLM with long responses, a sync every step, partial rollout and in-flight weight
    updates, in two attempts:

    1. One rollout rank at tensor_parallel_size=2 (two vLLM workers in the weight group)
       and two trainer ranks. As under Slurm, the stop signal reaches every process of the
       job, vLLM's engine processes included: they ignore USR2 and SIGTERM; the rollout
       rank cuts its groups mid-response into the checkpoint and shuts vLLM down itself.
    2. Resumed on two rollout ranks at tensor_parallel_size=1 (workers of two ranks in the
       weight group; old rank 0's cut groups continue on rank 0) and one trainer rank. A
       fault at a named moment (``runtime/faults.py``), in rank 0's vLLM worker as the
       weights of its engine's 2nd sync arrive, before it loads them: the worker kills its
       engine core. The rank restarts its engine in place, the leader has the weight group
       meet anew (rank 1's worker rejoins it too) and sends the weights again, and the
       groups in flight continue from their tokens. (When the leader's next broadcast began
       before rank 0's REJOIN reached it, rank 1, receiving that broadcast, waits
       engine_stall_s and restarts its engine as well: a rank's receive cannot be woken
       sooner.) The attempt finishes without a job restart. An engine that stalls instead
       of dying ends the same way, as ``EngineDied``: its detection after
       ``engine_stall_s``, named, is ``tests/rollout/test_vllm_engine.py``'s stopped-engine
       test; from there the rank's restart is the one this test takes.

    Over both: the cut groups continued from their tokens, groups cut by syncs finished
    under newer weights (versions that changed mid-response), every sample was trained once
    with its true staleness, every worker loaded exactly the trainer's weights at every
    version it holds (worker-side digests; a rank whose engine was down while the leader
    published a version gets the newer one when it rejoins), and the restarts are in the
    logs, the metrics and goodput.jsonl. One launch for both stories: each vLLM launch
    costs an engine start-up per rollout rank. The same with one rollout rank and three
    faults (two SIGKILLs): BENCHMARKS.md "Engine restarts in place"."""
    run_dir = tmp_path / "run"
    # The stop and the faults must find groups mid-response: a rank waiting for credit has
    # nothing to cut. So the rollout is the bottleneck and never waits: a step's 8 samples
    # train in a fraction of the ~100 decoding steps a response takes, each rank generates
    # one group at a time (with ignore_eos, groups started together would end together and
    # then all wait for the same sync) and the budget (staleness 2: 6 groups) leaves each
    # rank credits in hand while it generates. The stop is sent once step 2 is logged, by a
    # test process the machine may starve for seconds (10 s are 14 steps here), so the
    # first attempt's end is out of reach: the resume sets the run's length, 8 steps past
    # the step it stopped at.
    groups, n = 2, 4
    args = [*VLLM, "rollout.tensor_parallel_size=2", "async_training.partial_rollout=true",
            "async_training.trigger_parameter_sync_step=1", f"actor.ppo_mini_batch_size={groups}",
            f"rollout.n={n}", "rollout.response_length=96", "rollout.ignore_eos=true",
            "rollout.prompts_per_generate=1", "async_training.staleness_threshold=2.0",
            "trainer.total_steps=100000"]  # fmt: skip
    run = Run.start(run_dir, *args, rollout_ranks=1, train_ranks=2)
    run.wait_for_step(2)
    pids = descendants_of(run_dir, 0)
    engine = engine_processes(pids)
    assert len(engine) == 3, engine  # the engine core and its two workers
    for pid in engine:
        assert {signal.SIGUSR2, signal.SIGTERM} <= ignored_signals(pid), pid
    for pid in pids:  # Slurm signals every process; the launcher forwards USR2 to the ranks
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
            os.kill(pid, signal.SIGTERM)
    run.stop()  # exit 143, "continue with" the resume
    (folder,) = list_checkpoints(run_dir)[:1]
    steps = checkpoint_step(folder) + 8
    with CheckpointReader(folder / "rollout0.h5") as reader:
        cut = reader.get("partial") or []
    assert any(0 < int(g["response_lengths"].max()) < 96 for g in cut), cut

    # the first attempt: the rollout rank holds the leader's (rank 1's) weights at every
    # version, once both its workers agree (a rank that sees two digests fails)
    first = [digests(run_dir, rank) for rank in (0, 1)]
    assert first[0] == first[1] and len(first[1]) >= 2, first
    # rank 1 is a rollout rank in the resumed attempt and rank 2 its leader: their files
    # go on past the first attempt's lines
    lines = [len(read_jsonl(run_dir / "weights" / f"rank{rank}.jsonl")) for rank in (0, 1, 2)]

    # engine_stall_s 20 s: far beyond what a healthy engine starved of CPU goes without a
    # step here, so that no healthy engine counts as stalled
    faults = "kill_engine@bucket=1:rank=0:sync=2"
    run.resume(f"trainer.total_steps={steps}", "rollout.tensor_parallel_size=1",
               "rollout.engine_stall_s=20", "trainer.max_restarts=0", rollout_ranks=2, train_ranks=1,
               env={"HPC_ASYNCPPO_FAULTS": faults})  # fmt: skip
    proc = run.finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = check_audit(run_dir, sync_every=1, max_staleness=4, partial=True)
    uids = [r["uid"] for r in trained]
    assert len(uids) == len(set(uids)) == steps * groups * n
    spanning = [r for r in trained if r["param_version_end"] > r["param_version_start"]]
    assert spanning, "no group was cut by a sync and continued under newer weights"

    # the restarts: the fault fired once, and restarted rank 0's engine once; rank 1's
    # restarts (if any) each for a broadcast that stalled; every one named, counted in the
    # metrics and goodput.jsonl
    fired = [row["fault"] for row in read_jsonl(run_dir / "faults_fired.jsonl")]
    assert fired == faults.split(","), fired
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["step"] == steps
    logs = [(run_dir / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    named = [re.findall(r": (.*); restarting the engine \(restart", log) for log in logs]
    assert len(named[0]) == 1, named
    assert re.search(r"EngineCore\w* \(pid \d+\) died \(signal SIGKILL\)", named[0][0]), named
    assert all("received no whole weight update" in line for line in named[1]), named
    restarts = metrics[-1]["rollout/engine_restarts"]
    assert restarts == len(named[0]) + len(named[1]), (named, restarts)
    attempt = read_jsonl(run_dir / "goodput.jsonl")[-1]
    assert attempt["reason"] == "finished" and attempt["engine_restarts"] == restarts
    assert attempt["engine_restart_s"] > 0
    assert all(a["tokens_regenerated"] == 0 for a in read_jsonl(run_dir / "goodput.jsonl"))
    # the groups in flight at each fault continue from their tokens (the rollout never
    # waits for credit here, and a sync cuts its groups without ending them)
    kept = [
        int(t) for t in re.findall(r"groups in flight \((\d+) tokens\) continue", "".join(logs))
    ]
    assert len(kept) == restarts and sum(kept) > 0, kept

    # the resumed attempt: its leader is rank 2 again; each rollout rank holds the leader's
    # weights at every version it holds, and ends on the last one
    second = digests(run_dir, 2, skip=lines[2])
    for rank in (0, 1):
        mine = digests(run_dir, rank, skip=lines[rank])
        assert max(second) in mine and mine == {v: second.get(v) for v in mine}, (rank, mine)
    assert sorted({**first[1], **second}) == list(range(max(second) + 1))
    assert len(first[1]) + len(second) > steps
