import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_asyncppo.config import CONFIG_DIR, Config, ConfigError, load_config, load_resolved, to_yaml


def test_defaults_validate_and_derive_verl_quantities():
    cfg = load_config()
    assert cfg.required_groups == cfg.actor.ppo_mini_batch_size * cfg.async_training.require_batches
    # verl: required * (1 + staleness_threshold) * trigger_parameter_sync_step = 16 * 1.5 * 4
    assert cfg.max_required_groups == 96
    assert cfg.sync_every == 4


def test_sync_mode_is_on_policy_whatever_the_async_knobs_say():
    cfg = load_config(
        overrides=["async_training.mode=sync", "async_training.staleness_threshold=0.5"]
    )
    assert cfg.sync_every == 1
    assert cfg.max_required_groups == cfg.required_groups


def test_override_types_are_converted():
    cfg = load_config(
        overrides=["actor.lr=0.5", "async_training.partial_rollout=false", "rollout.n=3"]
    )
    assert cfg.actor.lr == 0.5 and cfg.rollout.n == 3


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.lrr=1", "unknown config key 'actor.lrr'"),
        ("bogus=1", "unknown config key 'bogus'"),
        ("actor.lr=abc", "invalid value for config key 'actor.lr'"),
        (
            "async_training.mode=chaos",
            "async_training.mode='chaos' is not one of: fully_async, sync",
        ),
        ("rollout.n=0", "rollout.n=0 must be >= 1"),
        ("rollout.max_num_seqs=-1", "rollout.max_num_seqs=-1 must be >= 0"),
        ("rollout.max_num_batched_tokens=-8", "rollout.max_num_batched_tokens=-8 must be >= 0"),
        ("actor.clip_ratio_c=1", "actor.clip_ratio_c=1.0 must be > 1"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be <= 1.0"),
        ("async_training.staleness_threshold=-0.1", "must be >= 0"),
        ("actor.loss_agg_mode=mean", "token-mean, seq-mean-token-sum, seq-mean-token-mean"),
        ("actor.policy_loss.loss_mode=gpg", "actor.policy_loss.loss_mode='gpg' is not one of"),
        ("actor.kl_loss_type=full", "k1, kl, k2, mse, k3, low_var_kl, abs, k1+"),
        ("algorithm.adv_estimator=remax", "rloo, reinforce_plus_plus, reinforce_plus_plus_base"),
        ("algorithm.rollout_rs=seq", "algorithm.rollout_rs='seq' is not one of"),
        ("algorithm.rollout_rs_threshold=0", "algorithm.rollout_rs_threshold=0.0 must be > 0"),
        ("algorithm.filter_groups.metric=reward", "acc, score, seq_reward, seq_final_reward"),
        ("algorithm.filter_groups.max_num_gen_batches=-1", "max_num_gen_batches=-1 must be >= 0"),
        ("reward.overlong_buffer.penalty_factor=-1", "penalty_factor=-1.0 must be >= 0"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["async_training.staleness=0.2"])
    assert "staleness_threshold" in str(info.value) and "trigger_parameter_sync_step" in str(
        info.value
    )


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: 0.1\n  nope: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.nope' \(in .*bad.yaml\)"):
        load_config(bad)


def test_batch_must_split_over_trainer_ranks():
    # 16 prompts x 8 responses = 128 samples: fine for 2 trainer ranks, not for 3
    load_config(train_ranks=2)
    with pytest.raises(ConfigError, match="do not split evenly over 3 trainer ranks"):
        load_config(train_ranks=3)


def test_every_shipped_yaml_loads(tmp_path):
    shipped = sorted(CONFIG_DIR.glob("*.yaml"))
    for path in shipped:
        load_config(path)


def _flat(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.structured(cfg))

    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(walk(tree))


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        (
            "dapo-qwen2.5-7b-gsm8k",
            {
                "algorithm.filter_groups.enable": True,
                "algorithm.filter_groups.max_num_gen_batches": 10,
                "reward.overlong_buffer.enable": True,
                "reward.overlong_buffer.len": 256,
            },
        ),
        (
            "gspo-qwen2.5-7b-gsm8k",
            {
                "actor.policy_loss.loss_mode": "gspo",
                "actor.clip_ratio_low": 3e-4,
                "actor.clip_ratio_high": 4e-4,
                "actor.loss_agg_mode": "seq-mean-token-mean",
            },
        ),
    ],
)
def test_recipe_configs_change_only_what_their_comment_says(name, changes):
    """Each recipe config is the GRPO 7B starting point plus exactly its recipe's keys."""
    from hpc_asyncppo.config import config_warnings

    base, recipe = _flat(load_config("qwen2.5-7b-gsm8k")), _flat(load_config(name))
    assert {k: v for k, v in recipe.items() if base[k] != v} == changes
    header = (CONFIG_DIR / f"{name}.yaml").read_text().split("\nmodel:")[0]
    assert "qwen2.5-7b-gsm8k.yaml" in header  # says what it starts from
    assert config_warnings(load_config(name)) == []


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["actor.lr=0.25", "model.path=/x"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_resolved(path) == cfg
    assert isinstance(load_resolved(path), Config)


def test_cli_rejects_bad_key_in_one_line_before_any_rank_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_asyncppo.submit",
            "--cluster",
            "local",
            "--run-dir",
            str(run_dir),
            "actor.lrr=1",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown config key 'actor.lrr'" in proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["async_training.partial_rollout=true"], "partial_rollout=true needs rollout.engine=vllm"),
        (["rollout.tensor_parallel_size=2"], "tensor_parallel_size > 1 needs rollout.engine=vllm"),
        (["rollout.engine=vllm"], "head size"),  # the tiny model's 64/4 = 16
    ],
)
def test_engine_specific_settings_are_checked(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(overrides=overrides)
    load_config(
        overrides=[
            "rollout.engine=vllm",
            "model.tiny.num_heads=2",
            "async_training.partial_rollout=true",
        ]
    )


def model_folder(where: Path, **fields) -> Path:
    """A model folder with only a config.json (a small decoder's sizes, then ``fields``):
    what the config's checks read of a model."""
    where.mkdir()
    config = {"vocab_size": 64, "hidden_size": 8, "num_hidden_layers": 2,
              "intermediate_size": 16, "num_attention_heads": 2, **fields}  # fmt: skip
    (where / "config.json").write_text(json.dumps(config))
    return where


def test_a_lora_on_a_tied_lm_head_is_refused(tmp_path):
    """Qwen2.5-0.5B ties its LM head to the embeddings: an lm_head adapter would have no head
    of its own to merge into on the rollout side, so the config says so before any rank."""
    for tied in (True, False):
        model = model_folder(tmp_path / f"tied_{tied}", tie_word_embeddings=tied)
        lora = [f"model.path={model}", "actor.lora_rank=8"]
        load_config(overrides=[*lora, "actor.target_modules=all-linear"])
        head = [*lora, "actor.target_modules=all-linear,lm_head"]
        if tied:
            with pytest.raises(ConfigError, match="drop lm_head from actor.target_modules"):
                load_config(overrides=head)
        else:
            load_config(overrides=head)


def test_continuous_hf_steps_on_a_sliding_window_model_are_refused(tmp_path):
    """The hf engine's continuous batching holds a full KV cache per row: a model whose
    config declares sliding-window layers is refused before any rank, one that does not
    passes."""
    for sliding in (True, False):
        model = model_folder(tmp_path / f"sliding_{sliding}", use_sliding_window=sliding)
        steps = [f"model.path={model}", "rollout.hf_step_tokens=4"]
        load_config(overrides=[f"model.path={model}"])
        if sliding:
            with pytest.raises(ConfigError, match="sliding_attention layers: set rollout.hf_step"):
                load_config(overrides=steps)
        else:
            load_config(overrides=steps)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [
                "rollout.engine=vllm",
                "model.tiny.num_heads=2",
                "rollout.top_k=5",
                "async_training.use_rollout_log_probs=true",
            ],
            "truncated distribution",
        ),  # fmt: skip
        (["async_training.use_rollout_log_probs=true", "algorithm.rollout_is=sequence"], "all 1"),
        (
            [
                "async_training.use_rollout_log_probs=true",
                "algorithm.rollout_is=none",
                "algorithm.rollout_rs=token",
            ],
            "nothing rejected",
        ),
        (
            [
                "rollout.engine=vllm",
                "model.tiny.num_heads=2",
                "rollout.top_p=0.9",
                "algorithm.rollout_rs=geometric",
                "algorithm.rollout_rs_threshold=1.001",
            ],
            "truncated distribution",
        ),  # fmt: skip
        (
            ["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold=0.5"],
            "rollout_rs_threshold_lower=2 .* must be below algorithm.rollout_rs_threshold=0.5",
        ),
        (
            ["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold_lower=3"],
            "rollout_rs_threshold_lower=3 .* must be below",
        ),
        (
            ["algorithm.rollout_is=sequence", "algorithm.rollout_is_mode=mask"],
            "rollout_is_mode=mask works per token, not with algorithm.rollout_is=sequence",
        ),
        (
            ["algorithm.rollout_is_mode=mask", "algorithm.rollout_is_threshold_lower=2"],
            "rollout_is_threshold_lower=2 must be at least 0 and below",
        ),
        (
            ["algorithm.rollout_is_threshold_lower=0.5"],
            "the bound of algorithm.rollout_is_mode=mask",
        ),
        (["algorithm.rollout_is_mode=clip"], "rollout_is_mode"),
        (["algorithm.m2po_threshold=0"], "m2po_threshold=0 must be > 0"),
        (
            [
                "async_training.use_rollout_log_probs=true",
                "algorithm.rollout_is=none",
                "algorithm.m2po_threshold=0.04",
            ],
            "M2PO would compare the rollout's log-probs with themselves",
        ),
        (["reward.overlong_buffer.enable=true"], "overlong_buffer.len=0 must be between 1 and"),
        (
            ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=7"],
            "rollout.response_length=6",
        ),
        (["algorithm.adv_estimator=rloo", "rollout.n=1"], "rloo needs at least 2 responses"),
        (
            ["rollout.max_num_seqs=64", "rollout.max_num_batched_tokens=32"],
            "max_num_batched_tokens=32 is below rollout.max_num_seqs=64",
        ),
        (
            [
                "rollout.engine=vllm",
                "model.tiny.num_heads=2",
                "rollout.tensor_parallel_size=2",
                "slurm.rollout.gpus_per_node=4",
            ],
            "each rollout rank has 1 GPU",
        ),  # fmt: skip
        (["trainer.test_freq=50"], "trainer.test_freq=50 validates on data.val, which is empty"),
        (
            ["checkpoint.save_hf_final=true", "checkpoint.save_final=false"],
            "needs checkpoint.save_final=true",
        ),
        (["rollout.val_n=0"], "rollout.val_n=0 must be >= 1"),
        (["rollout.val_temperature=-1"], "rollout.val_temperature=-1.0 must be >= 0"),
    ],
)
def test_combinations_that_cannot_be_right_are_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(overrides=overrides)
    assert "\n" not in str(info.value)


