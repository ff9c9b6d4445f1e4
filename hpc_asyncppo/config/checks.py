"""The checks a config passes once, at load: each value in its allowed range, settings that
cannot be right together, and the config against what it names (the tool config, the
model's tied head, the Slurm components' GPU layout). Each failure is a ``ConfigError``
with one line naming the key and what is allowed. The GPU memory estimate needs the
number of trainer ranks and lives with its arithmetic (``memory.py:check_memory``)."""

from __future__ import annotations

from typing import Any

from hpc_asyncppo.config.files import tool_config_file
from hpc_asyncppo.config.schema import Config, ConfigError, lora_targets
from hpc_asyncppo.config.slurm import slurm_layout_problem

_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2"),
    "actor.lr_scheduler": ("constant", "cosine"),
    "actor.optimizer_impl": ("auto", "foreach", "fused", "for-loop"),
    "rollout.engine": ("hf", "vllm"),
    "gateway.sampling": ("override", "refuse"),
    "gateway.tool_parser": ("auto", "hermes", "llama3_json", "mistral"),
    "gateway.on_session_failure": ("drop", "score"),
    "actor.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ),
    "actor.policy_loss.loss_mode": ("vanilla", "gspo"),
    "actor.kl_loss_type": (
        *("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"),
        *("k1+", "kl+", "k2+", "mse+", "k3+", "low_var_kl+", "abs+"),
    ),
    "algorithm.adv_estimator": (
        "grpo",
        "drgrpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "gae",
    ),
    "algorithm.rollout_is": ("none", "token", "sequence"),
    "algorithm.rollout_is_mode": ("truncate", "mask"),
    "algorithm.rollout_rs": ("none", "token", "sequence", "geometric"),
    "algorithm.filter_groups.metric": ("acc", "score", "seq_reward", "seq_final_reward"),
    "async_training.mode": ("fully_async", "sync"),
    "trainer.wandb_mode": ("auto", "offline", "online"),
    "rollout.multi_turn.format": ("hermes",),
    "rollout.multi_turn.tool_response_truncate_side": ("left", "middle", "right"),
}

