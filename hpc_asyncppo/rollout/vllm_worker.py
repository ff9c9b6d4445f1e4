"""Code that runs inside vLLM's worker process: a CPU (gloo) weight-transfer engine.

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

    def hpc_asyncppo_ignore_stop_signals(self) -> int:
        """In vLLM's engine process (where the worker runs with tensor_parallel_size 1):
        ignore the stop signals, which Slurm sends every process of the job, vLLM's own
        SIGTERM handler included (it would shut the engine down under its rank, which shuts
        it down itself). Returns the process id."""
        import os
        import signal

        for sig in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        return os.getpid()
