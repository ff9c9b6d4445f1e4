"""The trainer leader's side of the weight sync: the weight group, the broadcast on the
wire, and the weight group meeting anew after a rollout rank's engine restarted.

``WeightSender.send(version, step)`` announces a version and broadcasts the weights,
gathered from the shards one tensor at a time (the followers gather in step, on the SYNC
order). The loop (``trainer.py``) decides when, and owns the counters a sync moves.

A rollout rank whose engine died and is restarting in place says REJOIN
(``rollout/rollouter.py``): before the next sync, or at once while the leader waits for
samples (``lost``), every rank meets in a new weight group (``regroup``: REGROUP, the
group's next generation on the same store) and the weights go out again, the same version
when they have not moved since (else as a new one). A broadcast that breaks on the dead
engine (it died mid-sync, or before its REJOIN arrived) waits for that REJOIN
(``timeouts.rank_wait_s``), regroups and sends again; without a REJOIN the failure stands.
Another rank's workers receiving the broadcast that broke cannot be woken (gloo): that
rank's engine shows no whole weight update within ``rollout.engine_stall_s``, and it
restarts its engine too (BENCHMARKS.md, "Engine restarts in place").
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

from hpc_asyncppo import runlog
from hpc_asyncppo.config import Config
from hpc_asyncppo.runtime import heartbeat
from hpc_asyncppo.runtime.topology import Topology
from hpc_asyncppo.trainer.followers import Followers, Order
from hpc_asyncppo.trainer.policy import Policy
from hpc_asyncppo.transport.samples import Control, SampleReceiver
from hpc_asyncppo.transport.waits import PeerTimeout, poll_until
from hpc_asyncppo.transport.weight_group import WeightGroupSpec, open_weight_group
from hpc_asyncppo.transport.weights import Background, WeightBroadcaster

log = logging.getLogger(__name__)


class WeightSender:
    """The weight group's sender on the trainer leader.

    Keeps the group (its spec, the rendezvous on a side thread, the broadcaster) and, with
    in-flight weight updates after the first sync, the broadcast on its side thread. Memory:
    with in-flight updates one full copy of the weights in ``model.dtype`` on the sync
    device until that broadcast completes (the next sync, a checkpoint or the end waits
    for it); otherwise one bucket, packed while the last is on the wire.

    ``receive``: takes in what the rollout ranks sent (``Intake.receive``), while a broken
    broadcast waits for a REJOIN."""

    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        run_dir: Path,
        policy: Policy,
        receiver: SampleReceiver,
        followers: Followers,
        receive: Callable[[], None],
    ):
        self.cfg, self.topo, self.run_dir, self.policy = cfg, topo, run_dir, policy
        self.receiver, self.followers, self.receive = receiver, followers, receive
        # The weight group meets once every member has joined (vLLM workers once their
        # engine has started): the leader joins on a side thread and waits at its first sync.
        self.spec = topo.weights
        self.joining = self.join(self.spec)
        self.broadcaster: WeightBroadcaster | None = None
        self.weights_lost = False  # a rank's engine lost its weights: send them again
        self.sending: Background | None = None
        self.version_sent = False
        self.inflight = (
            cfg.async_training.inflight_weight_update and cfg.async_training.mode != "sync"
        )
        self.last_sync_s = 0.0  # the last completed broadcast, to its last bucket's completion
        # bytes of each sync: the model in model.dtype, or with LoRA the adapters (fp32)
        self.sync_bytes = sum(
            math.prod(shape) * dtype.itemsize for _, shape, dtype in policy.weight_specs()
        )

    @property
    def lost(self) -> bool:
        """A rank's engine restarted (REJOIN) or a regroup followed a broken broadcast: the
        weights must go out again."""
        return self.weights_lost or bool(self.receiver.rejoins)

    def send(self, version: int, step: int) -> None:
        """Broadcast the weights as ``version`` (after the previous broadcast completed, and
        after a regroup when a rank's engine restarted). One that breaks on a dead engine
        is sent again once every rank has met anew."""
        self.finish()  # one broadcast on the wire at a time
        if self.receiver.rejoins:  # a rank's engine restarts: meet anew before sending
            self.regroup()
        try:
            self.broadcast(version, step)
        except RuntimeError as broken:
            self.regroup(broken)
            self.broadcast(version, step)
        self.weights_lost = False

    def broadcast(self, version: int, step: int) -> None:
        """Announce ``version`` and broadcast the weights. With in-flight weight updates
        (after the first sync) the gathered tensors go to a side thread that broadcasts
        them while this rank trains on: it is blocked only for the gathering."""
        broadcaster = self.group_sender()
        self.followers.order(Order.SYNC, step)
        digest = runlog.WeightDigest() if self.cfg.trainer.record_weight_digests else None
        if self.inflight and self.version_sent:
            named = list(self.policy.named_weights(owned=True))
            if digest is not None:
                for name, tensor in named:
                    digest.add(name, tensor)
            # announced only now that it is ready to go: a rollout rank pauses its engine
            # (vLLM) for the broadcast itself, not for the gathering
            self.receiver.broadcast_control(Control.SYNC, version)
            self.sending = broadcaster.broadcast_in_background(version, named)
        else:
            self.receiver.broadcast_control(Control.SYNC, version)
            named = self.policy.named_weights()  # the followers gather each tensor in step
            try:
                self.last_sync_s = broadcaster.broadcast(
                    version,
                    named,
                    specs=self.policy.weight_specs(),
                    on_tensor=digest.add if digest else None,
                )
            except RuntimeError:
                for _ in named:  # broken: the followers' gathers still finish
                    pass
                raise
        self.version_sent = True
        if digest is not None:
            runlog.record_weight_digest(
                self.run_dir, self.topo.world_rank, version, digest.hexdigest()
            )

    def join(self, spec: WeightGroupSpec) -> Background:
        """Join the weight group on a side thread; the next sync waits for it to meet."""
        return Background(
            lambda: open_weight_group(spec, 0, self.topo.weights_store),
            f"the weight group's rendezvous (generation {spec.generation})",
        )

    def regroup(self, broken: Exception | None = None) -> None:
        """Every rank meets in the weight group's next generation (REGROUP): a rank's
        engine restarted (REJOIN), and its members of the group died with it. ``broken``: a
        broadcast that failed; it stands unless a REJOIN comes within rank_wait_s."""
        if broken is not None and not self.receiver.rejoins:
            heartbeat.doing("waiting for a rollout rank's REJOIN after a broken weight sync")
            try:
                poll_until(
                    lambda: (self.receive(), bool(self.receiver.rejoins))[1],
                    self.cfg.timeouts.rank_wait_s,
                    "a rollout rank to say its engine restarts (REJOIN)",
                )
            except PeerTimeout:
                raise broken from None
        ranks = sorted(self.receiver.rejoins)
        self.receiver.rejoins.clear()
        self.close_group()
        self.spec = self.spec.regrouped()
        log.warning(
            "rollout ranks %s restart their engines: every rank meets in the weight group's "
            "generation %d, and the weights go out again",
            ranks,
            self.spec.generation,
        )
        self.receiver.broadcast_control(Control.REGROUP, self.spec.generation)
        self.joining = self.join(self.spec)
        self.weights_lost = True

    def close_group(self) -> None:
        """Abort the weight group's current generation (``WeightGroup.close``), joined or
        still meeting once it has met; the next sync joins the next one."""
        if self.broadcaster is not None:
            self.broadcaster.group.close()
            self.broadcaster = None
        elif self.joining.done():
            with contextlib.suppress(RuntimeError):  # a rendezvous that failed: nothing held
                self.joining.result(0).close()

    def group_sender(self) -> WeightBroadcaster:
        """The sender of the weight group, once the group has met (the first sync waits)."""
        if self.broadcaster is None:
            group = self.joining.result(self.cfg.timeouts.weight_sync_s + 30)
            device = self.topo.weights.bucket_device(self.topo.device)
            bucket_mb = self.cfg.trainer.weight_sync_bucket_mb
            self.broadcaster = WeightBroadcaster(group, 0, bucket_mb, device)
        return self.broadcaster

    def finish(self) -> None:
        """Wait for a broadcast still on the wire (in-flight weight updates)."""
        if self.sending is not None:
            sending, self.sending = self.sending, None
            try:
                self.last_sync_s = float(sending.result(self.cfg.timeouts.weight_sync_s))
            except RuntimeError as broken:  # on a dead engine: sent again after a regroup
                self.regroup(broken)
