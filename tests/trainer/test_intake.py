"""The trainer leader's intake, driven in one process: a fake rollout side turns each credit
into a group, and every test checks the credit accounting after each event (grants,
receipts, stale drops, filtered drops with refills, a stop with put-back, a checkpoint and
its restore onto fewer rollout ranks). The queue, credits and data order are the real ones;
only MPI is replaced (``RolloutLink``)."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from hpc_asyncppo.config import load_config
from hpc_asyncppo.tasks.order import PromptOrder
from hpc_asyncppo.trainer.intake import Intake
from hpc_asyncppo.trainer.queue import SpillQueue
from hpc_asyncppo.transport.arrays import pack_arrays
from hpc_asyncppo.transport.samples import Control, SampleGroup, decode_group, encode_group
from hpc_asyncppo.transport.waits import PeerTimeout

PROMPTS = 50
SEED = 3


class FakeRollout:
    """Rollout ranks that generate a group for each credit when told to (``generate``);
    the groups then wait 'on the wire' until the intake polls."""

    def __init__(self, ranks: int):
        self.received_from = [0] * ranks
        self.sent = [0] * ranks
        self.held: list[deque[int]] = [deque() for _ in range(ranks)]  # credits' draws
        self.granted: list[int] = []  # every draw handed out, in order
        self.wire: list[tuple[int, np.ndarray]] = []
        self.states: dict[int, np.ndarray] = {}
        self.version = 0
        self.rewards: deque[tuple[float, ...]] = deque()  # the next groups' rewards
        self.draw_of: dict[str, int] = {}  # a group's first uid -> its draw

    # RolloutLink
    def send_control(self, rank, kind, value=0, extra=None):
        assert kind == Control.CREDIT and value == len(extra)
        self.held[rank].extend(extra)
        self.granted.extend(extra)

    def poll(self):
        out = []
        for rank, buf in self.wire:
            self.received_from[rank] += 1
            out.append(buf)
        self.wire = []
        return out

    def poll_states(self):
        states, self.states = self.states, {}
        return states

    # the rollout side's work
    def generate(self) -> None:
        """Every credit held becomes a group, at the current version."""
        for rank, held in enumerate(self.held):
            while held:
                draw = held.popleft()
                rewards = self.rewards.popleft() if self.rewards else (0.0, 1.0)
                group = make_group(rank, draw, self.version, rewards)
                self.draw_of[group.uid(0)] = draw
                self.wire.append((rank, encode_group(group)))
                self.sent[rank] += 1

    def checkpoint(self, cut: dict[int, int]) -> None:
        """Each rank reports: ``cut[rank]`` credits' groups cut and kept, the rest unused."""
        for rank, held in enumerate(self.held):
            keep = cut.get(rank, 0)
            unused = list(held)[keep:]
            self.held[rank] = deque(list(held)[:keep])
            report = {"partial_groups": keep, "groups_sent": self.sent[rank]}
            self.states[rank] = pack_arrays({"unused": np.asarray(unused, np.int64)}, report)


def make_group(rank: int, draw: int, version: int, rewards: tuple[float, ...]) -> SampleGroup:
    n = len(rewards)
    epoch, index = divmod(draw, PROMPTS)
    return SampleGroup(
        seed=SEED, epoch=epoch, prompt_index=index, rollout_rank=rank,
        param_version_start=version, param_version_end=version,
        prompt_ids=np.array([5, 6], np.int32), response_ids=np.ones((n, 3), np.int32),
        response_lengths=np.full(n, 3, np.int32), rollout_log_probs=np.zeros((n, 3), np.float32),
        rewards=np.asarray(rewards, np.float32),
    )  # fmt: skip


def config(*overrides: str):
    base = ["actor.ppo_mini_batch_size=2", "async_training.staleness_threshold=0.5",
            "async_training.trigger_parameter_sync_step=1", "trainer.total_steps=10",
            f"trainer.seed={SEED}"]  # fmt: skip
    return load_config(overrides=base + list(overrides))


def make_intake(tmp_path, ranks: int, *overrides: str, name: str = "q"):
    cfg = config(*overrides)
    link = FakeRollout(ranks)
    queue = SpillQueue(tmp_path / f"{name}.h5", 1.0)
    return Intake(cfg, link, queue, PROMPTS, ranks), link


def take(intake: Intake, link: FakeRollout, version: int = 0, stopped=lambda: None):
    return intake.take(version, stopped, timeout_s=5, step=1, tick=link.generate)


