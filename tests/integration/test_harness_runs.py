"""The agent harnesses users already have, unmodified, driving a training run: one short
run of the lookup task (``data.agent=external``) whose groups are run, in turn,
by agents written as each library's documentation shows them (``examples/harnesses/``:
the OpenAI Agents SDK on Responses and on chat completions with a structured output,
LangGraph's ReAct agent on ``langchain-openai``, smolagents' ToolCallingAgent and
CodeAgent, LiteLLM, the ``anthropic`` SDK plain and streamed, mini-swe-agent's model),
from their own environment (``build/harness-venv``, ``constraints/harnesses.txt``).

Every harness's sessions end with a reward and none of their calls gets a 4xx or 5xx;
for every session trained, the tokens its harness got back (what a recording proxy saw
between the harness and the gateway; an answer given again to the same call, marked
``retried``, once) are the rows trained: the model's tokens of each of its sequences, in
order. (The Agents SDK sends the same call again when the model's turn gave it nothing to
add: it gets the same turn.) Then two of them through a stop signal and a resume, every
session trained once. A longer run through all nine: BENCHMARKS.md, "Agent harnesses,
unmodified"."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict

import pytest

from hpc_asyncppo.runlog import read_jsonl
from tests.harness import HANG_S, REPO, Run, check_audit

pytestmark = pytest.mark.mpi
VENV_PYTHON = REPO / "build" / "harness-venv" / "bin" / "python"


def sent_model_tokens(run_dir) -> dict[str, list[int]]:
    """Each sent row's model tokens (loss mask 1), by uid: the rollout rank's record."""
    tokens: dict[str, list[int]] = {}
    for rank_file in (run_dir / "sent").glob("rank*.jsonl"):
        for group in read_jsonl(rank_file):
            tokens.update(group["model_tokens"])
    return tokens


def check_trained_tokens(sessions: list[dict], trained: list[dict], run_dir) -> set[str]:
    """Every trained session's rows, in sequence order, are the model's tokens its harness
    got back (a retried answer once), in the attempt that ran it last; the harnesses
    checked."""
    model_tokens = sent_model_tokens(run_dir)
    last = {s["session_id"]: s for s in sessions}
    rows_of = defaultdict(list)  # session id -> its trained rows' uids
    for r in trained:
        rows_of[r["uid"].split(".s")[0]].append(r["uid"])
    checked = set()
    for sid, uids in rows_of.items():
        assert sid in last, f"a trained session no harness ran: {sid}"
        s = last[sid]
        uids.sort(key=lambda u: int(u.split(".s")[1]) if ".s" in u else 0)
        got = [t for c in s["calls"] if not c.get("retried")  # the same turn again: once
               for t, v in zip(c["token_ids"], c["token_versions"], strict=True) if v >= 0]  # fmt: skip
        assert got == [t for u in uids for t in model_tokens[u]], (s["harness"], s, uids)
        checked.add(s["harness"])
    return checked


@pytest.fixture(scope="module")
def harness_python():
    """The harnesses' environment, installed if missing (scripts/install_harnesses.sh)."""
    subprocess.run(["bash", "scripts/install_harnesses.sh"], cwd=REPO, check=True,
                   timeout=900)  # fmt: skip
    return VENV_PYTHON


