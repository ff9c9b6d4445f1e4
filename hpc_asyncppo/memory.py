"""What each rank needs of its GPU, from the model's ``config.json`` and the run's config:
the arithmetic the recipes write out, checked at submit (``check_memory``) against the declared
GPU sizes (``slurm.rollout.gpu_memory_gb``, ``slurm.train.gpu_memory_gb``; 0 = not
declared, no check). Estimates, each term named; a refusal is one line with the numbers
and the key to change.

A rollout GPU (each vLLM tensor-parallel worker): vLLM takes ``gpu_memory_utilization`` of
the device for its weights (N x dtype / TP) and KV cache; outside that share the worker
holds its CUDA context and NCCL buffers (``CONTEXT_GB``, an estimate) and, during a weight
sync, two bucket buffers (``trainer.weight_sync_bucket_mb``) plus the tensors vLLM's
layerwise reload holds until a layer is complete (the larger of one decoder layer and the
largest single tensor, in ``model.dtype``). The rollout rank itself holds no weights on the
GPU (``transport/weight_group.py``).

A trainer GPU (FSDP2 over T ranks, ``trainer/policy.py``): fp32 weights, gradients and AdamW
moments sharded (16 N / T bytes), a frozen reference (2 N / T, with ``actor.use_kl_loss``),
the root unit (embeddings and an untied LM head) and two decoder layers gathered in
``model.dtype``, one layer's fp32 gradient before its reduce-scatter, the activations of one
micro-batch (with gradient checkpointing each layer's input plus one layer recomputed), and
the fp32 logits of ``actor.log_prob_chunk_tokens`` tokens three times (logits, softmax,
gradient), and AdamW's temporaries during its step (``actor.optimizer_impl``: foreach,
torch's choice on GPUs, makes one fp32 copy of the rank's shard of the trained
parameters; a loop one tensor's shard at a time; fused none). The trainer leader also
holds what it sends: the broadcaster's two bucket buffers and, with in-flight weight
updates (``async_training.inflight_weight_update``, fully_async), a full copy of the
weights in ``model.dtype`` from the gathering to the broadcast's end (without them, one
gathered tensor at a time: the largest). The check counts the leader, the rank that
needs the most.

With LoRA (``actor.lora_rank``, ``models/lora.py``) the base is frozen in ``model.dtype``
(size N / T bytes, no gradient or AdamW state) and the L adapter parameters carry the fp32
state (16 L / T); the layer's gradient is the adapters'; the reference costs nothing (the
base with adapters off). A rollout worker then also holds the adapters of a sync (4 L).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_asyncppo.config import ConfigError
from hpc_asyncppo.config.model_shape import ModelShape

if TYPE_CHECKING:
    from hpc_asyncppo.config import Config

GB = 1e9
CONTEXT_GB = 1.0  # CUDA context, NCCL communicators and allocator slack per process
MIN_KV_GB = 1.0  # vLLM refuses to start without room for a KV cache
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def rollout_problem(cfg: Config, shape: ModelShape, gpu_gb: float) -> str | None:
    """Why a rollout rank's vLLM worker cannot fit a GPU of ``gpu_gb``, or None."""
    r = cfg.rollout
    size = DTYPE_BYTES[cfg.model.dtype]
    share = r.gpu_memory_utilization * gpu_gb * GB
    weights = shape.params * size / r.tensor_parallel_size
    if weights + MIN_KV_GB * GB > share:
        return (
            f"rollout: vLLM's share of a {gpu_gb:g} GB GPU (rollout.gpu_memory_utilization="
            f"{r.gpu_memory_utilization:g}: {_gb(share)}) cannot hold the weights of each of "
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} workers ({_gb(weights)}) and "
            f"{MIN_KV_GB:g} GB of KV cache: raise rollout.tensor_parallel_size or "
            "rollout.gpu_memory_utilization"
        )
    buckets = 2 * cfg.trainer.weight_sync_bucket_mb * 2**20
    held = max(shape.layer_params, shape.largest_tensor) * size
    if cfg.actor.lora_rank:  # a LoRA sync's adapters, kept until the model is merged
        held += 4 * shape.lora_params(cfg.actor.lora_rank, cfg.actor.target_modules)
    outside = CONTEXT_GB * GB + buckets + held
    free = gpu_gb * GB - share
    if outside > free:
        fits = max(0.0, (gpu_gb * GB - outside) / (gpu_gb * GB))
        return (
            f"rollout: a vLLM worker needs {_gb(outside)} beside vLLM's share of its {gpu_gb:g} GB "
            f"GPU (CUDA context and NCCL {CONTEXT_GB:g} GB, two weight-sync buckets "
            f"{_gb(buckets)}, the tensors a reload holds {_gb(held)}) but "
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} leaves {_gb(free)}: "
            f"lower it to {fits:.2f} or less, or lower trainer.weight_sync_bucket_mb"
        )
    return None


