"""Code that runs inside vLLM's worker processes: the weight group's receiving end, and
the plugin that keeps vLLM's engine processes alive through the job's stop signals.

Every vLLM worker (each tensor-parallel rank of every rollout rank) is a member of the
weight group (``transport/weight_group.py``): the trainer leader broadcasts each sync
straight into the workers, and the rollout rank that drives the engine only orchestrates
(``init_weight_transfer_engine``, then per sync ``start_weight_update``,
``update_weights``, ``finish_weight_update``, through ``collective_rpc``) and holds no copy
of the weights. The receiving code is the project's own ``WeightReceiver``, the same that
the HF engine's rank runs; only the group's backend differs between GPUs (NCCL) and CPUs
(gloo). This module is vLLM's ``worker_extension_cls``: the worker imports it before
loading the model, which registers the engine with vLLM's factory in the worker process.

Each worker receives the full tensors and loads them through vLLM's own loader (which
shards them for tensor parallelism) inside vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``): on CPU vLLM repacks the
linear weights after loading and empties the original parameters, so a plain
``model.load_weights`` would update some tensors silently not at all. The layerwise
reload holds a layer's tensors until the layer is complete, so they are received as
memory of their own (``IncomingWeights.buckets(keep=True)``). Memory in a worker during a
sync: two bucket buffers, and the tensors of the layers not yet complete (about one
decoder layer, as buckets follow the model's order).

With ``digest`` in the update, each worker hashes the tensors it handed to its loader
(``runlog.WeightDigest``: the trainer leader hashes the same tensors as it sends them);
``WorkerExtension.hpc_asyncppo_last_sync`` returns it, so the rollout rank can check
every worker at every version.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from hpc_asyncppo.models import lora
from hpc_asyncppo.runlog import WeightDigest
from hpc_asyncppo.transport.weight_group import WeightGroupSpec, open_weight_group
from hpc_asyncppo.transport.weights import WeightReceiver, check_version

BACKEND = "hpc_asyncppo"  # our engine's name in vLLM's weight-transfer factory


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """A ``WeightGroupSpec``'s fields, and the group rank of this engine's worker 0."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    rank_offset: int
    generation: int = 0


@dataclass
class GroupUpdateInfo(WeightTransferUpdateInfo):
    version: int  # the version the rollout rank was announced; the header must carry it
    digest: bool = False


