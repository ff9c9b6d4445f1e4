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
    unit, 0.9 GB per pair of layers, 1.9 GB of logits, 1.9 GB for AdamW's foreach step,
    21.7 GB on a trainer rank; the leader also holds the in-flight sync's bf16 copy of the
    weights (15.2 GB) and two 512 MiB buckets: 38.0 GB. At 2 ranks the leader needs 104.6."""
    shape = ModelShape.of(str(qwen_7b))
    terms = trainer_terms(recipe(qwen_7b), shape, 16)
    gb = {name.split(" (")[0]: round(b / GB, 1) for name, b in terms.items()}
    assert gb["fp32 weights, gradients and AdamW moments"] == 7.6
    assert gb["root unit gathered"] == 2.2
    assert gb["two decoder layers gathered"] == 0.9
    assert gb["logits of one chunk"] == 1.9
    assert gb["AdamW's foreach step: an fp32 copy of the shard"] == 1.9
    assert gb["the in-flight sync's copy of the weights"] == 15.2
    assert gb["the broadcaster's two bucket buffers"] == 1.1  # trainer.weight_sync_bucket_mb=512
    assert round(sum(terms.values()) / GB, 1) == 38.0
    assert (
        round(sum(trainer_terms(recipe(qwen_7b), shape, 16, leader=False).values()) / GB, 1) == 21.7
    )
    assert round(sum(trainer_terms(recipe(qwen_7b), shape, 2).values()) / GB, 1) == 104.6
    # fused AdamW: no copy of the shard; without in-flight updates one gathered tensor
    other = recipe(qwen_7b, "actor.optimizer_impl=fused",
                   "async_training.inflight_weight_update=false")  # fmt: skip
    names = set(trainer_terms(other, shape, 16))
    assert not any("AdamW's" in n or "in-flight" in n for n in names)
    assert "the largest tensor gathered for a sync" in names


def test_adamws_step_holds_what_the_estimate_says_on_the_cpu(tmp_path) -> None:
    """The optimizer's term against torch's AdamW on the CPU, the step's peak RSS over the
    steady state (parameters, gradients and moments already made): foreach makes an fp32
    copy of every parameter (4 bytes each), a loop one tensor's at a time, fused none.
    Each step is measured in a process forked for it (its high-water mark starts there)."""
    import subprocess
    import sys

    tensors, numel = 16, 2**20  # 64 MiB of fp32 parameters
    script = f"""
import json, os, resource, torch
torch.set_num_threads(1)  # no thread pool: the children below are forked
params = [torch.nn.Parameter(torch.full(({numel},), 0.5)) for _ in range({tensors})]
for p in params:
    p.grad = torch.full(({numel},), 0.1)
peak = {{}}
for impl, kw in (("foreach", dict(foreach=True)), ("for-loop", dict(foreach=False)),
                 ("fused", dict(fused=True))):
    read, write = os.pipe()
    if os.fork() == 0:  # each measured in a child of its own: its high-water mark starts here
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        for p in params:  # the moments as after a first step: none made in the step
            opt.state[p] = dict(step=torch.tensor(1.0), exp_avg=torch.zeros({numel}),
                                exp_avg_sq=torch.ones({numel}))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        opt.step()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        os.write(write, str(after - before).encode())
        os._exit(0)
    os.close(write)
    peak[impl] = int(os.read(read, 64))
    os.wait()
print(json.dumps(peak))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    peak = json.loads(done.stdout)
    shard = 4 * tensors * numel  # the estimate's 4 N / T, one rank
    assert 0.9 * shard <= peak["foreach"] <= 1.2 * shard, peak
    # a tensor at a time (its square root, then the quotient), and what malloc keeps of them
    assert peak["for-loop"] < peak["foreach"] * 0.75, peak
    assert peak["fused"] <= 0.1 * shard, peak  # a few MB of its own, whatever the size


@pytest.mark.parametrize("gpu_gb", [40, 80])
def test_the_7b_recipe_fits_40_and_80_gb_gpus(qwen_7b, gpu_gb) -> None:
    """No staging copy on the rollout GPU (the workers receive the sync themselves): 0.85 of
    a 40 GB GPU for vLLM leaves 6 GB, and a worker needs 3.2 GB beside it; the trainer
    leader's 38.0 GB fit both."""
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
    cfg = recipe(qwen_7b, "slurm.train.gpu_memory_gb=40")
    check_memory(cfg, 16)  # 38.0 GB on the leader
    with pytest.raises(
        ConfigError,
        match=r"the trainer leader \(of 4 trainer ranks\) needs "
        r"about 66\.5 GB .*optimizer_impl=fused",
    ):
        check_memory(cfg, 4)  # 30.5 GB of sharded state, 7.6 for AdamW's step, 15.2 in flight


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
    adapter state per rank, no reference, 16 GB on a trainer rank and 17.6 GB on the leader
    (its in-flight copy is the fp32 adapters); the same run without LoRA needs 30.5 GB of
    state and is refused on 40 GB GPUs."""
    terms = trainer_terms(lora_recipe(qwen_7b), ModelShape.of(str(qwen_7b)), 4)
    gb = {name.split(" (")[0]: round(b / GB, 1) for name, b in terms.items()}
    assert gb["frozen base in bfloat16"] == 3.8
    assert gb["fp32 adapters, gradients and AdamW moments"] == 0.6
    assert not any("reference" in name for name in terms)
    assert round(sum(terms.values()) / GB, 1) == 17.6
    sizes = ["slurm.rollout.gpu_memory_gb=40", "slurm.train.gpu_memory_gb=40"]
    check_memory(lora_recipe(qwen_7b, *sizes, "actor.use_kl_loss=true"), 4)
    with pytest.raises(ConfigError, match=r"fp32 weights, gradients and AdamW moments"):
        check_memory(lora_recipe(qwen_7b, *sizes, "actor.lora_rank=0"), 4)