# Head sizes vLLM's CPU attention backend supports (vllm 0.32, CPUAttentionBackend).
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# key -> (lowest allowed, whether the bound is exclusive)
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "model.tiny.hidden_size": (1, False),
    "model.tiny.num_layers": (1, False),
    "model.tiny.num_heads": (1, False),
    "model.tiny.intermediate_size": (1, False),
    "data.num_prompts": (1, False),
    "data.max_prompt_length": (1, False),
    "rollout.n": (1, False),
    "rollout.val_n": (1, False),
    "rollout.val_temperature": (0, False),
    "trainer.test_freq": (0, False),
    "rollout.response_length": (1, False),
    "rollout.temperature": (0, True),
    "rollout.top_p": (0, True),
    "rollout.top_k": (0, False),
    "rollout.prompts_per_generate": (1, False),
    "rollout.hf_step_tokens": (0, False),
    "rollout.torch_threads": (1, False),
    "rollout.tensor_parallel_size": (1, False),
    "rollout.gpu_memory_utilization": (0, True),
    "rollout.cpu_kv_cache_gb": (0, True),
    "rollout.max_num_seqs": (0, False),
    "rollout.max_num_batched_tokens": (0, False),
    "actor.lr": (0, True),
    "actor.weight_decay": (0, False),
    "actor.ppo_mini_batch_size": (1, False),
    "actor.ppo_epochs": (1, False),
    "actor.ppo_micro_batch_size_per_gpu": (0, False),
    "actor.clip_ratio_low": (0, False),
    "actor.clip_ratio_high": (0, False),
    "actor.clip_ratio_c": (1, True),
    "actor.entropy_coeff": (0, False),
    "actor.kl_loss_coef": (0, False),
    "actor.grad_clip": (0, False),
    "actor.ppo_max_token_len_per_gpu": (1, False),
    "actor.log_prob_chunk_tokens": (1, False),
    "actor.lr_warmup_steps": (0, False),
    "actor.min_lr_ratio": (0, False),
    "actor.torch_threads": (1, False),
    "actor.lora_rank": (0, False),
    "actor.lora_alpha": (0, True),
    "actor.lora_dropout": (0, False),
    "critic.value_coef": (0, False),
    "critic.cliprange_value": (0, True),
    "algorithm.gamma": (0, False),
    "algorithm.lam": (0, False),
    "algorithm.rollout_is_threshold": (1, False),
    "algorithm.rollout_rs_threshold": (0, True),
    "algorithm.filter_groups.max_num_gen_batches": (0, False),
    "reward.overlong_buffer.len": (0, False),
    "reward.overlong_buffer.penalty_factor": (0, False),
    "async_training.staleness_threshold": (0, False),
    "async_training.trigger_parameter_sync_step": (1, False),
    "async_training.require_batches": (1, False),
    "async_training.max_staleness": (0, False),
    "trainer.total_steps": (1, False),
    "trainer.max_restarts": (0, False),
    "trainer.restart_backoff_s": (0, False),
    "trainer.stall_timeout_s": (0, False),
    "trainer.collapse_window": (0, False),
    "trainer.collapse_reward_drop": (0, True),
    "trainer.collapse_entropy": (0, False),
    "trainer.collapse_kl": (0, True),
    "trainer.collapse_masked_fraction": (0, True),
    "rollout.engine_stall_s": (0, False),
    "rollout.max_engine_restarts": (0, False),
    "rollout.multi_turn.max_assistant_turns": (0, False),
    "rollout.multi_turn.max_user_turns": (0, False),
    "rollout.multi_turn.max_parallel_calls": (1, False),
    "rollout.multi_turn.max_tool_response_length": (1, False),
    "rollout.multi_turn.tool_timeout_s": (0, True),
    "trainer.weight_sync_bucket_mb": (1, False),
    "checkpoint.save_every": (0, False),
    "checkpoint.keep": (1, False),
    "buffer.memory_limit_mb": (0, False),
    "timeouts.sample_wait_s": (0, True),
    "timeouts.weight_sync_s": (0, True),
    "timeouts.rank_wait_s": (0, True),
    "timeouts.start_s": (0, True),
    "gateway.port": (0, False),
    "gateway.agent_timeout_s": (0, True),
    "gateway.claim_wait_s": (0, False),
    "gateway.max_request_mb": (0, True),
    "gateway.max_sequences": (1, False),
    "gateway.max_failed_in_row": (0, False),
    "gateway.max_failed_share": (0, True),
}

