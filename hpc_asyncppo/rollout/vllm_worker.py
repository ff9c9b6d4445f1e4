"""Code that runs inside vLLM's processes: a CPU (gloo) weight-transfer engine, and the
plugin that keeps vLLM's engine processes alive through the job's stop signals.

vLLM ships weight-transfer engines for GPUs only (``nccl``, ``ipc``...). This module adds a
``gloo`` one, so that on CPU the rollout rank (sender, rank 0) pushes new weights into its
vLLM worker (rank 1..) through vLLM's own weight-update path. The module is vLLM's
``worker_extension_cls``: the worker imports it before loading the model, which registers
the engine with vLLM's factory in the worker process.

Loading goes through vLLM's layerwise reload (``initialize_layerwise_reload`` /
``finalize_layerwise_reload``): on CPU vLLM repacks the linear weights into oneDNN form after
loading and empties the original parameters, so a plain ``model.load_weights`` would update
some tensors silently not at all.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

GLOO_BACKEND = "gloo_hpc_asyncppo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int  # the sender (rank 0) plus every vLLM worker of this engine
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]  # e.g. "float32", as in torch.float32
    shapes: list[list[int]]


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group that leaves torch.distributed's default group alone (the rollout rank
    already has one: the whole MPI job)."""
    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
    )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: receive each tensor by broadcast from rank 0 and load it in place."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = 1 + self.parallel_config.rank  # rank 0 is the sender
        self.group = open_group(
            init_info.host, init_info.port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            # a stateless group is unknown to torch.distributed's registry: call it directly
            self.group.broadcast(tensor, 0).wait()
            self.model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
        self.group = None


if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)


class WorkerExtension:
    """Mixed into vLLM's worker class; importing this module is what registers the engine."""

    def hpc_asyncppo_ready(self) -> bool:
        return True


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
