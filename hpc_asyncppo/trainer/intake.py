"""The trainer leader's sample intake: from groups arriving to the batch a step trains on.

One object owns everything between the rollout ranks and the update: the queue of groups
received and not yet trained (``SpillQueue``), the credits (``CreditController``: flow and
staleness control), the data order (``PromptOrder``: each credit goes out with the prompt
it is for) and how many cut groups each rollout rank holds from a checkpoint. Every credit
change happens here, at the event that causes it:

- ``receive``: a group arrived (its credit leaves flight, it is queued);
- ``grant``: new credits, each with the next prompt of the data order;
- ``take``: the next batch; on the way stale groups and, with dynamic sampling, groups
  with equal rewards are dropped and their budget refunded, so that they are refilled;
  a stop signal puts every group taken back at the front, as if never taken;
- ``put_back``: the last batch, whose update was abandoned, goes back in front;
- ``synced``: a new weight version restarts the budget;
- ``collect_parts``: a checkpoint's rollout reports; unused credits are void and their
  prompts go back to the data order;
- ``drain``: the end of the run, every group still queued leaves as dropped.

It reaches the rollout ranks only through ``RolloutLink`` (``SampleReceiver`` in a run),
so a unit test drives it in one process. It decides, the leader records: the groups it
drops are returned for the leader's sample log.

``state_dict()`` is the leader's checkpoint part (the ``intake`` state: the queue, the data
order, the cut groups per rank); ``load_state_dict`` restores it onto any number of
rollout ranks. The credits keep the count of groups trained in the manifest (their own
``credits`` state).

Memory: the queue's in-memory part (at most ``buffer.memory_limit_mb``; the rest spills to
RUN_DIR's overflow file) and the encoded groups of the batch being taken.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import CheckpointError
from hpc_asyncppo.config import Config
from hpc_asyncppo.tasks.order import PromptOrder
from hpc_asyncppo.trainer import advantages
from hpc_asyncppo.trainer.credits import CreditController
from hpc_asyncppo.trainer.queue import SpillQueue
from hpc_asyncppo.transport.arrays import unpack_arrays
from hpc_asyncppo.transport.samples import Control, SampleGroup, decode_group
from hpc_asyncppo.transport.waits import PeerTimeout, poll_until

log = logging.getLogger(__name__)


class RolloutLink(Protocol):
    """What the intake needs of the rollout ranks: their groups and checkpoint reports in,
    credits out. ``received_from[r]``: groups received from rank r so far."""

    received_from: list[int]

    def poll(self) -> list[np.ndarray]: ...

    def poll_states(self) -> dict[int, np.ndarray]: ...

    def send_control(
        self, rank: int, kind: Control, value: int = 0, extra: list[int] | None = None
    ) -> None: ...


def staleness_of(group: SampleGroup, version: int) -> int:
    """Versions between the weights that started generating the group and the trainer's now."""
    return version - group.param_version_start


def refills_per_step(cfg: Config) -> float:
    """Groups dynamic sampling may drop (and have refilled) while collecting one step:
    0 when it is off; with max_num_gen_batches = m > 0, (m - 1) * required_groups, so
    that a step takes at most m batches' worth of generated groups (verl's count of
    generation batches). Differs from verl: past the bound verl raises; here the step
    trains on the zero-variance groups it gets (their GRPO advantage is 0) and warns."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return 0
    if fg.max_num_gen_batches == 0:
        return math.inf
    return (fg.max_num_gen_batches - 1) * cfg.required_groups


@dataclass
class Batch:
    """A step's groups, oldest first, and what was decided while taking them."""

    groups: list[SampleGroup]
    dropped: list[tuple[SampleGroup, str]] = field(default_factory=list)  # "stale", "filtered"
    filtered: int = 0  # groups dynamic sampling dropped (and had refilled)
    flat_kept: int = 0  # zero-variance groups kept: the step's refills were spent