_UPPER_BOUNDS: dict[str, float] = {
    "rollout.top_p": 1.0,
    "rollout.gpu_memory_utilization": 1.0,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "actor.clip_ratio_low": 1.0,
    "actor.min_lr_ratio": 1.0,
    "actor.lora_dropout": 0.99,
    "gateway.max_failed_share": 1.0,
}


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _check_combinations(cfg: Config) -> None:
    """Settings that are valid alone but cannot be right together. Raises ConfigError."""
    truncated = cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0
    algo = cfg.algorithm
    uses_rollout_lp = (
        cfg.async_training.use_rollout_log_probs
        or algo.rollout_is != "none"
        or algo.rollout_rs != "none"
        or algo.m2po_threshold is not None
    )
    if cfg.rollout.engine == "vllm" and truncated and uses_rollout_lp:
        raise ConfigError(
            f"rollout.engine=vllm with rollout.top_p={cfg.rollout.top_p} / rollout.top_k="
            f"{cfg.rollout.top_k}: vLLM's log-probs are then over the truncated distribution, the "
            "trainer's over the full one, and this config uses them (use_rollout_log_probs, "
            "rollout_is, token by default, or rollout_rs); set rollout.top_p=1.0 rollout.top_k=0, "
            "or algorithm.rollout_is=none"
        )
    if cfg.async_training.use_rollout_log_probs and algo.rollout_is != "none":
        raise ConfigError(
            f"async_training.use_rollout_log_probs=true with algorithm.rollout_is="
            f"{algo.rollout_is}: the importance weights would compare the rollout's "
            "log-probs with themselves (all 1); set algorithm.rollout_is=none (token by default)"
        )
    if cfg.async_training.use_rollout_log_probs and algo.rollout_rs != "none":
        raise ConfigError(
            f"async_training.use_rollout_log_probs=true with algorithm.rollout_rs="
            f"{algo.rollout_rs}: rejection sampling would compare the rollout's log-probs with "
            "themselves (every ratio 1, nothing rejected); drop one of the two"
        )
    if algo.rollout_rs != "none":
        lower = algo.rollout_rs_threshold_lower
        effective = 1.0 / algo.rollout_rs_threshold if lower is None else lower
        if lower is not None and lower <= 0:
            raise ConfigError(f"algorithm.rollout_rs_threshold_lower={lower} must be > 0")
        if effective >= algo.rollout_rs_threshold:
            raise ConfigError(
                f"algorithm.rollout_rs_threshold_lower={effective:g} (unset: 1 / "
                f"rollout_rs_threshold) must be below algorithm.rollout_rs_threshold="
                f"{algo.rollout_rs_threshold:g}: nothing would be kept; e.g. set "
                "rollout_rs_threshold=2.0 (geometric: 1.001)"
            )
    if algo.rollout_is_mode == "mask":
        lower = algo.rollout_is_threshold_lower
        if algo.rollout_is != "token":
            raise ConfigError(
                f"algorithm.rollout_is_mode=mask works per token, not with algorithm.rollout_is="
                f"{algo.rollout_is}; set algorithm.rollout_is=token"
            )
        if lower is not None and not 0 <= lower < algo.rollout_is_threshold:
            raise ConfigError(
                f"algorithm.rollout_is_threshold_lower={lower:g} must be at least 0 and below "
                f"algorithm.rollout_is_threshold={algo.rollout_is_threshold:g}: nothing would "
                "train; e.g. 0.5 with rollout_is_threshold=5.0 (IcePop)"
            )
    elif algo.rollout_is_threshold_lower is not None:
        raise ConfigError(
            "algorithm.rollout_is_threshold_lower is the bound of algorithm.rollout_is_mode=mask "
            "(truncation has none); set rollout_is_mode=mask or leave it unset"
        )
    if algo.m2po_threshold is not None:
        if algo.m2po_threshold <= 0:
            raise ConfigError(
                f"algorithm.m2po_threshold={algo.m2po_threshold:g} must be > 0 (AReaL's: 0.04)"
            )
        if cfg.async_training.use_rollout_log_probs:
            raise ConfigError(
                "async_training.use_rollout_log_probs=true with algorithm.m2po_threshold: M2PO "
                "would compare the rollout's log-probs with themselves (nothing masked); drop "
                "one of the two"
            )
    overlong = cfg.reward.overlong_buffer
    if overlong.enable and not 1 <= overlong.len <= cfg.rollout.response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len={overlong.len} must be between 1 and "
            f"rollout.response_length={cfg.rollout.response_length} when "
            "reward.overlong_buffer.enable=true"
        )
    seqs, tokens = cfg.rollout.max_num_seqs, cfg.rollout.max_num_batched_tokens
    if seqs and tokens and tokens < seqs:
        # vLLM refuses it at engine start: every sequence in a step needs one token at least.
        raise ConfigError(
            f"rollout.max_num_batched_tokens={tokens} is below rollout.max_num_seqs={seqs}: "
            "raise it to max_num_seqs or more (or lower max_num_seqs)"
        )
    _check_gpu_layout(cfg)


def _check_gpu_layout(cfg: Config) -> None:
    """Each Slurm rank gets its own GPUs: a rollout rank tensor_parallel_size, a trainer
    rank one, every requested GPU in one rank's set (``slurm.py``). Raises ConfigError."""
    problem = slurm_layout_problem(cfg.slurm, cfg.rollout.tensor_parallel_size)
    if problem:
        raise ConfigError(problem)


def config_warnings(cfg: Config) -> list[str]:
    """Settings that can be right but are easy to get wrong: one line each, for the CLI."""
    warnings = []
    if cfg.rollout.engine == "vllm" and (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0):
        warnings.append(
            "rollout.engine=vllm with top_p < 1 or top_k > 0: its recorded log-probs are over the "
            "truncated distribution (unused by this config's loss, but not comparable with the "
            "trainer's)"
        )
    if (
        cfg.actor.policy_loss.loss_mode == "gspo"
        and cfg.actor.loss_agg_mode != "seq-mean-token-mean"
    ):
        warnings.append(
            f"actor.policy_loss.loss_mode=gspo aggregates its policy loss with seq-mean-token-mean "
            f"(as verl); actor.loss_agg_mode={cfg.actor.loss_agg_mode} applies to the entropy, "
            "KL and value terms only"
        )
    if cfg.async_training.mode == "fully_async" and cfg.async_training.max_staleness == 0:
        warnings.append(
            "async_training.max_staleness=0 in fully_async mode: every sample generated before "
            "the latest weight sync is dropped; async_training.mode=sync trains on-policy without "
            "the waste"
        )
    return warnings


