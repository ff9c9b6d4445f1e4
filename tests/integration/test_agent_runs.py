"""Your own agent (``data.agent``) driving generation through the rollout ranks' gateways
under mpirun, on the transformers engine: the example lookup agent stopped by SIGTERM
with sessions in flight, resumed on two rollout ranks, stopped again, resumed on one, with
every session of every prompt trained exactly once, and a session's call before the stop
answered after it from the checkpoint's recording, not generated again; agents that fail
drop their groups with the reason, and the run goes on. The exact tokens of each call and
session: tests/rollout/test_gateway.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hpc_asyncppo.checkpoint.protocol import checkpoint_step, list_checkpoints
from hpc_asyncppo.checkpoint.store import CheckpointReader
from hpc_asyncppo.rollout.gateway.addresses import read_addresses
from hpc_asyncppo.runlog import read_jsonl, split_metrics
from hpc_asyncppo.tasks.next_digit import write_prompts
from hpc_asyncppo.tasks.tool_lookup import generate_prompts
from tests.harness import HANG_S, REPO, Run, check_audit
from tests.integration.agents import GATED, GATED_AGAIN

pytestmark = pytest.mark.mpi

MAX_STALENESS = 2
AGENT = [
    "data.task=tool_lookup",
    "data.agent=tests.integration.agents:slow_and_failing",
    "rollout.response_length=10",
    "actor.ppo_mini_batch_size=4",
    "async_training.trigger_parameter_sync_step=1",
    "rollout.record_sent_groups=true",
    "timeouts.sample_wait_s=120",
    f"async_training.max_staleness={MAX_STALENESS}",
]


@pytest.mark.timeout(900)
def test_agent_sessions_stopped_in_flight_resume_on_other_rank_counts_trained_once(tmp_path):
    """The first stop comes once the run's first answered session (its agent waits after
    that answer: ``tests/integration/agents.py`` ``_Gate``) has two trainer steps behind
    it, so the checkpoint holds that session's first turn under older weights than the
    resume's; the second stop two steps into the second attempt."""
    run_dir = tmp_path / "run"
    val_prompts = 6
    write_prompts(tmp_path / "val.jsonl", generate_prompts(val_prompts, seed=99))
    args = [a.replace("slow_and_failing", "gated_slow_and_failing") for a in AGENT]
    # The stops come from a test process the machine may starve for seconds: the first two
    # attempts' end is out of reach, and the last resume sets the run's length, 4 steps
    # past the second stop's checkpoint and 9 at least.
    run = Run.start(run_dir, *args, "trainer.total_steps=100000",
                    "async_training.partial_rollout=true", f"data.val={tmp_path / 'val.jsonl'}",
                    "trainer.test_freq=3", rollout_ranks=1, train_ranks=1)  # fmt: skip
    run.wait_until(lambda: (run_dir / GATED).exists(), "the gated session's first answer")
    gated = json.loads((run_dir / GATED).read_text())
    for rollout_ranks in (2, 1):
        run.wait_for_step(max(run.steps_done(), 1) + 2)
        assert read_addresses(run_dir)  # every rollout rank listens, and says where
        run.stop()
        if rollout_ranks == 2:  # the checkpoint holds the gated session's first turn
            (folder,) = list_checkpoints(run_dir)[:1]
            with CheckpointReader(folder / "rollout0.h5") as reader:
                cut = reader.get("partial") or []
            j = int(gated["session"].rsplit("-r", 1)[1])
            turn = gated["token_ids"]
            [held] = [g for g in cut if g["prompt"].tolist() == gated["prompt_token_ids"]
                      and g["response_ids"][j, : len(turn)].tolist() == turn]  # fmt: skip
        else:
            steps = max(9, checkpoint_step(list_checkpoints(run_dir)[0]) + 4)
        run.resume(*([] if rollout_ranks == 2 else [f"trainer.total_steps={steps}"]),
                   rollout_ranks=rollout_ranks)  # fmt: skip
    stopped_at = run.steps_done()
    proc = run.finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = check_audit(run_dir, sync_every=1, max_staleness=MAX_STALENESS, partial=True)
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    # every prompt's n sessions were trained once, or dropped once with its agent's failure
    uids = [r["uid"] for r in trained] + [r["uid"] for r in dropped]
    assert len(uids) == len(set(uids))
    firsts = {r["uid"]: r for r in trained if ".s" not in r["uid"]}
    assert len(firsts) == steps * 4 * 8
    # the agents that start over: each of their sessions trained as two sequences, the
    # second with its session's reward, in the same step
    later = [r for r in trained if ".s" in r["uid"]]
    starting_over = {
        u.rsplit("-r", 1)[0] for u in firsts if int(u.split("-p")[1].split("-")[0]) % 5 == 1
    }
    assert starting_over, "no prompt that starts over was trained"
    assert sorted(r["uid"] for r in later) == sorted(
        f"{p}-r{j}.s1" for p in starting_over for j in range(8)
    )
    for r in later:
        first = firsts[r["uid"].split(".s")[0]]
        assert (r["reward"], r["step"]) == (first["reward"], first["step"]), (first, r)
    failures = {r["uid"].rsplit("-r", 1)[0]: r["reason"] for r in dropped if r["reason"] != "stale"}
    assert failures, "no failing agent's group was dropped"
    for prefix, reason in failures.items():
        index = int(prefix.rsplit("-p", 1)[1])
        assert index % 7 == 3 and reason.startswith("agent failed: session"), (prefix, reason)
        why = ["raised RuntimeError: injected agent failure", "not a finite reward",
               "ended it without a call"][(index // 7) % 3]  # fmt: skip
        assert why in reason, reason
    assert all(int(r["uid"].split("-p")[1].split("-")[0]) % 7 != 3 for r in trained)
    # the agents' own numbers (the lookup agent's tool_calls) are logged, per step
    metrics, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(0 <= m["agent/tool_calls"] <= 4 for m in metrics), metrics
    # validation through the agents (a stop does not wait for one in flight), every
    # val prompt scored, from the last resume on at every trainer.test_freq steps
    assert all(v["step"] % 3 == 0 and v["val/prompts"] == val_prompts for v in vals), vals
    assert {v["step"] for v in vals} >= set(range(stopped_at + -stopped_at % 3, steps + 1, 3))
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    assert [a["reason"] for a in attempts][-1] == "finished" and len(attempts) == 3
    # the sessions cut by each stop ran again from their prompts, their agents' calls
    # answered from the checkpoint's recordings while they were the same (partial rollout):
    # the gated session's first answer after the resume is its answer before the stop,
    # tokens, log-probs and the versions that sampled them, all older than the weights the
    # resume began with (every token generated after it carries those or newer)
    again = json.loads((run_dir / GATED_AGAIN).read_text())
    assert again == gated, (gated, again)
    leader_log = (run_dir / "logs" / "rank2.log").read_text()  # the resumed attempt's leader
    resumed_version = int(re.search(r"resumed from .*: step \d+, version (\d+)", leader_log)[1])
    assert max(gated["token_versions"]) < resumed_version, (gated, resumed_version)
    assert held["versions"][j, : len(turn)].tolist() == gated["token_versions"]
    logs = "".join((run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1))
    replayed = re.findall(r"(\d+) agent calls answered from cut sessions' recordings", logs)
    assert sum(map(int, replayed)) >= 1, replayed


@pytest.mark.timeout(900)
def test_external_agent_processes_claim_every_session_of_a_run_on_two_rollout_ranks(tmp_path):
    """``data.agent=external``: no agent in the job; two processes outside it (the example
    ``examples/external_agent.py``) claim sessions from both ranks' gateways until the run
    ends, validation's sessions too: each validation's score is the mean of the rewards
    the agents gave its sessions."""
    run_dir = tmp_path / "run"
    steps, val_prompts, val_n = 4, 6, 2
    write_prompts(tmp_path / "val.jsonl", generate_prompts(val_prompts, seed=99))
    args = [a for a in AGENT if not a.startswith("data.agent=")]
    run = Run.start(run_dir, *args, "data.agent=external", f"trainer.total_steps={steps}",
                    f"data.val={tmp_path / 'val.jsonl'}", "trainer.test_freq=2",
                    f"rollout.val_n={val_n}", rollout_ranks=2, train_ranks=1)  # fmt: skip
    transcripts = tmp_path / "transcripts.jsonl"
    agent = [sys.executable, "examples/external_agent.py", str(run_dir), "--local",
             "--transcripts", str(transcripts)]  # fmt: skip
    agents = [subprocess.Popen(agent, cwd=REPO, stdout=subprocess.PIPE, text=True)
              for _ in range(2)]  # fmt: skip
    try:
        proc = run.finish()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outputs = [a.communicate(timeout=HANG_S)[0] for a in agents]  # they see the end
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert len({row["rank"] for row in read_addresses(run_dir)}) == 2
    trained = check_audit(run_dir, sync_every=1, max_staleness=MAX_STALENESS)
    assert len(trained) == steps * 4 * 8 and len({r["uid"] for r in trained}) == len(trained)
    assert {r["rollout_rank"] for r in trained} == {0, 1}
    failed = [r["reason"] for r in read_jsonl(run_dir / "dropped_samples.jsonl")
              if r["reason"] != "stale"]  # fmt: skip
    assert not failed, failed  # the example agent ends every session it claims, and well
    assert sum(int(o.split()[2]) for o in outputs) >= len(trained) // 8  # "N sessions ended"
    # validation at steps 0, 2 and 4, through the agents: its score is their rewards' mean
    ended = [json.loads(line) for line in transcripts.open()]
    vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))[1]
    assert [v["step"] for v in vals] == [0, 2, 4], vals
    for v in vals:
        given = [t["outcome"]["reward"] for t in ended
                 if t["session_id"].startswith(f"val-s{v['step']}-p")]  # fmt: skip
        assert len(given) == val_prompts * val_n, given
        assert v["val/reward/mean"] == pytest.approx(sum(given) / len(given), abs=1e-6)


@pytest.mark.timeout(300)
def test_an_agent_that_fails_every_session_stops_the_run_with_its_error_and_no_restart(tmp_path):
    """An agent that raises on every session: the rank stops the run once
    gateway.max_failed_in_row sessions in a row failed, with one line naming the agent's
    error; the launcher does not start the job again (the same agent fails the same way)."""
    run_dir = tmp_path / "run"
    args = [a for a in AGENT if not a.startswith("data.agent=")]
    run = Run.start(run_dir, *args, "data.agent=tests.integration.agents:raises_key_error",
                    "gateway.max_failed_in_row=16", "trainer.max_restarts=3",
                    rollout_ranks=1, train_ranks=1)  # fmt: skip
    proc = run.finish()
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    failed = re.search(r"AgentError: data.agent failed (\d+) of the last (\d+) sessions", out)
    assert failed and int(failed[1]) == int(failed[2]) >= 16, out
    assert "its agent raised KeyError: 'missing'" in out, out
    assert "Traceback" not in proc.stderr, proc.stderr
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    assert len(attempts) == 1, attempts  # not restarted