def trainer_terms(
    cfg: Config, shape: ModelShape, train_ranks: int, leader: bool = True
) -> dict[str, float]:
    """Bytes per trainer GPU, by term (the recipes' arithmetic): the leader's, or with
    ``leader=False`` another trainer rank's (no weight sync of its own)."""
    a = cfg.actor
    size = DTYPE_BYTES[cfg.model.dtype]
    n, h = shape.params, shape.hidden
    if a.use_dynamic_bsz:
        tokens = a.ppo_max_token_len_per_gpu
    else:
        responses = a.ppo_mini_batch_size * cfg.rollout.n // train_ranks
        rows = a.ppo_micro_batch_size_per_gpu or responses
        tokens = rows * (cfg.data.max_prompt_length + cfg.rollout.response_length)
    per_layer_activations = tokens * (6 * h + 2 * shape.intermediate) * size
    if a.gradient_checkpointing:
        activations = shape.layers * tokens * h * size + per_layer_activations
    else:
        activations = shape.layers * per_layer_activations
    if a.lora_rank:
        adapters = shape.lora_params(a.lora_rank, a.target_modules)
        state = {
            f"frozen base in {cfg.model.dtype} (sharded)": size * n / train_ranks,
            "fp32 adapters, gradients and AdamW moments (sharded)": 16 * adapters / train_ranks,
            "one layer's fp32 adapter gradients": 4 * adapters / shape.layers,
        }
    else:
        state = {
            "fp32 weights, gradients and AdamW moments (sharded)": 16 * n / train_ranks,
            "one layer's fp32 gradient": 4 * shape.layer_params,
        }
    terms = {
        **state,
        "root unit gathered": shape.root_params * size,
        "two decoder layers gathered": 2 * shape.layer_params * size,
        f"activations of {tokens} tokens": activations,
        "logits of one chunk (fp32, x3)": 3 * 4 * a.log_prob_chunk_tokens * shape.vocab,
        "CUDA context and NCCL": CONTEXT_GB * GB,
    }
    if a.use_kl_loss and not a.lora_rank:
        terms["frozen reference (sharded)"] = size * n / train_ranks
    trained = shape.lora_params(a.lora_rank, a.target_modules) if a.lora_rank else n
    if a.optimizer_impl in ("auto", "foreach"):
        terms["AdamW's foreach step: an fp32 copy of the shard"] = 4 * trained / train_ranks
    elif a.optimizer_impl == "for-loop":
        largest = trained / shape.layers if a.lora_rank else shape.largest_tensor
        terms["AdamW's step: one tensor's fp32 shard"] = 4 * largest / train_ranks
    if leader:
        terms["the broadcaster's two bucket buffers"] = (
            2 * cfg.trainer.weight_sync_bucket_mb * 2**20
        )
        sync = cfg.async_training
        if sync.inflight_weight_update and sync.mode != "sync":
            if a.lora_rank:
                terms["the in-flight sync's copy of the adapters (float32)"] = 4 * trained
            else:
                terms[f"the in-flight sync's copy of the weights ({cfg.model.dtype})"] = size * n
        elif not a.lora_rank:
            terms["the largest tensor gathered for a sync"] = size * shape.largest_tensor
    return terms


def trainer_problem(cfg: Config, shape: ModelShape, gpu_gb: float, train_ranks: int) -> str | None:
    """Why a trainer rank cannot fit a GPU of ``gpu_gb``, or None."""
    terms = trainer_terms(cfg, shape, train_ranks)
    total = sum(terms.values())
    if total <= gpu_gb * GB:
        return None
    largest = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
    named = ", ".join(f"{name} {_gb(b)}" for name, b in largest)
    return (
        f"train: the trainer leader (of {train_ranks} trainer ranks) needs about {_gb(total)} "
        f"of its {gpu_gb:g} GB GPU ({named}, ...): add trainer ranks, lower "
        "actor.ppo_max_token_len_per_gpu (with actor.use_dynamic_bsz=true), turn on "
        "actor.gradient_checkpointing or set actor.optimizer_impl=fused"
    )


def memory_problem(cfg: Config, train_ranks: int) -> str | None:
    """The first side that does not fit its declared GPU size, or None (also when no size
    is declared, or the model's config.json cannot be read here)."""
    rollout_gb, train_gb = cfg.slurm.rollout.gpu_memory_gb, cfg.slurm.train.gpu_memory_gb
    if not (rollout_gb or train_gb):
        return None
    shape = ModelShape.of(cfg.model.path)
    if shape is None:
        return None
    if rollout_gb and cfg.rollout.engine == "vllm":
        problem = rollout_problem(cfg, shape, rollout_gb)
        if problem:
            return problem
    if train_gb:
        return trainer_problem(cfg, shape, train_gb, train_ranks)
    return None


def check_memory(cfg: Config, train_ranks: int) -> None:
    """The declared GPU sizes (slurm.*.gpu_memory_gb) against what each rank needs, once
    the number of trainer ranks is known (at submit). Raises ConfigError."""
    problem = memory_problem(cfg, train_ranks)
    if problem:
        raise ConfigError(problem)