def check_resume_compatible(previous: Config, cfg: Config) -> None:
    """A --resume must keep what the checkpoint's queued groups and data order depend on."""
    for key in RESUME_FIXED:
        before, after = _get(previous, key), _get(cfg, key)
        if before != after:
            raise ConfigError(
                f"--resume cannot change {key} (the run has {before!r}, the override {after!r}): "
                "its checkpoint's queued samples and data order depend on it; start a new run"
            )


# What a resumed run must keep: the shapes of queued sample groups, and the prompt list
# the data order walks (see check_resume_compatible).
RESUME_FIXED = (
    "rollout.n",
    "rollout.response_length",
    "data.task",
    "data.train",
    "data.num_prompts",
    "data.max_prompt_length",
    "data.filter_overlong_prompts",
)


# trainer.logger's names -> the package each needs (tensorboard: written when installed)
LOGGERS = {"console": None, "tensorboard": None, "wandb": "wandb", "mlflow": "mlflow"}


def check_loggers(names: list[str]) -> None:
    """Each of trainer.logger known, and its package installed here (the ranks share this
    install): a missing one is named with the extra that installs it."""
    import importlib.util

    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger: {name!r} is not one of: {', '.join(LOGGERS)}")
        module = LOGGERS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trainer.logger has {name!r} but {module} is not installed: "
                f"pip install 'hpc_asyncppo[{name}]' (or drop it from trainer.logger)"
            )


def check_agent(cfg: Config) -> None:
    """``data.agent``: what the gateway does not combine with (the function itself is
    imported where the task is, ``tasks/registry.py`` ``load_agent``)."""
    if cfg.rollout.multi_turn.enable:
        raise ConfigError(
            "data.agent runs your agent, which calls its own tools: set "
            "rollout.multi_turn.enable=false (the project's tools are for runs without an agent)"
        )