def test_recipe_keys_load_with_verl_names():
    cfg = load_config(
        overrides=[
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=seq_reward",
            "algorithm.filter_groups.max_num_gen_batches=10",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=2",
            "reward.overlong_buffer.penalty_factor=0.5",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.rollout_rs=geometric",
            "algorithm.rollout_rs_threshold=1.001",
            "actor.policy_loss.loss_mode=gspo",
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor.kl_loss_type=k3+",
        ]
    )
    assert cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert cfg.reward.overlong_buffer.len == 2
    assert cfg.algorithm.rollout_rs_threshold_lower is None  # 1 / upper, as verl
    # REINFORCE++ has no group baseline: one response per prompt is fine
    load_config(overrides=["algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1"])


def test_combinations_that_can_be_right_load_with_a_warning():
    from hpc_asyncppo.config import config_warnings

    vllm = ["rollout.engine=vllm", "model.tiny.num_heads=2"]
    # rollout log-probs unused: no correction, no rollout log-probs as old ones
    cfg = load_config(overrides=[*vllm, "rollout.top_p=0.9", "algorithm.rollout_is=none"])
    assert [w for w in config_warnings(cfg) if "truncated" in w]
    # two GPUs per rank for TP 2: fine
    load_config(overrides=[*vllm, "rollout.tensor_parallel_size=2",
                           "slurm.rollout.gpus_per_node=4", "slurm.rollout.ntasks_per_node=2",
                           "slurm.train.gpus_per_node=1"])  # fmt: skip
    assert config_warnings(load_config()) == []
    gspo = load_config(overrides=["actor.policy_loss.loss_mode=gspo"])  # token-mean default
    assert [w for w in config_warnings(gspo) if "entropy, KL and value terms only" in w]
    gspo = load_config(
        overrides=["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"]
    )
    assert config_warnings(gspo) == []


def test_resume_keeps_what_the_checkpoint_depends_on():
    from hpc_asyncppo.config import check_resume_compatible

    before = load_config()
    check_resume_compatible(before, load_config(overrides=["trainer.total_steps=600"]))
    with pytest.raises(ConfigError, match=r"--resume cannot change rollout.n \(the run has 8"):
        check_resume_compatible(before, load_config(overrides=["rollout.n=4"]))
