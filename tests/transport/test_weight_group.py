"""The weight group stands apart from torch.distributed's default group: a sync completes
while the default group holds a rank that never joins any collective (on a rollout rank the
default group is the whole MPI job; vLLM's own IPC engine blocked there). A generation
replaced is closed, and the next meets on the same store."""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.runlog import weights_digest
from hpc_asyncppo.transport.weight_group import (
    WeightGroupSpec,
    group_size,
    member_rank,
    open_weight_group,
    serve_store,
)
from hpc_asyncppo.transport.weights import WeightBroadcaster, WeightReceiver
from tests.conftest import free_port

SILENT_S = 120  # the silent rank stays in the default group this long, doing nothing
HANG_S = 60  # the sync's ranks end before this, and long before the silent one
CPU = torch.device("cpu")


def test_members_are_numbered_by_rollout_rank_then_worker() -> None:
    # 2 rollout ranks of 2 TP workers each: the leader is 0, then 1, 2 | 3, 4
    assert group_size(2, 2) == 5
    assert [member_rank(r, w, 2) for r in (0, 1) for w in (0, 1)] == [1, 2, 3, 4]
    assert member_rank(3, 0, 1) == 4
    with pytest.raises(ValueError, match="worker 2"):
        member_rank(0, 2, 2)


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("a", torch.randn(300, 7, generator=gen)),
        ("b", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("c", torch.randn(64, 64, generator=gen)),
    ]


def _rank(rank: int, world_port: int, spec: WeightGroupSpec, out: dict) -> None:
    # the default group: the whole "job", three ranks, as topology.py builds it
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{world_port}",
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=SILENT_S + 30),
    )
    if rank == 2:  # a rank that never takes part in a sync, nor in any collective
        time.sleep(SILENT_S)
        return
    group = open_weight_group(spec, rank)
    if rank == 0:
        WeightBroadcaster(group, 0, 1 / 2**10, torch.device("cpu")).broadcast(7, weights(1))
    else:
        version, received = WeightReceiver(group, 0, torch.device("cpu")).receive_all()
        out["version"] = version
        out["digest"] = weights_digest(list(received.items()))
    os._exit(0)  # leave the default group without its (collective) teardown


def test_a_sync_completes_while_the_default_group_has_a_silent_rank() -> None:
    spec = WeightGroupSpec("127.0.0.1", free_port(), 2, "gloo", timeout_s=SILENT_S / 2)
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.get_context("spawn")
        world_port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world_port, spec, out)) for r in range(3)]
        for p in procs:
            p.start()
        for p in procs[:2]:
            p.join(timeout=HANG_S)
        silent_alive = procs[2].is_alive()
        for p in procs:
            p.kill()
        assert all(p.exitcode == 0 for p in procs[:2]), [p.exitcode for p in procs]
        assert silent_alive, "the silent rank should still be sleeping: the test proves nothing"
        assert out["version"] == 7
        assert out["digest"] == weights_digest(weights(1))


def test_a_closed_generation_refuses_at_once_and_the_next_one_meets() -> None:
    """A generation replaced (an engine restarted) is closed on every member: a broadcast
    posted on it by a late caller is refused (not posted, to time out), and
    the next generation meets on the same store."""
    spec = WeightGroupSpec("127.0.0.1", free_port(), 2, "gloo", timeout_s=HANG_S)
    store = serve_store(spec.host, spec.world_size, spec.timeout_s)
    spec = dataclasses.replace(spec, port=store.port)
    with ThreadPoolExecutor(max_workers=1) as pool:
        member = pool.submit(open_weight_group, spec, 1)
        old = open_weight_group(spec, 0, store)
        old_member = member.result(timeout=HANG_S)
        for group in (old, old_member):
            group.close()
            group.close()  # a second close does nothing
        # refused before anything is posted: no wait on the group's timeout
        with pytest.raises(RuntimeError, match="generation 0 is closed"):
            old.broadcast(torch.ones(1), 0)
        following = spec.regrouped()
        member = pool.submit(
            lambda: WeightReceiver(open_weight_group(following, 1), 0, CPU).receive_all()
        )
        new = open_weight_group(following, 0, store)
        WeightBroadcaster(new, 0, 1 / 2**10, CPU).broadcast(3, weights(2))
        version, received = member.result(timeout=HANG_S)
    assert version == 3
    assert weights_digest(list(received.items())) == weights_digest(weights(2))