def validate(cfg: Config, rollout_ranks: int = 1, train_ranks: int = 1) -> None:
    """Check every value against its allowed range; raise ConfigError naming the first bad key."""
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not one of: {', '.join(choices)}")
    for key, (low, exclusive) in _LOWER_BOUNDS.items():
        value = _get(cfg, key)
        if value < low or (exclusive and value == low):
            raise ConfigError(f"{key}={value} must be {'>' if exclusive else '>='} {low}")
    for key, high in _UPPER_BOUNDS.items():
        if _get(cfg, key) > high:
            raise ConfigError(f"{key}={_get(cfg, key)} must be <= {high}")
    if (
        cfg.async_training.partial_rollout
        and cfg.rollout.engine != "vllm"
        and not cfg.rollout.hf_step_tokens
        and not cfg.rollout.multi_turn.enable
        and not cfg.data.agent
    ):
        # multi-turn, the hf engine's trajectories continue across syncs between two turns;
        # with hf_step_tokens, between two steps
        raise ConfigError(
            "async_training.partial_rollout=true needs rollout.engine=vllm, "
            "rollout.hf_step_tokens > 0, rollout.multi_turn.enable=true or data.agent (the "
            "hf engine generates a single-turn response whole: there is nothing to cut)"
        )
    if cfg.data.agent:
        check_agent(cfg)
    check_loggers(cfg.trainer.logger)
    turns = cfg.rollout.multi_turn
    if turns.tool_config_path and not turns.enable:
        raise ConfigError(
            "rollout.multi_turn.tool_config_path is set but rollout.multi_turn.enable=false: "
            "set rollout.multi_turn.enable=true to give the model its tools"
        )
    if turns.enable and not turns.tool_config_path:
        raise ConfigError(
            "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path=PATH "
            "(verl's tool YAML, see hpc_asyncppo/tools/base.py)"
        )
    if turns.enable:
        from hpc_asyncppo.tools.base import ToolConfigError, tool_schemas

        try:  # names, schemas and classes checked here; each tool's own config at start-up
            tool_schemas(tool_config_file(turns.tool_config_path))
        except ToolConfigError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.rollout.engine == "hf" and cfg.rollout.tensor_parallel_size > 1:
        raise ConfigError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")
    if cfg.rollout.engine == "hf" and cfg.rollout.hf_step_tokens and cfg.model.path:
        from hpc_asyncppo.config.model_shape import attention_kinds

        other = attention_kinds(cfg.model.path) - {"full_attention"}
        if other:
            raise ConfigError(
                f"rollout.hf_step_tokens={cfg.rollout.hf_step_tokens}: the hf engine's "
                f"continuous batching keeps a full KV cache per row, and {cfg.model.path} has "
                f"{', '.join(sorted(other))} layers: set rollout.hf_step_tokens=0 or "
                "rollout.engine=vllm"
            )
    if cfg.actor.lora_rank > 0 and "lm_head" in lora_targets(cfg.actor.target_modules):
        from hpc_asyncppo.config.model_shape import ModelShape

        shape = ModelShape.of(cfg.model.path) if cfg.model.path else None
        if shape is not None and shape.tied:
            raise ConfigError(
                f"actor.target_modules={cfg.actor.target_modules}: {cfg.model.path} ties its LM "
                "head to the input embeddings (tie_word_embeddings), so the rollout engines have "
                "no head of their own to merge an lm_head adapter into: drop lm_head from "
                "actor.target_modules"
            )
    tiny_head_dim = cfg.model.tiny.hidden_size // cfg.model.tiny.num_heads
    if cfg.rollout.engine == "vllm" and not cfg.model.path and tiny_head_dim not in VLLM_HEAD_DIMS:
        raise ConfigError(
            f"rollout.engine=vllm: the tiny model's head size (model.tiny.hidden_size / "
            f"model.tiny.num_heads = {tiny_head_dim}) is not one vLLM's CPU attention supports "
            f"({', '.join(map(str, VLLM_HEAD_DIMS))}); e.g. set model.tiny.num_heads=2"
        )
    if cfg.model.tiny.hidden_size % cfg.model.tiny.num_heads:
        raise ConfigError("model.tiny.hidden_size must be a multiple of model.tiny.num_heads")
    if cfg.trainer.test_freq and not cfg.data.val:
        raise ConfigError(
            f"trainer.test_freq={cfg.trainer.test_freq} validates on data.val, which is empty: "
            "set data.val=PATH (same format as data.train), or trainer.test_freq=0"
        )
    if cfg.checkpoint.save_hf_final and not cfg.checkpoint.save_final:
        raise ConfigError(
            "checkpoint.save_hf_final=true exports the final checkpoint: it needs "
            "checkpoint.save_final=true"
        )
    group_baseline = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
    if cfg.algorithm.adv_estimator in group_baseline and cfg.rollout.n < 2:
        raise ConfigError(
            f"rollout.n={cfg.rollout.n}: algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
            "needs at least 2 responses per prompt (its baseline is the group's other responses)"
        )
    _check_combinations(cfg)
    if rollout_ranks < 1 or train_ranks < 1:
        raise ConfigError("need at least one rollout rank and one trainer rank")
    if (cfg.actor.ppo_mini_batch_size * cfg.rollout.n) % train_ranks:
        raise ConfigError(
            f"actor.ppo_mini_batch_size * rollout.n = {cfg.actor.ppo_mini_batch_size * cfg.rollout.n} "
            f"responses per mini-batch do not split evenly over {train_ranks} trainer ranks"
        )
    if cfg.actor.use_dynamic_bsz:
        longest = cfg.data.max_prompt_length + cfg.rollout.response_length
        if cfg.actor.ppo_max_token_len_per_gpu < longest:
            raise ConfigError(
                f"actor.ppo_max_token_len_per_gpu={cfg.actor.ppo_max_token_len_per_gpu} is less "
                f"than one row can be (data.max_prompt_length + rollout.response_length = "
                f"{longest}): raise it"
            )
    if cfg.model.attn_implementation == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "model.attn_implementation=flash_attention_2 needs the flash-attn package "
                "(pip install flash-attn); or use sdpa"
            )
