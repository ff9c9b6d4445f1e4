"""Multi-turn runs with tools under mpirun (``rollout.multi_turn``, the transformers engine):
the synthetic lookup task, stopped by SIGTERM while trajectories are mid-turn and tool
calls run, resumed, trained exactly once, and learned. vLLM continuing trajectories from
their observations: tests/rollout/test_vllm_engine.py; the learning over seeds and modes:
BENCHMARKS.md ("Multi-turn tool task")."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hpc_asyncppo.checkpoint.protocol import list_checkpoints
from hpc_asyncppo.checkpoint.store import CheckpointReader
from hpc_asyncppo.models.tiny import TinyTokenizer
from hpc_asyncppo.runlog import read_jsonl, split_metrics
from hpc_asyncppo.tasks.next_digit import write_prompts
from hpc_asyncppo.tasks.tool_lookup import CALL, generate_prompts, lookup_tool_config
from tests.harness import Run, check_audit

pytestmark = pytest.mark.mpi

MULTI_TURN = [
    "data.task=tool_lookup",
    "rollout.multi_turn.enable=true",
    "rollout.response_length=10",
    "rollout.multi_turn.max_parallel_calls=64",
    # trajectories continue across syncs between their turns, and from their tokens after
    # a resume whatever the weights version
    "async_training.partial_rollout=true",
    "async_training.trigger_parameter_sync_step=1",  # the audit's schedule holds over a resume
    "rollout.record_sent_groups=true",
    "timeouts.sample_wait_s=120",
]


@pytest.mark.timeout(900)
def test_a_tool_run_stopped_mid_turn_resumes_every_trajectory_once_and_learns(tmp_path):
    """First attempt, on two rollout ranks: each lookup call takes 0.1-0.4 s, so a SIGTERM
    after step 10 finds trajectories waiting on calls and others mid-turn; the checkpoint
    keeps their turns (observations as loss-mask holes, the tool's state). The resumed run,
    on one rollout rank (the tool made instant: the copy of its config in the run directory
    edited, as a user may), continues both ranks' trajectories from their tokens (partial
    rollout: none generated again), runs the cut calls again, trains every sample once at
    its true staleness, and learns to use the tool: over its last 20 steps it calls the
    tool four times as often as over its first 20, earns four times the reward, and its
    greedy reward rises past the untrained policy's (the copy of the answer comes later: 0.8 and
    more by step 400 over seeds and both modes, BENCHMARKS.md "Multi-turn tool task")."""
    run_dir, steps = tmp_path / "run", 120
    val = tmp_path / "val.jsonl"
    write_prompts(val, generate_prompts(32, seed=99))
    tools = tmp_path / "tools.yaml"
    tools.write_text(lookup_tool_config("[0.1, 0.4]"))
    args = [*MULTI_TURN, f"rollout.multi_turn.tool_config_path={tools}",
            f"trainer.total_steps={steps}", "checkpoint.save_every=0",
            f"data.val={val}", "trainer.test_freq=60"]  # fmt: skip
    run = Run.start(run_dir, *args, rollout_ranks=2)
    run.wait_for_step(10)
    run.stop()  # exit 143
    (folder,) = list_checkpoints(run_dir)[:1]
    cut = []
    for rank in (0, 1):
        with CheckpointReader(folder / f"rollout{rank}.h5") as reader:
            cut += reader.get("partial") or []
    assert cut, "the stop found no trajectory in flight"
    # mid-turn: a response with an observation so far, or one waiting on its call (its last
    # token the end of the call)
    call_end = TinyTokenizer(run_dir / "model").backend.token_to_id(CALL[1])
    observed = sum(int((g["loss_mask"] == 0).any()) for g in cut if "loss_mask" in g)
    waiting = sum(
        int(length > 0 and not g["finished"][j] and g["response_ids"][j, length - 1] == call_end)
        for g in cut
        for j, length in enumerate(g["response_lengths"].tolist())
    )
    assert observed or waiting, "no trajectory was cut mid-turn"
    assert all("tools" in g for g in cut)  # the tool's state rides along (JSON bytes)

    (run_dir / "tool_config.yaml").write_text(lookup_tool_config("0"))
    done = run.resume(rollout_ranks=1).finish()
    assert done.returncode == 0, done.stdout + done.stderr
    log = (run_dir / "logs" / "rank0.log").read_text()
    resumed = re.search(r"(\d+) cut groups resumed, (\d+) tokens to generate again", log)
    assert resumed and int(resumed[1]) == len(cut) and int(resumed[2]) == 0, resumed
    trained = check_audit(run_dir, sync_every=1, max_staleness=4, partial=True)
    metrics, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert len({r["uid"] for r in trained}) == len(trained) == metrics[-1]["samples/total"]
    assert all("observation_tokens" in r for r in trained[-100:])
    # Learning judged as a rise, not a pace: how far a run gets by step 120 moves with its
    # timing (fully_async: staleness follows the machine's load). Over five runs, the last
    # 20 steps against the first 20: tool-call rate 0.973-0.991 against 0.10-0.11 (9x),
    # sampled reward 0.178-0.259 against 0.012-0.015 (13-20x), greedy validation
    # 0.134-0.375 against 0 at step 0. The bars: a 4x rise of both, and a greedy reward
    # past the untrained policy's.
    first, last = metrics[:20], metrics[-20:]
    rate = np.mean([m["multi_turn/tool_call_rate"] for m in last])
    untrained_rate = np.mean([m["multi_turn/tool_call_rate"] for m in first])
    reward = np.mean([m["reward/mean"] for m in last])
    untrained = np.mean([m["reward/mean"] for m in first])
    assert rate >= 4 * untrained_rate and reward >= 4 * untrained, (rate, reward, untrained)
    assert [v["step"] for v in vals][-1] == steps, vals
    assert vals[-1]["val/reward/mean"] > vals[0]["val/reward/mean"], vals
    assert metrics[-1]["tools/calls"] > 0 and metrics[-1]["tools/timeouts"] == 0