def check_accounting(intake: Intake, link: FakeRollout) -> None:
    """The credits say what the queue and the rollout side hold."""
    credits = intake.credits
    assert credits.queued == len(intake.queue)
    on_wire = [sum(r == rank for r, _ in link.wire) for rank in range(len(link.held))]
    assert credits.in_flight == [len(h) + w for h, w in zip(link.held, on_wire, strict=True)]
    assert credits.used <= credits.max_outstanding


def draws(link: FakeRollout, groups: list[SampleGroup]) -> list[int]:
    return [link.draw_of[g.uid(0)] for g in groups]


def first_draws(count: int) -> list[int]:
    order = PromptOrder(PROMPTS, SEED)
    return [order.take() for _ in range(count)]


# --- grants and receipts -----------------------------------------------------------------


def test_a_batch_is_the_oldest_groups_and_each_credit_carries_the_next_prompt(tmp_path):
    intake, link = make_intake(tmp_path, ranks=2)
    intake.grant()
    assert intake.credits.in_flight == [2, 1]  # the budget (3), spread evenly
    assert link.granted == first_draws(3)  # the data order, whichever rank gets them
    check_accounting(intake, link)
    batch = take(intake, link)
    assert [g.rollout_rank for g in batch.groups] == [0, 0]  # received in order
    assert draws(link, batch.groups) == first_draws(2)
    assert batch.dropped == [] and intake.groups_trained == 2
    assert len(intake) == 1  # the third, received while waiting
    check_accounting(intake, link)
    # no sync yet: the budget is spent, so no new credit until one
    intake.grant()
    assert link.granted == first_draws(3)
    intake.synced()
    intake.grant()
    assert link.granted == first_draws(5)  # the budget restarts from what is outstanding
    check_accounting(intake, link)


def test_a_group_without_a_credit_is_refused(tmp_path):
    intake, link = make_intake(tmp_path, ranks=1)
    link.wire.append((0, encode_group(make_group(0, 0, 0, (0.0, 1.0)))))
    with pytest.raises(RuntimeError, match="no credit"):
        intake.receive()


def test_a_timeout_names_the_step_and_what_each_rank_sent(tmp_path):
    intake, link = make_intake(tmp_path, ranks=2)
    with pytest.raises(PeerTimeout, match=r"step 1; have 0/2 groups; .*\[0, 0\]"):
        intake.take(0, lambda: None, timeout_s=0.05, step=1)  # the ranks never generate


def test_a_timeout_with_every_group_dropped_by_its_sender_says_why(tmp_path):
    """An agent that fails every session: the groups arrive, each dropped by its rollout
    rank with the reason; the timeout says so, not only how many came."""
    intake, link = make_intake(tmp_path, ranks=1)
    intake.grant()
    for draw in list(link.held[0]):
        group = make_group(0, draw, 0, (0.0, 1.0))
        group.dropped = "agent failed: session s3-p1-r0: its agent raised KeyError: 'x'"
        link.wire.append((0, encode_group(group)))
    link.held[0].clear()
    with pytest.raises(PeerTimeout, match=r"3 of the groups taken for it dropped by their "
                       r"rollout ranks, the last because agent failed: .*KeyError"):  # fmt: skip
        intake.take(0, lambda: None, timeout_s=0.05, step=1)


# --- drops ---------------------------------------------------------------------------------


def test_stale_groups_are_dropped_and_refilled_at_the_new_version(tmp_path):
    intake, link = make_intake(tmp_path, 2, "async_training.max_staleness=1")
    intake.grant()
    link.generate()
    intake.receive()  # three groups of version 0 wait
    check_accounting(intake, link)
    intake.synced()  # two syncs later they are two versions old
    link.version = 2
    batch = take(intake, link, version=2)
    assert [reason for _, reason in batch.dropped] == ["stale"] * 3
    assert [g.param_version_start for g in batch.groups] == [2, 2]
    # the dropped prompts are not handed out again; their refills take the next ones
    assert draws(link, batch.groups) == first_draws(5)[3:5]
    assert intake.groups_trained == 2
    check_accounting(intake, link)


def test_equal_reward_groups_are_dropped_and_refilled_up_to_the_bound(tmp_path):
    intake, link = make_intake(
        tmp_path, 1,
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=2",  # refills: (2 - 1) * 2 groups
        "async_training.staleness_threshold=2",  # budget 6: room for the refills
    )  # fmt: skip
    link.rewards.extend([(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 1.0), (1.0, 0.0)])
    batch = take(intake, link)
    assert [reason for _, reason in batch.dropped] == ["filtered", "filtered"]
    assert batch.filtered == 2 and batch.flat_kept == 1  # the third flat group is trained on
    assert [tuple(g.rewards) for g in batch.groups] == [(0.0, 1.0), (1.0, 1.0)]
    assert intake.groups_trained == 2
    check_accounting(intake, link)
    # the refunds let the step's refills out before any sync: budget 6, 5 generated
    assert len(link.granted) == 6


