"""LoRA on the real tiny Llama (models/lora.py): the base never changes, only the adapters
train and cross the sync, the rollout's merged weights give the trainer's log-probs, the
reference is the base, and the adapters' state survives a checkpoint round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_asyncppo.checkpoint.store import CheckpointError, TreeReader
from hpc_asyncppo.config import Config
from hpc_asyncppo.gpu_check import random_batch
from hpc_asyncppo.models import lora
from hpc_asyncppo.models.dtypes import DTYPES
from hpc_asyncppo.trainer.batch import to_tensors
from hpc_asyncppo.trainer.model import PolicyModule, gather_full
from hpc_asyncppo.trainer.policy import Policy, ppo_update

CPU = torch.device("cpu")
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2}


def make_cfg(model_dir: Path, dtype: str = "float32", **actor) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(model_dir), dtype=dtype),
        actor=dataclasses.replace(cfg.actor, **{**LORA, **actor}),
    )


def batch_with_advantages(seed: int = 0) -> dict[str, torch.Tensor]:
    batch = to_tensors(random_batch(8, seed, 4, 6), CPU)
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8)
    return batch


def whole(policy: Policy, base: bool) -> dict[str, torch.Tensor]:
    """The base's (or the adapters') parameters, whole."""
    return {
        n: gather_full(p.detach()).clone()
        for n, p in policy.resharded().lm.named_parameters()
        if lora.is_adapter(n) != base
    }


def rollout_model(model_dir: Path, policy: Policy, dtype: str) -> torch.nn.Module:
    """An HF model of the base with the adapters the policy would sync merged in, as a
    rollout engine loads them (``lora.merged_weights`` over the base's files)."""
    adapters = dict(policy.named_weights())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    base = lora.BaseWeights(model_dir)
    merged = dict(lora.merged_weights(adapters, base.read(), DTYPES[dtype]))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in merged.items():
            params[name].copy_(tensor)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_updates_train_the_adapters_only_and_the_merged_rollout_weights_agree(
    tiny_model_dir, dtype
):
    torch.manual_seed(0)
    policy = Policy(make_cfg(tiny_model_dir, dtype), CPU)
    base_before, adapters_before = whole(policy, True), whole(policy, False)
    assert all(p.dtype == DTYPES[dtype] for p in base_before.values())
    assert all(p.dtype == torch.float32 for p in adapters_before.values())
    # only the adapters have optimizer state: 16 bytes per adapter parameter, not per weight
    batch = batch_with_advantages()
    for _ in range(3):
        assert ppo_update(policy, batch) is not None
    base_after, adapters_after = whole(policy, True), whole(policy, False)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    changed = [n for n in adapters_before if not torch.equal(adapters_before[n], adapters_after[n])]
    assert len(changed) == len(adapters_before), "every adapter trains (B from zero, A after)"
    state = [v for s in policy.optimizer.state.values() for v in s.values() if v.dim()]
    assert sum(v.numel() for v in state) == 2 * sum(p.numel() for p in adapters_after.values())

    # the sync: adapters only, a small fraction of the model's bytes
    sent = dict(policy.named_weights())
    assert sorted(sent) == sorted(n for n, _, _ in policy.weight_specs())
    assert all(n.endswith((lora.LORA_A, lora.LORA_B)) for n in sent)
    sent_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    model_bytes = sum(t.numel() * t.element_size() for t in base_after.values())
    assert sent_bytes < model_bytes / 4, (sent_bytes, model_bytes)

    # the rollout's merged weights give the trainer's log-probs (the adapted model's)
    model = rollout_model(tiny_model_dir, policy, dtype)
    rollout = PolicyModule(model, None)
    with torch.no_grad():
        mine = policy.forward(batch)[0]
        theirs = rollout(batch, policy.cfg.rollout.temperature, 1024)[0]
        base_lp = policy.forward(batch, reference=True)[0]
    mask = batch["response_mask"].bool()
    tolerance = 1e-4 if dtype == "float32" else 0.1
    assert (mine - theirs)[mask].abs().max() < tolerance
    # and the updates moved them away from the base (the test has teeth)
    assert (mine - base_lp)[mask].abs().max() > 10 * tolerance


def test_the_reference_is_the_base_model(tiny_model_dir):
    """With use_kl_loss the reference is the base with the adapters off (no second model):
    after updates its log-probs are those of the untouched base model."""
    torch.manual_seed(0)
    policy = Policy(make_cfg(tiny_model_dir, use_kl_loss=True), CPU)
    assert policy.reference is None and policy.has_reference
    batch = batch_with_advantages()
    with torch.no_grad():
        start = policy.forward(batch)[0]
    for _ in range(2):
        stats = ppo_update(policy, batch)
    assert stats is not None and stats["actor/kl_loss"] > 0
    base = PolicyModule(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None)
    with torch.no_grad():
        ref = policy.forward(batch, reference=True)[0]
        plain = base(batch, policy.cfg.rollout.temperature, 1024)[0]
        now = policy.forward(batch)[0]
    mask = batch["response_mask"].bool()
    assert (ref - plain)[mask].abs().max() < 1e-5
    assert (start - plain)[mask].abs().max() < 1e-5  # B starts at zero: the base
    assert (now - plain)[mask].abs().max() > 1e-3


def test_a_checkpoint_holds_the_adapters_their_optimizer_and_the_base_it_belongs_to(
    tiny_model_dir, tmp_path
):
    torch.manual_seed(0)
    cfg = make_cfg(tiny_model_dir)
    policy = Policy(cfg, CPU)
    batch = batch_with_advantages()
    ppo_update(policy, batch)
    tree = policy.state_dict()
    assert sorted(tree["model"]) == sorted(
        n for n, p in policy.model.named_parameters() if p.requires_grad
    )
    assert all(lora.is_adapter(n) for n in tree["model"])
    restored = Policy(cfg, CPU)
    restored.load_state_dict(TreeReader(tree))
    after = {}
    for p in (policy, restored):  # the same next update from the same state
        ppo_update(p, batch)
        after[id(p)] = whole(p, False)
    a, b = after[id(policy)], after[id(restored)]
    assert all(torch.equal(a[n], b[n]) for n in a)

    # adapters of another base model are refused, naming both
    other = tmp_path / "other"
    other.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x00\x00\x00\x40"  # one weight changed (to 2.0: the last is a norm, 1.0)
    weights.write_bytes(bytes(data))
    elsewhere = Policy(make_cfg(other), CPU)
    with pytest.raises(CheckpointError, match="holds LoRA adapters of the base model at"):
        elsewhere.load_state_dict(TreeReader(tree))


def test_a_sync_with_an_unpaired_adapter_is_refused(tiny_model_dir):
    torch.manual_seed(0)
    sent = dict(Policy(make_cfg(tiny_model_dir), CPU).named_weights())
    sent.pop(next(n for n in sent if n.endswith(lora.LORA_B)))
    base = lora.BaseWeights(tiny_model_dir)
    with pytest.raises(ValueError, match="unpaired"):
        list(lora.merged_weights(sent, base.read(), torch.float32))


def test_a_targeted_module_brings_the_rest_of_its_fused_layer_and_nothing_else():
    """vLLM loads a layer whole: ``q_proj`` is part of ``qkv_proj``, so a q_proj adapter's
    sync carries q, k and v (weights and biases, Qwen2's layout); ``down_proj`` is a layer of
    its own; untouched layers (``o_proj``, the MLP's gate and up, the norm) stay out."""
    attention = [
        f"model.layers.0.self_attn.{m}_proj.{k}" for m in "qkv" for k in ("weight", "bias")
    ]
    mlp = [f"model.layers.0.mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
    names = [*attention, "model.layers.0.self_attn.o_proj.weight", *mlp, "model.norm.weight"]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]
    assert lora.layer_tensors(names, modules, packed) == [*attention, mlp[2]]
    # an engine that loads tensor by tensor (none fused): the targets alone
    assert lora.layer_tensors(names, ["model.layers.0.mlp.up_proj"], {}) == [mlp[1]]
