"""The trainer ranks other than the leader (the followers): their channel and their loop.

The leader sends each follower one message per order (``Order``): TRAIN with its shard of
the step's batch, SYNC (every rank gathers its shards of the weights, in step), CHECKPOINT
(every rank writes its own part and reports it back) and STOP. A follower does nothing
between two orders, so one tag in each direction suffices; every wait is bounded.
``run_follower`` is a follower's whole life: wait for an order, carry it out.
"""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.config import Config
from hpc_asyncppo.runtime import faults, heartbeat
from hpc_asyncppo.runtime.topology import Topology
from hpc_asyncppo.timeline import Timeline
from hpc_asyncppo.trainer.batch import to_tensors
from hpc_asyncppo.trainer.policy import Policy, ppo_update, trainer_states
from hpc_asyncppo.transport.arrays import pack_arrays, unpack_arrays
from hpc_asyncppo.transport.waits import poll_until

TAG_ORDER = 21
TAG_PART = 22


class Order(Enum):
    TRAIN = "train"  # with the follower's shard of the step's batch
    SYNC = "sync"  # gather the weights with the leader
    CHECKPOINT = "checkpoint"  # write this rank's part of the step's checkpoint, report it
    STOP = "stop"


class Followers:
    """The leader's end: ``comm`` is the trainer ranks' communicator, the leader its rank 0."""

    def __init__(self, comm: MPI.Intracomm, timeout_s: float):
        self.comm, self.timeout_s = comm, timeout_s
        self.count = comm.Get_size() - 1

    def train(self, shards: list[dict[str, np.ndarray]], step: int) -> None:
        """Each follower its shard (``shards[0]`` is follower 1's)."""
        self._send(Order.TRAIN, step, shards)

    def order(self, order: Order, step: int) -> None:
        self._send(order, step, [{}] * self.count)

    def _send(self, order: Order, step: int, shards: list[dict[str, np.ndarray]]) -> None:
        requests = []
        for follower, shard in enumerate(shards, start=1):
            buf = pack_arrays(shard, {"order": order.value, "step": step})
            requests.append((self.comm.Isend([buf, MPI.BYTE], dest=follower, tag=TAG_ORDER), buf))
        poll_until(
            lambda: all(r.Test() for r, _ in requests),
            self.timeout_s,
            "trainer ranks to take their shards",
        )

    def collect_parts(self) -> list[tuple[str, dict]]:
        """Every follower's report of its checkpoint part, in rank order."""
        parts = []
        for follower in range(1, self.count + 1):
            status = MPI.Status()
            poll_until(
                lambda f=follower, st=status: self.comm.Iprobe(source=f, tag=TAG_PART, status=st),
                self.timeout_s,
                f"trainer rank {follower}'s checkpoint part",
            )
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            self.comm.Recv([buf, MPI.BYTE], source=follower, tag=TAG_PART)
            parts.append((f"trainer rank {follower}", unpack_arrays(buf)[1]))
        return parts


def next_order(comm: MPI.Intracomm, timeout_s: float) -> tuple[Order, int, dict]:
    """A follower's next order from the leader: (order, step, shard)."""
    status = MPI.Status()
    poll_until(
        lambda: comm.Iprobe(source=0, tag=TAG_ORDER, status=status),
        timeout_s,
        "a shard from the trainer leader",
    )
    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
    comm.Recv([buf, MPI.BYTE], source=0, tag=TAG_ORDER)
    shard, meta = unpack_arrays(buf)
    return Order(meta["order"]), int(meta["step"]), shard


def report_part(comm: MPI.Intracomm, report: dict, timeout_s: float) -> None:
    """A follower's report of the part it wrote (``protocol.write_own_part``)."""
    buf = pack_arrays({}, report)
    req = comm.Isend([buf, MPI.BYTE], dest=0, tag=TAG_PART)
    poll_until(req.Test, timeout_s, "the trainer leader to take the part")


def run_follower(
    cfg: Config, topo: Topology, run_dir: Path, policy: Policy, timeline: Timeline
) -> None:
    """A non-leader trainer rank: train on each shard the leader sends until told to stop."""
    # The leader may wait for samples, a sync and a checkpoint between two shards.
    timeout = cfg.timeouts.sample_wait_s + cfg.timeouts.weight_sync_s + 2 * cfg.timeouts.rank_wait_s
    while True:
        wait_start = time.time()
        heartbeat.doing("waiting for the trainer leader's next order")
        order, step, shard = next_order(topo.local, timeout)
        heartbeat.doing(f"carrying out the leader's {order.value} order of step {step}")
        timeline.record("wait", wait_start, time.time(), step=step)
        if order is Order.STOP:
            timeline.close()
            return
        if order is Order.SYNC:  # the leader broadcasts; this rank gives its shards of each tensor
            for _ in policy.named_weights():
                pass
            continue
        if order is Order.CHECKPOINT:
            folder = protocol.step_dir(run_dir, step)
            name = protocol.trainer_part(topo.local_rank)
            written = protocol.write_own_part(
                folder, name, protocol.tree_of(trainer_states(policy))
            )
            report_part(topo.local, written, cfg.timeouts.rank_wait_s)
            continue
        faults.at("step", step)  # a drill's named moment (none in a real run)
        train_start = time.time()
        if ppo_update(policy, to_tensors(shard, topo.device)) is None:
            continue  # abandoned by a stop signal, as on the leader: a checkpoint order follows
        timeline.record("train", train_start, time.time(), step=step, phases=policy.phase_seconds)