class WeightGroupEngine(WeightTransferEngine[GroupInitInfo, GroupUpdateInfo]):
    """A worker's end of the weight group: receive each sync whole and load it."""

    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        spec = WeightGroupSpec.of(init_info.__dict__)
        # one engine per data-parallel replica here: the worker's rank is its TP rank
        self.rank = init_info.rank_offset + self.parallel_config.rank
        if getattr(self, "group", None) is not None:  # the generation this one replaces
            self.group.close()
        self.group = open_weight_group(spec, self.rank)
        self.receiver = WeightReceiver(
            self.group, 0, spec.bucket_device(self.device), target=self.device
        )
        self.last: dict = {}
        # a LoRA sync's base, read once: kept when the group meets anew after a restart
        self.base: lora.BaseWeights | None = getattr(self, "base", None)
        self.lora_sync = False  # whether the sync in progress carries adapters
        # the tensors that differ from the base's files (None: any may, after a full sync)
        self.merged: set[str] | None = getattr(self, "merged", set())

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # A LoRA sync loads only the layers its adapters change; vLLM puts the others'
        # weights back and warns for each ("Failed to load weights"), as it would for a
        # full sync that missed a layer: that warning stays for full syncs only.
        reload_log = logging.getLogger(finalize_layerwise_reload.__module__)
        level = reload_log.level
        if self.lora_sync:
            reload_log.setLevel(logging.ERROR)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            reload_log.setLevel(level)

    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        start = time.monotonic()
        incoming = self.receiver.receive()
        check_version(update_info.version, incoming.version, f"weight-group rank {self.rank}")
        digest = WeightDigest() if update_info.digest else None
        loading, loaded = 0.0, 0
        buckets, each = incoming.buckets(keep=True), digest
        self.lora_sync = any(lora.is_wire_adapter(name) for name, _, _ in incoming.specs())
        if self.lora_sync:
            buckets = self.merged_buckets(buckets, digest)  # digests what the leader sent
            each = None
        else:
            self.merged = None  # any layer may now hold weights other than the base's
        for bucket in buckets:
            if each is not None:
                for name, tensor in bucket.items():
                    each.add(name, tensor)
            began = time.monotonic()
            self.model.load_weights(list(bucket.items()))
            loading += time.monotonic() - began
            loaded += len(bucket)
        self.last = {
            "version": incoming.version,
            "rank": self.rank,
            "digest": digest.hexdigest() if digest is not None else "",
            "seconds": time.monotonic() - start,
            "load_s": loading,  # in vLLM's loader (and the layers it processed meanwhile)
            "peak_bytes": self.receiver.peak_bytes,
            "base_bytes": self.base.held_bytes if self.base is not None else 0,
            "tensors_loaded": loaded,
        }

    def merged_buckets(
        self, buckets: Iterator[dict[str, torch.Tensor]], digest: WeightDigest | None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """A LoRA sync (``models/lora.py``): every adapter first (megabytes), then each
        layer the adapters change, whole, in the base files' order: each targeted weight
        merged (base + B @ A), the rest of its layer (the fused siblings of a ``q_proj``,
        the biases) as the base has it. vLLM's layerwise reload processes a layer once all
        of its tensors came, and puts back the weights of a layer that got none: the other
        layers are not touched. Only the adapters crossed the network; the base is read
        from the model's files at the first LoRA sync and held here (``BaseWeights``: the
        changed layers' full tensors, in this worker's host memory)."""
        adapters: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            adapters.update(bucket)
        if digest is not None:
            for name, tensor in adapters.items():
                digest.add(name, tensor)
        if self.base is None:
            self.base = lora.BaseWeights(self.model_config.model)
        modules = [name[: -len(".weight")] for name in lora.base_targets(adapters)]
        packed = getattr(self.model, "packed_modules_mapping", None) or {}
        every = self.base.names()
        changed = set(lora.layer_tensors(every, modules, packed))
        # a layer that an earlier sync changed (adapters this one's do not target, or a full
        # sync: every layer) gets its base back
        reload = changed | (set(every) if self.merged is None else self.merged)
        names = [name for name in every if name in reload]
        self.merged = changed
        merged = lora.merged_weights(
            adapters, self.base.read(names), self.model_config.dtype, everything=True
        )
        for name, tensor in merged:
            yield {name: tensor}

    def shutdown(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.close()
        self.group = None


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, WeightGroupEngine)


class WorkerExtension:
    """Mixed into vLLM's worker class; importing this module is what registers the engine.
    The rank calls its methods by the names in ``vllm_rpc.py``."""

    def hpc_asyncppo_last_sync(self) -> dict:
        """The last sync this worker received: version, its weight-group rank, digest
        (with ``digest`` asked for), seconds (of which ``load_s`` in vLLM's loader), peak
        bucket-buffer bytes, the tensors it handed to vLLM's loader, and the bytes of a
        LoRA base it holds."""
        return dict(self.weight_transfer_engine.last)


# --- stop signals -------------------------------------------------------------------------
# Slurm sends its warning signal (USR2) and SIGTERM to every process of the job step, vLLM's
# engine core and worker processes included. Their defaults would end them under the rollout
# rank (USR2 kills; vLLM's own SIGTERM handlers shut the engine down), before the rank has
# cut its groups into the checkpoint. The rank ignores nothing: it records the signal and
# stops generating; the engine processes must ignore both, and their rank shuts them down
# (``VLLMEngine.close``: SIGINT, which vLLM's engine core takes as its shutdown request).
RANK_PID_ENV = "HPC_ASYNCPPO_VLLM_RANK_PID"
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ignore_stop_signals() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``, see pyproject.toml), run in
    every vLLM process when it loads its plugins: the engine core in ``EngineCore.__init__``
    and each worker in its constructor, both after vLLM installed its SIGTERM handlers. It
    acts only in engine processes started by a rollout rank (``RANK_PID_ENV`` names it,
    and the rank itself keeps its handlers); elsewhere it does nothing."""
    rank_pid = os.environ.get(RANK_PID_ENV)
    if rank_pid and int(rank_pid) != os.getpid():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        die_with_parent()
        atexit.register(skip_the_last_collection)


def skip_the_last_collection() -> None:
    """At exit, after vLLM's shutdown: its teardown unfreezes the heap it froze at start (so
    an engine deleted in-process frees its memory), and the interpreter's last collection
    then walks that whole heap (torch, transformers and vLLM: millions of objects) in a
    process about to end: 4 s in each engine process on two cores (py-spy: in
    ``gc_collect_main``), one after the other, so a rank's ``close`` took 9-10 s. vLLM has
    released what outlives a process (its shared-memory queues) in its shutdown already.

    Objects left uncollected make nanobind (Triton's bindings) print a leak report of some
    30 lines as the interpreter ends; the process has nothing more to say by then (a
    failure's traceback is printed before exit handlers run), so stderr goes to /dev/null."""
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def die_with_parent() -> None:
    """An engine process that ignores SIGTERM must not outlive a rank killed outright
    (SIGKILL, the OOM killer): Linux sends it SIGKILL when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: vLLM's own parent checks remain
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)
