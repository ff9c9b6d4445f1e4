"""The engine ``rollout.engine`` names: ``hf`` (``hf_engine.py``) or ``vllm``
(``vllm_engine.py``, imported only when chosen: vLLM is an optional install). Both
answer the ``RolloutEngine`` protocol of ``engine.py``."""

from __future__ import annotations

import torch

from hpc_asyncppo.config import Config
from hpc_asyncppo.rollout.engine import RolloutEngine
from hpc_asyncppo.rollout.hf_engine import HFEngine


def make_engine(cfg: Config, device: torch.device) -> RolloutEngine:
    """The engine ``cfg.rollout.engine`` names, for a rollout rank on ``device``."""
    if cfg.rollout.engine == "vllm":
        from hpc_asyncppo.rollout.vllm_engine import VLLMEngine  # vLLM is an optional install

        return VLLMEngine(
            cfg.model,
            cfg.rollout,
            device,
            max_prompt_length=cfg.data.max_prompt_length,
            seed=cfg.trainer.seed,
            weight_sync_s=cfg.timeouts.weight_sync_s,
        )
    return HFEngine(cfg.model, cfg.rollout, device)