@pytest.mark.timeout(900)
def test_every_harness_drives_sessions_that_train_exactly_what_it_got_back(
    tmp_path, harness_python
):
    from examples.harnesses.harness_agents import HARNESSES

    run_dir, transcripts = tmp_path / "run", tmp_path / "harnesses.jsonl"
    run = Run.start(run_dir, "data.task=tool_lookup", "data.agent=external",
                    "rollout.response_length=12", "data.max_prompt_length=4096",
                    "trainer.total_steps=6", "actor.ppo_mini_batch_size=4",
                    "async_training.trigger_parameter_sync_step=1",
                    "rollout.record_sent_groups=true", rollout_ranks=1, train_ranks=1)  # fmt: skip
    driver = subprocess.Popen(
        [str(harness_python), "examples/harnesses/run_harnesses.py", str(run_dir), "--local",
         "--transcripts", str(transcripts), "--wait-s", "60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        proc = run.finish()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = driver.communicate(timeout=HANG_S)[0]
    finally:
        driver.kill()
    assert driver.returncode == 0, out
    sessions = [json.loads(line) for line in transcripts.open()]
    by_harness = defaultdict(list)
    for s in sessions:
        by_harness[s["harness"]].append(s)
    assert set(by_harness) == set(HARNESSES), (sorted(by_harness), out)
    for name, rows in by_harness.items():
        statuses = {c["status"] for s in rows for c in s["calls"]}
        assert statuses == {200}, (name, statuses)
        assert all(s["error"] is None for s in rows), (name, [s["error"] for s in rows])
    trained = check_audit(run_dir, sync_every=1, max_staleness=1 << 30)
    dropped = [r for r in read_jsonl(run_dir / "dropped_samples.jsonl") if r["reason"] != "stale"]
    assert not dropped, dropped
    checked = check_trained_tokens(sessions, trained, run_dir)
    assert set(checked) == set(HARNESSES), checked


@pytest.mark.timeout(900)
def test_harness_sessions_stopped_in_flight_resume_and_train_once(tmp_path, harness_python):
    """Two harnesses (LiteLLM, the ``anthropic`` SDK) through a stop signal and a resume:
    the calls in flight at the stop get 503 and nothing else fails; after the resume a new
    set of agents runs the cut sessions again, answered from the checkpoint's recordings
    while they are the same; every session is trained once or dropped once, and each
    trained session's rows are the tokens its harness got back in the attempt that
    finished it."""
    from hpc_asyncppo.rollout.gateway.addresses import read_addresses

    run_dir, transcripts = tmp_path / "run", tmp_path / "harnesses.jsonl"

    def agents() -> subprocess.Popen:
        return subprocess.Popen(
            [str(harness_python), "examples/harnesses/run_harnesses.py", str(run_dir),
             "--local", "--transcripts", str(transcripts), "--wait-s", "60",
             "--harnesses", "litellm", "anthropic"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    run = Run.start(run_dir, "data.task=tool_lookup", "data.agent=external",
                    "rollout.response_length=12", "trainer.total_steps=100000",
                    "actor.ppo_mini_batch_size=4", "async_training.partial_rollout=true",
                    "async_training.trigger_parameter_sync_step=1",
                    "rollout.record_sent_groups=true", rollout_ranks=1, train_ranks=1)  # fmt: skip
    first = agents()
    try:
        run.wait_for_step(3)
        run.stop()
        before = {row["port"] for row in read_addresses(run_dir)}
        first.communicate(timeout=HANG_S)  # the ranks are done: it ends
        stopped = run.steps_done()
        run.resume(f"trainer.total_steps={stopped + 3}")
        run.wait_until(lambda: read_addresses(run_dir) and not
                       {row["port"] for row in read_addresses(run_dir)} & before,
                       "the resumed gateway")  # fmt: skip
        second = agents()
        proc = run.finish()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = second.communicate(timeout=HANG_S)[0]
    finally:
        first.kill()
        run.end()
    assert "sessions ended per harness" in out, out
    sessions = [json.loads(line) for line in transcripts.open()]
    assert {s["harness"] for s in sessions} == {"litellm", "anthropic"}
    statuses = {c["status"] for s in sessions for c in s["calls"]}
    assert statuses <= {200, 503}, statuses  # 503: the calls the stop found in flight
    trained = check_audit(run_dir, sync_every=1, max_staleness=1 << 30, partial=True)
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    assert not [r for r in dropped if r["reason"] != "stale"], dropped
    uids = [r["uid"] for r in trained] + [r["uid"] for r in dropped]
    assert len(uids) == len(set(uids)), "a session trained or dropped twice"
    assert check_trained_tokens(sessions, trained, run_dir) == {"litellm", "anthropic"}
