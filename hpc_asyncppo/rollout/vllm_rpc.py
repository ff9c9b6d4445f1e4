"""The worker methods a rollout rank calls in vLLM's workers (``collective_rpc``), by name:
the one place both sides take them from (``vllm_engine.py`` calls them, ``vllm_worker.py``
defines the project's own; ``tests/rollout/test_vllm_engine.py`` checks that each names a
method the worker has). Nothing here imports vLLM.

vLLM's weight-transfer API on its worker (vLLM 0.32, ``vllm/v1/worker/``), with the
project's engine (``vllm_worker.WeightGroupEngine``) under it:
"""

from __future__ import annotations

JOIN = "init_weight_transfer_engine"  # join the weight group (its generation)
START_UPDATE = "start_weight_update"  # before a sync's buckets
UPDATE = "update_weights"  # receive and load a sync
FINISH_UPDATE = "finish_weight_update"  # after them

# The project's worker extension (``vllm_worker.WorkerExtension``):
LAST_SYNC = "hpc_asyncppo_last_sync"  # the worker's account of the last sync (digest, times)

VLLMS = (JOIN, START_UPDATE, UPDATE, FINISH_UPDATE)
OURS = (LAST_SYNC,)