class Intake:
    def __init__(
        self,
        cfg: Config,
        link: RolloutLink,
        queue: SpillQueue,
        num_prompts: int,
        rollout_ranks: int,
        on_group: Callable[[SampleGroup], None] | None = None,
    ):
        """``on_group``: called with each group as it arrives (the leader reads the rollout
        ranks' own counters from it)."""
        self.cfg, self.link, self.queue = cfg, link, queue
        self.credits = CreditController(
            rollout_ranks, cfg.max_required_groups, cfg.trainer.total_steps * cfg.required_groups
        )
        self.order = PromptOrder(num_prompts, cfg.trainer.seed)
        self.partial_groups = [0] * rollout_ranks  # cut groups each rank holds (checkpoint)
        self.on_group = on_group
        self.last_taken: list[np.ndarray] = []  # the last batch, encoded, to put back

    @property
    def groups_trained(self) -> int:
        return self.credits.trained

    def __len__(self) -> int:
        return len(self.queue)

    # --- the rollout ranks' side --------------------------------------------------------
    def receive(self) -> None:
        """Take every group that has arrived into the queue."""
        for buf in self.link.poll():
            group = decode_group(buf)
            self.credits.received(group.rollout_rank)
            self.queue.push(buf)
            if self.on_group is not None:
                self.on_group(group)

    def grant(self) -> None:
        """New credits, each with the next prompt of the data order."""
        for rank, count in enumerate(self.credits.grant()):
            if count:
                draws = [self.order.take() for _ in range(count)]
                self.link.send_control(rank, Control.CREDIT, count, draws)

    def synced(self) -> None:
        """A new weight version went out: the staleness budget restarts."""
        self.credits.synced()

    # --- the trainer's side -------------------------------------------------------------
    def take(
        self,
        version: int | Callable[[], int],
        stopped: Callable[[], object],
        timeout_s: float,
        step: int,
        tick: Callable[[], None] = lambda: None,
    ) -> Batch | None:
        """The next ``required_groups`` groups within the staleness bound of ``version``
        (and, with dynamic sampling, with a learning signal), oldest first; None if
        ``stopped()`` turned true first: then every group taken goes back to the front of
        the queue (those it would have dropped included, to be judged again after a
        resume), so that the checkpoint holds them and nothing of the step is kept.

        Receives and grants while it waits (``tick`` runs at each poll: the leader's other
        inboxes; ``version`` may be a callable, when a tick can send weights); raises PeerTimeout after ``timeout_s`` without a whole batch (``step``:
        the step it is for, in that message)."""
        cfg = self.cfg
        required = cfg.required_groups
        refills = refills_per_step(cfg)
        taken = Batch([])
        popped: list[np.ndarray] = []  # every group taken, encoded: put back on a stop
        kept: list[np.ndarray] = []

        def ready() -> bool:
            if stopped():
                return True
            self.receive()
            tick()
            self.grant()
            while len(self.queue) and len(taken.groups) < required:
                buf = self.queue.pop()
                popped.append(buf)
                group = decode_group(buf)
                flat = not advantages.has_signal(cfg, group)
                # A drop leaves the credit count at once (it is no longer queued) and
                # gives its budget back, so that its refill is granted before the next sync
                # (with in-flight weight updates groups granted after a sync may start
                # under the old weights: at max_staleness 0 their drops would otherwise
                # use up the window). It is recorded once the batch is whole.
                newest = version() if callable(version) else version
                if group.dropped:  # the sender's reason (an agent's session failed)
                    self._dropped(taken, group, group.dropped)
                elif staleness_of(group, newest) > cfg.async_training.max_staleness:
                    self._dropped(taken, group, "stale")
                elif flat and taken.filtered < refills:
                    self._dropped(taken, group, "filtered")
                    taken.filtered += 1
                else:
                    taken.flat_kept += flat
                    taken.groups.append(group)
                    kept.append(buf)
            return len(taken.groups) == required

        try:
            poll_until(ready, timeout_s, "samples from the rollout ranks")
        except PeerTimeout as exc:
            filtered = (
                f"; {taken.filtered} groups with equal rewards dropped by dynamic sampling "
                "(algorithm.filter_groups; max_num_gen_batches bounds them)"
                if taken.filtered
                else ""
            )
            reasons = [r for _, r in taken.dropped if r not in ("stale", "filtered")]
            senders = (
                f"; {len(reasons)} of the groups taken for it dropped by their rollout ranks, "
                f"the last because {reasons[-1]}"
                if reasons
                else ""
            )
            raise PeerTimeout(
                f"{exc} (step {step}; have {len(taken.groups)}/{required} groups; "
                f"groups received per rollout rank: {self.link.received_from}{filtered}"
                f"{senders})"
            ) from None
        if stopped():
            self.credits.queued += len(taken.dropped)  # back in the queue, with the rest
            self.queue.push_front(popped)
            return None
        if taken.flat_kept:
            log.warning(
                "step %d: %d groups with equal rewards trained on, the step's %d refills "
                "(algorithm.filter_groups.max_num_gen_batches) being spent",
                step,
                taken.flat_kept,
                refills,
            )
        self.credits.consumed(trained=len(taken.groups), dropped=0)
        self.last_taken = kept
        return taken

    def _dropped(self, taken: Batch, group: SampleGroup, reason: str) -> None:
        self.credits.consumed(trained=0, dropped=1)
        self.credits.refund(1)
        taken.dropped.append((group, reason))

    def put_back(self) -> None:
        """The last batch taken, whose update was abandoned, returns to the front of the
        queue as if never taken (its drops stay: they were decided and recorded)."""
        self.queue.push_front(self.last_taken)
        self.credits.consumed(trained=-len(self.last_taken), dropped=0)
        self.last_taken = []

    def drain(self) -> Iterator[SampleGroup]:
        """The end of the run: every group still queued, oldest first, leaves as dropped."""
        while len(self.queue):
            group = decode_group(self.queue.pop())
            self.credits.consumed(trained=0, dropped=1)
            yield group

    # --- checkpoints --------------------------------------------------------------------
    def collect_parts(
        self, timeout_s: float, tick: Callable[[], None] = lambda: None
    ) -> list[tuple[str, dict]]:
        """Every rollout rank's checkpoint report, once every group it sent before it is in
        the queue. Their unused credits are void afterwards (granted anew by the next
        ``take``), and the prompts they were for go back to the data order, to go out
        first; the groups they cut and keep in their part stay in flight."""
        reports: dict[int, dict] = {}
        unused: list[int] = []

        def ready() -> bool:
            self.receive()
            tick()
            for rank, buf in self.link.poll_states().items():
                arrays, reports[rank] = unpack_arrays(buf)
                unused.extend(int(d) for d in arrays["unused"])
                self.partial_groups[rank] = int(reports[rank]["partial_groups"])
            return len(reports) == len(self.partial_groups) and all(
                self.link.received_from[r] == report["groups_sent"] for r, report in reports.items()
            )

        poll_until(ready, timeout_s, "rollout ranks' checkpoint parts")
        self.credits.revoke_unused(kept=self.partial_groups)
        self.order.give_back(unused)
        return [(f"rollout rank {r}", reports[r]) for r in sorted(reports)]

    def state_dict(self) -> dict:
        """The leader's checkpoint part (``protocol.LEADER_PART``): every queued group,
        encoded (the in-memory part and what spilled to the overflow file, read back), the
        data order's three numbers and returned draws, the cut groups per rollout rank."""
        return {
            **self.queue.state_dict(),
            "order": self.order.state_dict(),
            # per rollout rank: groups cut and kept in its part, continued after resume
            "partial_groups": np.asarray(self.partial_groups, dtype=np.int64),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore onto this run's rollout ranks, however many: the cut groups of old rank
        o are continued by rank ``protocol.continuing_rank(o, R)``."""
        if "order" not in state:
            raise CheckpointError(
                "the leader part has no data order (written before the trainer leader owned "
                "it): start a new run"
            )
        self.queue.load_state_dict(state)
        self.order.load_state_dict(state["order"])
        ranks = len(self.partial_groups)
        kept = [0] * ranks
        for old, count in enumerate(np.asarray(state["partial_groups"]).tolist()):
            kept[protocol.continuing_rank(old, ranks)] += count
        self.partial_groups = kept
        self.credits.resume(queued=len(self.queue), in_flight=kept)
