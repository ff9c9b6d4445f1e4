"""A rollout rank's part of validation: its share of the ``data.val`` prompts, generated and
scored with the weights it holds, the per-prompt rewards sent to the trainer leader.

The leader asks (VALIDATE, with the step) right after the weights it wants validated have
reached the rollout ranks. Rollout rank r of R takes the val prompts r, r + R, ... and
generates ``rollout.val_n`` responses to each at ``rollout.val_temperature`` (0: greedy),
through the same engine as the training groups and between its steps, at most
``rollout.prompts_per_generate`` val groups in flight beside them. The responses are scored
with the task's reward and sent as one small message (``result_message``): they never
reach the sample sender, the credits or the sent-groups record, so the trainer's queue and
its staleness audit know nothing of them.

With ``data.agent`` the val groups are sessions (``gateway/sessions.py``): ``val_n`` per
prompt, at ``rollout.val_temperature``, run by the run's agents as training sessions are
(named ``val-s{step}-p{index}-r{j}``), and scored with the rewards the agents give; a
session that fails scores 0 (its reason in the rank's log).

Every response of one validation comes from one weights version, the one the leader
announced before asking: a weight sync (or the stop) that arrives while a validation is
under way waits for it to end (``finish``). An engine that died and restarted meanwhile
runs the validation once those weights are back; when they are not coming back (the leader
trained past them, or the run ended first) the validation is void: the rank says so
(``void`` in the result's meta) instead of scoring other weights under their version.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from hpc_asyncppo.config import Config
from hpc_asyncppo.rollout.engine import RolloutEngine
from hpc_asyncppo.rollout.gateway.sessions import Sessions
from hpc_asyncppo.rollout.generation import Generation
from hpc_asyncppo.rollout.turns import Turns
from hpc_asyncppo.tasks import Prompt, load_val_task, tokenize_prompt
from hpc_asyncppo.transport.arrays import pack_arrays
from hpc_asyncppo.transport.samples import SampleSender

log = logging.getLogger(__name__)
VAL_KEY = "val"  # engine keys of val groups: ("val", job id, position in this rank's share)


@dataclass
class ValidationJob:
    id: int
    step: int
    version: int  # the weights it validates
    pending: deque[int]  # positions in the share not yet submitted
    rewards: dict[int, np.ndarray] = field(default_factory=dict)  # position -> (val_n,)
    in_flight: int = 0
    void: bool = False  # its weights are gone: nothing is scored, the leader is told

    @property
    def done(self) -> bool:
        return not self.pending and self.in_flight == 0


def result_message(
    step: int,
    version: int,
    rank: int,
    prompts: list[Prompt],
    rewards: np.ndarray,
    skipped: int,
    void: bool = False,
) -> np.ndarray:
    """One rank's validation result: ``rewards`` (P, val_n) of its ``prompts`` in order, their
    indices in data.val and their data_source (as indices into ``meta["sources"]``).
    ``void``: the rank could not validate those weights (no prompts, no rewards)."""
    sources = sorted({p.data_source for p in prompts})
    arrays = {
        "rewards": rewards.astype(np.float32).reshape(len(prompts), rewards.shape[-1]),
        "prompt_index": np.array([p.index for p in prompts], dtype=np.int32),
        "source": np.array([sources.index(p.data_source) for p in prompts], dtype=np.int32),
    }
    meta = {"step": step, "version": version, "rank": rank, "sources": sources, "skipped": skipped}
    if void:
        meta["void"] = True
    return pack_arrays(arrays, meta)


class Validator:
    """This rank's val prompts (tokenized once) and the validations asked for, oldest first."""

    def __init__(
        self,
        cfg: Config,
        rank: int,
        ranks: int,
        engine: RolloutEngine,
        sender: SampleSender,
        turns: Turns | None = None,
        sessions: Sessions | None = None,
    ):
        """``turns``: multi-turn, the rank's trajectories (val groups call tools too, and
        their tools' rewards add to the task's). ``sessions``: data.agent, the rank's
        sessions (val groups are sessions its agents run and score)."""
        self.cfg, self.rank, self.engine, self.sender = cfg, rank, engine, sender
        self.turns, self.sessions = turns, sessions
        self.jobs: deque[ValidationJob] = deque()
        self.requested = 0
        self.prompts: list[Prompt] = []
        self.ids: list[list[int]] = []
        self.skipped = 0  # prompts of this share longer than data.max_prompt_length
        if not cfg.data.val:
            return
        self.task = load_val_task(cfg.data)
        for prompt in list(self.task.prompts())[rank::ranks]:
            schemas = [t.schema for t in turns.tools.values()] if turns else None
            ids = tokenize_prompt(engine.tokenizer, prompt, schemas)
            if len(ids) > cfg.data.max_prompt_length:
                self.skipped += 1
                continue
            self.prompts.append(prompt)
            self.ids.append(ids)
        if self.skipped:
            log.warning(
                "rank %d: %d data.val prompts are longer than data.max_prompt_length=%d and "
                "are not validated",
                rank,
                self.skipped,
                cfg.data.max_prompt_length,
            )

    @property
    def in_flight(self) -> int:
        return sum(job.in_flight for job in self.jobs)

    def request(self, step: int, version: int) -> None:
        self.requested += 1
        positions = deque(range(len(self.prompts)))
        self.jobs.append(ValidationJob(self.requested, step, version, positions))
        self._send_done()  # an empty share answers at once

    @staticmethod
    def owns(key: Hashable) -> bool:
        return isinstance(key, tuple) and len(key) == 3 and key[0] == VAL_KEY

    def top_up(self, version: int) -> None:
        """Submit val groups of the validations of ``version`` (the weights the engine
        holds), oldest first, up to prompts_per_generate in flight. A validation of older
        weights can no longer run (its engine restarted and got newer ones): void."""
        if not self.jobs:
            return
        for job in list(self.jobs):
            if job.version < version:
                self.void(
                    job, f"the weights of v{job.version} are gone (the engine has v{version})"
                )
        room = self.cfg.rollout.prompts_per_generate - self.in_flight
        for job in self.jobs:
            while room > 0 and job.pending and job.version == version:
                position = job.pending.popleft()
                key = (VAL_KEY, job.id, position)
                rollout = self.cfg.rollout
                if self.sessions is not None:  # the agents' first calls bring the prompt
                    prompt = self.prompts[position]
                    self.sessions.open_group(key, f"val-s{job.step}-p{prompt.index}", prompt,
                                             rollout.val_n, temperature=rollout.val_temperature)  # fmt: skip
                else:
                    self.engine.submit(key, self.ids[position], rollout.val_n,
                                       rollout.val_temperature)  # fmt: skip
                job.in_flight += 1
                room -= 1

    def finished(self, key: tuple, gen: Generation) -> None:
        """Score one val group; send the validation's result once its last group is in."""
        _, job_id, position = key
        job = next(j for j in self.jobs if j.id == job_id)
        prompt = self.prompts[position]
        n = gen.response_ids.shape[0]
        if self.sessions is not None:  # the agents' rewards
            given, failed, _, _ = self.sessions.finish(key)
            rewards = np.asarray(given, dtype=np.float32)
            if failed:
                log.warning("rank %d: a val group of step %d scores 0 for its failed sessions "
                            "(%s)", self.rank, job.step, failed)  # fmt: skip
        else:
            rewards = np.array(
                [
                    self.task.reward(
                        prompt, self.engine.decode(gen.response_ids[j, : gen.response_lengths[j]])
                    )
                    for j in range(n)
                ],
                dtype=np.float32,
            )
        if self.turns is not None:
            rewards += np.asarray(self.turns.finish(key, n), dtype=np.float32)
        job.rewards[position] = rewards
        job.in_flight -= 1
        self._send_done()

    def again(self, key: tuple) -> None:
        """A val group lost with its engine (restarted): it starts again from its prompt."""
        _, job_id, position = key
        job = next(j for j in self.jobs if j.id == job_id)
        job.in_flight -= 1
        if self.sessions is not None:
            self.sessions.forget(key, "its engine restarted: the validation runs it again")
        if job.void:
            self._send_done()
        else:
            job.pending.appendleft(position)

    def finish(
        self, step_engine: Callable[[], None], stop: Callable[[], bool], version: int | None
    ) -> None:
        """Run every validation asked for to its end (``step_engine``: one engine step whose
        finished groups reach ``finished``, training groups going their own way), unless
        ``stop()`` turns true first. ``version``: the weights the engine holds, None after
        a restart until they are back; the validations of other weights are void (no
        weights come before these end: the next sync, or none after STOP)."""
        for job in list(self.jobs):
            if job.version != version:
                held = "none since its restart" if version is None else f"v{version}"
                self.void(job, f"the weights of v{job.version} did not come back (it holds {held})")
        while self.jobs and version is not None and not stop():
            self.top_up(version)
            step_engine()

    def void(self, job: ValidationJob, why: str) -> None:
        """``job`` cannot be validated on its weights: nothing more of it runs, and the
        leader is told once its groups still in flight are back."""
        if job.void:
            return
        log.warning("rank %d: the validation of step %d is void: %s", self.rank, job.step, why)
        job.void = True
        job.pending.clear()
        job.rewards.clear()
        self._send_done()

    def _send_done(self) -> None:
        while self.jobs and self.jobs[0].done:
            job = self.jobs.popleft()
            empty = np.zeros((0, self.cfg.rollout.val_n), dtype=np.float32)
            if job.void:
                self.sender.send_validation(
                    result_message(job.step, job.version, self.rank, [], empty, 0, void=True)
                )
                continue
            rewards = np.stack([job.rewards[i] for i in range(len(self.prompts))]) if (
                self.prompts
            ) else empty  # fmt: skip
            self.sender.send_validation(
                result_message(
                    job.step, job.version, self.rank, self.prompts, rewards, self.skipped
                )
            )
            log.info("rank %d: validated step %d (v%d)", self.rank, job.step, job.version)
