"""The memory check (``hpc_asyncppo/memory.py``) on the 7B recipe with Qwen2.5-7B's sizes:
the terms the recipe writes out, and where it refuses and accepts a declared GPU size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_asyncppo.config import ConfigError, load_config
from hpc_asyncppo.memory import GB, ModelShape, check_memory, trainer_terms
from tests.conftest import QWEN2_5_7B_CONFIG


@pytest.fixture
def qwen_7b(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_7B_CONFIG))
    return tmp_path


def recipe(model: Path, *overrides: str):
    return load_config("qwen2.5-7b-gsm8k", [f"model.path={model}", *overrides], 8, 16)


def test_the_shape_counts_qwen_7b_parameters(qwen_7b) -> None:
    shape = ModelShape.of(str(qwen_7b))
    assert shape is not None
    assert abs(shape.params - 7.6156e9) < 0.001e9  # Qwen2.5-7B: 7.62B with its q/k/v biases


def test_the_trainer_terms_are_the_recipes_arithmetic(qwen_7b) -> None:
    """configs/qwen2.5-7b-gsm8k.yaml: 7.6 GB of sharded state over 16 ranks, 2.2 GB of root
    unit, 0.9 GB per pair of layers, 1.9 GB of logits, about 19 GB in all."""
    terms = trainer_terms(recipe(qwen_7b), ModelShape.of(str(qwen_7b)), 16)
    gb = {name.split(" (")[0]: round(b / GB, 1) for name, b in terms.items()}
    assert gb["fp32 weights, gradients and AdamW moments"] == 7.6
    assert gb["root unit gathered"] == 2.2
    assert gb["two decoder layers gathered"] == 0.9
    assert gb["logits of one chunk"] == 1.9
    assert 18 < sum(terms.values()) / GB < 21


@pytest.mark.parametrize("gpu_gb", [40, 80])
def test_the_7b_recipe_fits_40_and_80_gb_gpus(qwen_7b, gpu_gb) -> None:
    """No staging copy on the rollout GPU (the workers receive the sync themselves): 0.85 of
    a 40 GB GPU for vLLM leaves 6 GB, and a worker needs 3.2 GB beside it."""
    keys = [f"slurm.rollout.gpu_memory_gb={gpu_gb}", f"slurm.train.gpu_memory_gb={gpu_gb}"]
    check_memory(recipe(qwen_7b, *keys), 16)


def test_a_16_gb_rollout_gpu_is_refused_with_the_utilization_that_fits(qwen_7b) -> None:
    with pytest.raises(ConfigError, match=r"needs 3\.2 GB .* leaves 2\.4 GB: lower it to 0\.80"):
        check_memory(recipe(qwen_7b, "slurm.rollout.gpu_memory_gb=16"), 16)
    # and that utilization is accepted
    check_memory(
        recipe(qwen_7b, "slurm.rollout.gpu_memory_gb=16", "rollout.gpu_memory_utilization=0.8"),
        16,
    )


def test_weights_that_do_not_fit_vllms_share_ask_for_more_tensor_parallelism(qwen_7b) -> None:
    # TP 2: 7.6 GB of bf16 weights per worker, and 1 GB of KV, in 0.5 x 16 GB
    cfg = recipe(qwen_7b, "slurm.rollout.gpu_memory_gb=16", "rollout.gpu_memory_utilization=0.5")
    with pytest.raises(ConfigError, match=r"\(7\.6 GB\) .* raise rollout.tensor_parallel_size"):
        check_memory(cfg, 16)


def test_trainer_ranks_decide_whether_the_state_fits(qwen_7b) -> None:
    cfg = recipe(qwen_7b, "slurm.train.gpu_memory_gb=24")
    check_memory(cfg, 16)  # 19.8 GB each
    with pytest.raises(ConfigError, match="each of 4 trainer ranks needs about 42"):
        check_memory(cfg, 4)  # 30.5 GB of sharded state alone


def test_no_declared_size_or_no_readable_config_checks_nothing(qwen_7b, tmp_path) -> None:
    check_memory(recipe(qwen_7b), 1)  # 122 GB of state on one rank, but no size declared
    check_memory(recipe(tmp_path / "absent", "slurm.train.gpu_memory_gb=1"), 1)


def lora_recipe(model: Path, *overrides: str):
    return load_config("grpo-lora-qwen2.5-7b-gsm8k", [f"model.path={model}", *overrides], 4, 4)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj,lm_head"])
def test_the_adapter_count_is_what_peft_puts_into_qwen_7b(qwen_7b, targets) -> None:
    """The arithmetic's L against peft's own injection into Qwen2.5-7B (on the meta device)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpc_asyncppo.models import lora

    with torch.device("meta"):
        lm = Qwen2ForCausalLM(Qwen2Config(**QWEN2_5_7B_CONFIG))
    lora.inject(lm, 64, 32.0, targets, 0.0)
    injected = sum(p.numel() for n, p in lm.named_parameters() if lora.is_adapter(n))
    assert ModelShape.of(str(qwen_7b)).lora_params(64, targets) == injected
    if targets == "all-linear":
        assert abs(injected - 1.615e8) < 0.001e8  # the recipe's L


def test_lora_fits_4_trainer_ranks_of_40_gb_where_full_fine_tuning_does_not(qwen_7b) -> None:
    """configs/grpo-lora-qwen2.5-7b-gsm8k.yaml: 3.8 GB of frozen bf16 base and 0.6 GB of
    adapter state per rank, no reference, about 16 GB in all; the same run without LoRA
    needs 30.5 GB of state and is refused on 40 GB GPUs."""
    terms = trainer_terms(lora_recipe(qwen_7b), ModelShape.of(str(qwen_7b)), 4)
    gb = {name.split(" (")[0]: round(b / GB, 1) for name, b in terms.items()}
    assert gb["frozen base in bfloat16"] == 3.8
    assert gb["fp32 adapters, gradients and AdamW moments"] == 0.6
    assert not any("reference" in name for name in terms)
    assert 15 < sum(terms.values()) / GB < 17
    sizes = ["slurm.rollout.gpu_memory_gb=40", "slurm.train.gpu_memory_gb=40"]
    check_memory(lora_recipe(qwen_7b, *sizes, "actor.use_kl_loss=true"), 4)
    with pytest.raises(ConfigError, match=r"fp32 weights, gradients and AdamW moments"):
        check_memory(lora_recipe(qwen_7b, *sizes, "actor.lora_rank=0"), 4)