def test_with_one_generation_batch_per_step_flat_groups_are_trained_and_counted(tmp_path):
    """max_num_gen_batches=1: no refills, so a step trains on the flat groups it gets
    (counted for the metrics and the warning), and nothing is dropped."""
    intake, link = make_intake(
        tmp_path, 1,
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
    )  # fmt: skip
    link.rewards.extend([(1.0, 1.0), (0.0, 1.0), (0.0, 0.0)])
    batch = take(intake, link)
    assert batch.dropped == [] and batch.filtered == 0 and batch.flat_kept == 1
    assert [tuple(g.rewards) for g in batch.groups] == [(1.0, 1.0), (0.0, 1.0)]
    check_accounting(intake, link)


# --- stops, put-back -------------------------------------------------------------------------


def test_a_stop_while_taking_puts_every_taken_group_back_in_order(tmp_path):
    intake, link = make_intake(tmp_path, 1, "async_training.max_staleness=0")
    intake.grant()
    link.generate()
    intake.receive()
    before = [g.uid(0) for g in map(decode_group, intake.queue.snapshot())]
    link.version = 1  # the first groups are stale at version 1, the next ones would be fresh
    calls = iter([None, "SIGUSR1"])  # the stop arrives after one round of taking
    assert intake.take(1, lambda: next(calls, "SIGUSR1"), 5, 1, tick=link.generate) is None
    after = [g.uid(0) for g in map(decode_group, intake.queue.snapshot())]
    assert after[: len(before)] == before  # the dropped ones too, to be judged again
    assert intake.groups_trained == 0
    check_accounting(intake, link)


def test_an_abandoned_update_gives_its_batch_back_as_if_never_taken(tmp_path):
    intake, link = make_intake(tmp_path, 2)
    batch = take(intake, link)
    intake.put_back()
    assert intake.groups_trained == 0
    check_accounting(intake, link)
    again = take(intake, link)
    assert [g.uid(0) for g in again.groups] == [g.uid(0) for g in batch.groups]
    assert intake.groups_trained == 2
    check_accounting(intake, link)


def test_the_end_of_the_run_drains_the_queue_as_dropped(tmp_path):
    intake, link = make_intake(tmp_path, 2)
    take(intake, link)
    left = list(intake.drain())
    assert len(left) == 1 and len(intake) == 0 and intake.credits.queued == 0
    assert intake.groups_trained == 2


# --- checkpoints ------------------------------------------------------------------------------


def test_a_checkpoint_restores_onto_one_rollout_rank_with_nothing_lost(tmp_path):
    intake, link = make_intake(tmp_path, 3, "async_training.staleness_threshold=3")  # budget 8
    batch = take(intake, link)
    intake.synced()
    intake.grant()  # credits held, not yet generated
    held = [list(h) for h in link.held]
    assert [len(h) for h in held] == [1, 1, 0]
    link.checkpoint(cut={1: 1})  # rank 1 cut one group and keeps it; the rest go unused
    reports = intake.collect_parts(timeout_s=5)
    assert [who for who, _ in reports] == ["rollout rank 0", "rollout rank 1", "rollout rank 2"]
    assert intake.credits.in_flight == [0, 1, 0]
    state = intake.state_dict()
    queued = [decode_group(b).uid(0) for b in state["queue"]]

    restored, link2 = make_intake(tmp_path, 1, "async_training.staleness_threshold=3", name="r")
    restored.credits.load_state_dict(intake.credits.state_dict())  # the manifest's count
    restored.load_state_dict(state)
    assert restored.groups_trained == intake.groups_trained == len(batch.groups)
    assert [decode_group(b).uid(0) for b in restored.queue.snapshot()] == queued
    assert restored.partial_groups == [1]  # old rank 1 continues on rank 1 mod 1 = 0
    assert restored.credits.in_flight == [1] and restored.credits.queued == len(queued)
    # the unused credits' prompts go out first, in the data order: none skipped or repeated
    unused = sorted((d for h in held for d in h), key=first_draws(20).index)
    unused.remove(held[1][0])  # the cut group's prompt stays with its group
    restored.grant()
    assert link2.granted[: len(unused)] == unused
    handed_out = set(link.granted) - set(unused)
    assert not handed_out & set(link2.granted)
