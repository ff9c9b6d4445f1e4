"""The PPO update on a real tiny model: micro-batching, restore, and learning signal."""

import copy
import dataclasses

import numpy as np
import torch

from hpc_asyncppo.config import ActorConfig, Config, ModelConfig
from hpc_asyncppo.trainer.batch import to_tensors
from hpc_asyncppo.trainer.policy import Policy, ppo_update

CPU = torch.device("cpu")


def make_batch(rows=8, prompt=3, length=5, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, rows)
    return to_tensors(
        {
            "prompt_ids": rng.integers(4, 15, (rows, prompt)).astype(np.int32),
            "prompt_mask": np.ones((rows, prompt), dtype=np.int8),
            "response_ids": rng.integers(4, 15, (rows, length)).astype(np.int32),
            "response_mask": (np.arange(length)[None] < lengths[:, None]).astype(np.int8),
            "rollout_log_probs": -rng.random((rows, length)).astype(np.float32),
            "rewards": rng.random(rows).astype(np.float32),
            "advantages": rng.normal(size=rows).astype(np.float32),
        },
        CPU,
    )


def policy(model_dir, **actor):
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, model=ModelConfig(path=str(model_dir)), actor=ActorConfig(**actor)
    )
    torch.manual_seed(0)
    return Policy(cfg, CPU)


def test_micro_batches_accumulate_to_the_same_update(tiny_model_dir):
    """seq-mean-token-mean is a mean over rows: 4 micro-batches of 2 give the full batch's step."""
    batch = make_batch()
    mode = "seq-mean-token-mean"
    whole = policy(tiny_model_dir, loss_agg_mode=mode, grad_clip=0)
    micro = policy(tiny_model_dir, loss_agg_mode=mode, grad_clip=0, ppo_micro_batch_size_per_gpu=2)
    stats_whole = ppo_update(whole, batch, None, 1)
    stats_micro = ppo_update(micro, batch, None, 1)
    for (name, a), (_, b) in zip(
        whole.model.named_parameters(), micro.model.named_parameters(), strict=True
    ):
        # the accumulated gradients, left on the parameters after the step, agree
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-4), name
    assert abs(stats_whole["actor/pg_loss"] - stats_micro["actor/pg_loss"]) < 1e-6


def test_positive_advantage_raises_the_log_prob_of_its_tokens(tiny_model_dir):
    batch = make_batch(rows=4)
    batch["advantages"] = torch.tensor([1.0, 1.0, -1.0, -1.0])
    p = policy(tiny_model_dir, lr=1e-2)
    with torch.no_grad():
        before, _, _ = p.forward(p.model, batch)
    ppo_update(p, batch, None, 1)
    with torch.no_grad():
        after, _, _ = p.forward(p.model, batch)
    mask = batch["response_mask"].bool()
    change = [((after - before)[i][mask[i]]).mean().item() for i in range(4)]
    assert change[0] > 0 and change[1] > 0 and change[2] < 0 and change[3] < 0


def test_restore_reproduces_the_next_step_exactly(tiny_model_dir):
    a = policy(tiny_model_dir)
    ppo_update(a, make_batch(seed=1), None, 1)
    tree = copy.deepcopy(a.state_tree())  # a checkpoint holds copies, not the live tensors
    b = policy(tiny_model_dir)
    b.restore(tree, "memory")
    ppo_update(a, make_batch(seed=2), None, 1)
    ppo_update(b, make_batch(seed=2), None, 1)
    for (name, x), (_, y) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(x, y), name
