"""The sharded PPO update on a real tiny Llama: an update that does not depend on how the
batch is split over trainer ranks (real gloo processes) and micro-batches, restore, and the
learning signal."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.checkpoint.store import TreeReader
from hpc_asyncppo.config import Config, PolicyLossConfig
from hpc_asyncppo.gpu_check import random_batch
from hpc_asyncppo.trainer import algos
from hpc_asyncppo.trainer.batch import shard_rows, to_tensors
from hpc_asyncppo.trainer.model import gather_full
from hpc_asyncppo.trainer.policy import (
    Policy,
    accumulate_gradients,
    mini_batch_plans,
    ppo_update,
    reference_quantities,
)
from tests.conftest import end_spawned_rank, free_port

CPU = torch.device("cpu")


def make_batch(
    rows: int = 16, prompt: int = 4, length: int = 6, seed: int = 0, holes: bool = False
) -> dict:
    """Rows with prompts of 1..prompt tokens (left-padded) and responses of 1..length tokens.
    ``holes``: multi-turn rows, as ``collate`` lays them out: in every response of 4 tokens
    or more, tokens 1 and 2 are an observation (context, never trained)."""
    batch = random_batch(rows, seed, prompt, length)
    if holes:
        attention = batch["response_mask"]
        trained = attention.copy()
        trained[attention.sum(axis=1) >= 4, 1:3] = 0
        batch["response_attention"], batch["response_mask"] = attention, trained
    return batch


def make_cfg(model_dir: Path, **sections: dict) -> Config:
    cfg = Config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    for name, values in sections.items():
        cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)})
    return cfg


def full_gradients(policy: Policy) -> dict[str, np.ndarray]:
    """Every parameter's whole gradient (collective over the policy's ranks)."""
    return {
        name: gather_full(p.grad).numpy().copy()
        for name, p in policy.module.named_parameters()
        if p.requires_grad  # with LoRA: the adapters
    }


# Splits of one 16-row mini-batch: (trainer ranks, actor settings, packed rows:
# model.use_remove_padding, the default). Each must give the gradients (and loss) of the
# whole batch, padded, on one rank in one micro-batch: the token-budget splits pack their
# rows (one and two ranks), the others pad them.
SPLITS = {
    "whole": (1, {}, False),
    "micro2": (1, {"ppo_micro_batch_size_per_gpu": 2}, False),
    "dynamic_packed": (1, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 24}, True),
    "2ranks_micro4": (2, {"ppo_micro_batch_size_per_gpu": 4}, False),
    "2ranks_micro3": (2, {"ppo_micro_batch_size_per_gpu": 3}, False),
    "2ranks_dynamic_packed": (2, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 20}, True),
}
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ALGOS = {
    "grpo": {},
    "gae_kl_entropy": {
        "algorithm": {"adv_estimator": "gae"},
        "actor": {"use_kl_loss": True, "entropy_coeff": 0.01},
    },
    # rejection sampling takes tokens (geometric: whole responses) out of every loss term and
    # out of the normalisers; the thresholds keep about half of this batch (the tiny model's
    # old / rollout ratios lie around 0.07-0.2; see test_rejection_sampling_masks_part)
    "gspo_kl_entropy_geometric_rs": {
        "algorithm": {
            "rollout_rs": "geometric",
            "rollout_rs_threshold": 0.13,
            "rollout_rs_threshold_lower": 0.09,
        },
        "actor": {
            "policy_loss": PolicyLossConfig(loss_mode="gspo"),
            "use_kl_loss": True,
            "kl_loss_type": "k3+",
            "entropy_coeff": 0.01,
        },
    },
    # the corrections for stale samples: M2PO takes the tokens of the largest squared
    # old / rollout log-ratios out of the loss and the normalisers (a selection over the
    # whole batch, both ranks' tokens), the masked importance weights (IcePop's form) zero
    # those outside [0.1, 0.15] and keep them in the normalisers; each masks part of this
    # batch (test_the_corrections_mask_part_of_the_batch)
    "grpo_m2po_masked_is": {
        "algorithm": {
            "m2po_threshold": 4.0,
            "rollout_is_mode": "mask",
            "rollout_is_threshold": 0.15,
            "rollout_is_threshold_lower": 0.1,
        },
    },
    # LoRA adapters on the frozen base, the KL reference being the base with them off
    "lora_kl": {"actor": {"lora_rank": 4, "lora_alpha": 8.0, "use_kl_loss": True}},
    "reinforce_pp_token_rs": {
        "algorithm": {
            "adv_estimator": "reinforce_plus_plus",
            "gamma": 0.9,
            "rollout_rs": "token",
            "rollout_rs_threshold": 0.15,
            "rollout_rs_threshold_lower": 0.09,
        },
    },
}
# (mode, algorithm) pairs each split is checked on: every mode with GRPO and GAE, the
# recipes with the modes whose normalisers they change most
COMBOS = [(mode, algo) for mode in MODES for algo in ("grpo", "gae_kl_entropy")] + [
    ("token-mean", "gspo_kl_entropy_geometric_rs"),
    ("seq-mean-token-sum-norm", "gspo_kl_entropy_geometric_rs"),
    ("token-mean", "reinforce_pp_token_rs"),
    ("seq-mean-token-sum", "reinforce_pp_token_rs"),
    ("token-mean", "lora_kl"),
    ("seq-mean-token-sum-norm", "lora_kl"),
    ("token-mean", "grpo_m2po_masked_is"),
    ("seq-mean-token-mean", "grpo_m2po_masked_is"),
]
# multi-turn batches (observation holes): every mode, and each per-token estimator
HOLES = [(mode, "grpo") for mode in MODES] + [
    ("seq-mean-token-mean", "gae_kl_entropy"),
    ("seq-mean-token-sum", "reinforce_pp_token_rs"),
]


def _gradient_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    batches = {"": make_batch(), "-holes": make_batch(holes=True)}
    cases = [(m, a, "") for m, a in COMBOS] + [(m, a, "-holes") for m, a in HOLES]
    for split, (ranks, actor, packed) in SPLITS.items():
        if ranks != world:
            continue
        for mode, algo, kind in cases:
            batch = batches[kind]
            sections = {k: dict(v) for k, v in ALGOS[algo].items()}
            sections["actor"] = {**sections.get("actor", {}), **actor, "loss_agg_mode": mode}
            sections["model"] = {"use_remove_padding": packed}
            policy = Policy(make_cfg(Path(model_dir), **sections), CPU)
            mine = to_tensors(shard_rows(batch, world, 1)[rank], CPU)
            plans = mini_batch_plans(policy, mine)
            merged = {**mine, **reference_quantities(policy, mine, plans)}
            stats = accumulate_gradients(policy, merged, plans[0])
            grads = full_gradients(policy)
            loss = policy.all_reduce(stats["actor/pg_loss"].reshape(1).cpu())
            counted = {}
            for key in ("rs_keep", "m2po_keep", "is_weights"):
                if key in merged:  # the tokens each masks (the weights: those at 0)
                    keep = (merged[key] > 0).double() if key == "is_weights" else merged[key]
                    counts = algos.rejection_counts(keep, mine["response_mask"])
                    counted[key.split("_")[0] + "_counts"] = policy.all_reduce(counts)
            if rank == 0:
                grads["pg_loss"] = loss.numpy()
                grads.update({k: v.numpy() for k, v in counted.items()})
                np.savez(Path(out) / f"{split}-{mode}-{algo}{kind}.npz", **grads)
    end_spawned_rank()


@pytest.fixture(scope="module")
def split_gradients(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grads")
    for world in (1, 2):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.start_processes(
            _gradient_worker,
            args=(world, free_port(), str(tiny_model_dir), str(out)),
            nprocs=world,
            start_method="spawn",
        )
    return out


@pytest.mark.parametrize(("mode", "algo"), COMBOS + [(m, f"{a}-holes") for m, a in HOLES])
@pytest.mark.parametrize("split", [s for s in SPLITS if s != "whole"])
def test_gradients_do_not_depend_on_the_split(split_gradients, split, mode, algo):
    whole = np.load(split_gradients / f"whole-{mode}-{algo}.npz")
    other = np.load(split_gradients / f"{split}-{mode}-{algo}.npz")
    assert set(whole.files) == set(other.files)
    for name in whole.files:
        a, b = whole[name], other[name]
        scale = max(np.abs(a).max(), 1e-6 if name != "pg_loss" else 1.0)
        assert np.abs(a - b).max() <= 1e-5 * scale, f"{split} {mode} {algo}: {name}"


def test_a_per_micro_batch_token_mean_would_have_been_caught(split_gradients):
    """The split test has teeth: token-mean and seq-mean-token-mean differ on this batch (rows
    of unequal lengths), so a per-micro-batch mean (the old bug) could not pass it."""
    a = np.load(split_gradients / "whole-token-mean-grpo.npz")
    b = np.load(split_gradients / "whole-seq-mean-token-mean-grpo.npz")
    name = "lm.model.layers.0.mlp.down_proj.weight"
    assert np.abs(a[name] - b[name]).max() > 1e-3 * np.abs(a[name]).max()


def test_observation_holes_are_context_but_never_trained(split_gradients, tiny_model_dir):
    """The holes test has teeth: the same batch with holes gives other gradients; and an
    observation stays context: every token's log-prob is the same with or without holes."""
    for mode, algo in HOLES:
        a = np.load(split_gradients / f"whole-{mode}-{algo}.npz")
        b = np.load(split_gradients / f"whole-{mode}-{algo}-holes.npz")
        name = "lm.model.layers.0.mlp.down_proj.weight"
        assert np.abs(a[name] - b[name]).max() > 1e-3 * np.abs(a[name]).max(), (mode, algo)
    policy = Policy(make_cfg(tiny_model_dir), CPU)
    plain = to_tensors(make_batch(), CPU)
    holes = to_tensors(make_batch(holes=True), CPU)
    assert not torch.equal(plain["response_mask"], holes["response_mask"])
    with torch.no_grad():
        assert torch.equal(policy.forward(plain)[0], policy.forward(holes)[0])


def test_the_recipes_change_the_gradients(split_gradients):
    """The recipes' split tests have teeth: GSPO with rejection sampling and REINFORCE++
    with it give other gradients than GRPO, and seq-mean-token-sum-norm than its
    un-normalised mode (a norm_length that followed the split would fail the split test)."""
    name = "lm.model.layers.0.mlp.down_proj.weight"

    def grad(mode: str, algo: str) -> np.ndarray:
        return np.load(split_gradients / f"whole-{mode}-{algo}.npz")[name]

    base = grad("token-mean", "grpo")
    for algo in ("gspo_kl_entropy_geometric_rs", "reinforce_pp_token_rs"):
        assert np.abs(grad("token-mean", algo) - base).max() > 1e-3 * np.abs(base).max(), algo
    norm, plain = grad("seq-mean-token-sum-norm", "grpo"), grad("seq-mean-token-sum", "grpo")
    # verl's sum-norm: the token sums summed over the responses, / the length 6; the plain
    # mode averages them over the responses instead
    responses = int((make_batch()["response_mask"].sum(axis=1) > 0).sum())
    np.testing.assert_allclose(
        norm * 6, plain * responses, atol=1e-5 * np.abs(plain * responses).max()
    )


@pytest.mark.parametrize("algo", ["gspo_kl_entropy_geometric_rs", "reinforce_pp_token_rs"])
def test_rejection_sampling_masks_part_of_the_batch(split_gradients, algo):
    tokens, total, seqs, responses = np.load(split_gradients / f"whole-token-mean-{algo}.npz")[
        "rs_counts"
    ]
    assert 0.2 < tokens / total < 0.8 and 0 < seqs < responses


def test_the_corrections_mask_part_of_the_batch(split_gradients):
    saved = np.load(split_gradients / "whole-token-mean-grpo_m2po_masked_is.npz")
    for key in ("m2po_counts", "is_counts"):
        tokens, total, seqs, responses = saved[key]
        assert 0.2 < tokens / total < 0.8 and 0 < seqs <= responses, (key, saved[key])


def one_rank_policy(model_dir: Path, **sections: dict) -> Policy:
    torch.manual_seed(0)
    return Policy(make_cfg(model_dir, **sections), CPU)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_empty_rows_that_pad_a_batch_of_several_sequence_sessions_change_nothing(
    tiny_model_dir, mode
):
    """Groups where agents' sessions went on in further sequences have a row count that
    need not split over the trainer ranks: ``collate`` pads it with empty rows. The loss
    and gradients are those of the real rows alone."""
    import dataclasses

    from hpc_asyncppo.trainer.batch import collate
    from tests.conftest import branched_group, make_group

    def in_vocab(g):  # the tiny model's words (ids 4..14, as random_batch's)
        prompts = None if g.row_prompts is None else np.where(g.row_prompts >= 0,
                                                                4 + g.row_prompts % 11, -1)  # fmt: skip
        return dataclasses.replace(g, prompt_ids=4 + g.prompt_ids % 11, row_prompts=prompts,
                                   response_ids=4 + g.response_ids % 11)  # fmt: skip

    groups = [in_vocab(branched_group()), in_vocab(make_group())]
    advantages = np.array([[1.0, -0.5, 0.25], [-1.0, 0.5, 2.0]])
    grads, losses = [], []
    for multiple in (1, 4):  # 9 rows, or 12 with 3 empty ones
        batch = to_tensors(collate(groups, advantages, pad_id=0, multiple=multiple), CPU)
        policy = one_rank_policy(tiny_model_dir, actor={"loss_agg_mode": mode})
        plans = mini_batch_plans(policy, batch)
        merged = {**batch, **reference_quantities(policy, batch, plans)}
        losses.append(float(accumulate_gradients(policy, merged, plans[0])["actor/pg_loss"]))
        grads.append(full_gradients(policy))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] != 0
    for name, grad in grads[0].items():
        np.testing.assert_allclose(grads[1][name], grad, rtol=1e-4, atol=1e-7, err_msg=name)


def test_positive_advantage_raises_the_log_prob_of_its_tokens(tiny_model_dir):
    batch = to_tensors(make_batch(rows=4), CPU)
    batch["advantages"] = torch.tensor([1.0, 1.0, -1.0, -1.0])
    p = one_rank_policy(tiny_model_dir, actor={"lr": 1e-2})
    with torch.no_grad():
        before, _, _ = p.forward(batch)
    ppo_update(p, batch)
    with torch.no_grad():
        after, _, _ = p.forward(batch)
    mask = batch["response_mask"].bool()
    change = [((after - before)[i][mask[i]]).mean().item() for i in range(4)]
    assert change[0] > 0 and change[1] > 0 and change[2] < 0 and change[3] < 0


def test_a_rollout_temperature_the_trainer_does_not_know_shows_in_rollout_corr(
    tiny_model_dir,
):
    """Log-probs from the trainer's own weights and temperature: no mismatch (kl and k3 0,
    importance weights 1). The same tokens scored at temperature 2, as a rollout engine set
    apart from the trainer would: kl and k3 rise, weights spread past the threshold. The
    entropy is logged although its coefficient is 0."""
    batch = to_tensors(make_batch(rows=8), CPU)
    trainer = one_rank_policy(tiny_model_dir, actor={"lr": 0.0})
    hotter = one_rank_policy(tiny_model_dir, rollout={"temperature": 2.0})
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        own, _, _ = trainer.forward(batch)
        hot, _, _ = hotter.forward(batch)
    stats = {}
    for name, rollout in (("same", own), ("hot", hot)):
        stats[name] = ppo_update(trainer, {**batch, "rollout_log_probs": rollout.detach()})
    same, hot_stats = stats["same"], stats["hot"]
    assert abs(same["rollout_corr/kl"]) < 1e-6 and abs(same["rollout_corr/k3_kl"]) < 1e-6
    assert same["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert same["rollout_corr/is_weight_max"] == pytest.approx(1.0, abs=1e-6)
    assert same["rollout_corr/is_truncated_fraction"] == 0.0
    # by hand, over the masked tokens (the tiny random model's logits are flat: a small
    # but clear mismatch)
    log_ratio = (own - hot)[mask]
    assert abs(log_ratio.mean().item()) > 0.01
    assert hot_stats["rollout_corr/kl"] == pytest.approx(log_ratio.mean().item(), rel=1e-4)
    k3 = (log_ratio.exp() - 1 - log_ratio).mean().item()
    assert k3 > 1e-4 and hot_stats["rollout_corr/k3_kl"] == pytest.approx(k3, rel=1e-3)
    assert hot_stats["rollout_corr/is_weight_max"] == pytest.approx(
        log_ratio.exp().max().item(), rel=1e-5
    )
    assert same["actor/entropy"] > 0 and trainer.cfg.actor.entropy_coeff == 0


def gathered_state(policy: Policy) -> dict:
    """What a one-rank checkpoint part holds (its shards are the whole tensors)."""
    return policy.state_dict()


def test_restore_reproduces_the_next_steps_exactly(tiny_model_dir):
    sections = {"actor": {"lr_warmup_steps": 3, "lr_scheduler": "cosine"}}
    a = one_rank_policy(tiny_model_dir, **sections)
    ppo_update(a, to_tensors(make_batch(seed=1), CPU))
    tree = gathered_state(a)
    b = one_rank_policy(tiny_model_dir, **sections)
    b.load_state_dict(TreeReader(tree))
    assert b.schedule.updates == a.schedule.updates == 1
    for seed in (2, 3):
        sa = ppo_update(a, to_tensors(make_batch(seed=seed), CPU))
        sb = ppo_update(b, to_tensors(make_batch(seed=seed), CPU))
        assert sa == sb
    for (name, x), (_, y) in zip(
        a.module.named_parameters(), b.module.named_parameters(), strict=True
    ):
        assert torch.equal(gather_full(x), gather_full(y)), name


def test_bf16_compute_keeps_fp32_master_weights_that_take_small_updates(tiny_model_dir):
    """At lr 1e-6 a bf16 weight would round most updates away; the fp32 master copy keeps them."""
    p = one_rank_policy(tiny_model_dir, model={"dtype": "bfloat16"}, actor={"lr": 1e-6})
    start = {n: gather_full(w).clone() for n, w in p.model.named_parameters()}
    assert all(t.dtype == torch.float32 for t in start.values())
    for seed in range(3):
        ppo_update(p, to_tensors(make_batch(seed=seed), CPU))
    matrices = [n for n, t in start.items() if t.dim() == 2]
    changed = [
        (gather_full(dict(p.model.named_parameters())[n]) != start[n]).float().mean().item()
        for n in matrices
    ]
    assert np.mean(changed) > 0.5, changed
    weights = dict(p.named_weights())
    assert all(t.dtype == torch.bfloat16 for t in weights.values())  # what rollout ranks get


def test_state_bytes_count_weights_gradients_and_adam_moments(tiny_model_dir):
    p = one_rank_policy(tiny_model_dir)
    params = sum(t.numel() for t in p.module.parameters())
    assert p.state_bytes() == 4 * params  # before the first step: weights only
    ppo_update(p, to_tensors(make_batch(), CPU))
    # fp32 weights + grads + exp_avg + exp_avg_sq, plus one scalar "step" per tensor
    steps = len(list(p.module.parameters())) * 4
    assert p.state_bytes() == 16 * params + steps


@pytest.mark.parametrize("rollout_is", ["none", "token"])
def test_old_log_probs_from_the_training_forward_give_the_same_loss_and_gradients(
    tiny_model_dir, rollout_is
):
    """With one optimizer step per trainer step the separate old-log-prob pass is skipped:
    the training forward's own (detached) log-probs give the same loss and gradients."""
    batch = to_tensors(make_batch(), CPU)
    results = []
    for recompute in (True, False):
        p = one_rank_policy(
            tiny_model_dir,
            actor={"recompute_old_log_probs": recompute, "ppo_micro_batch_size_per_gpu": 4},
            algorithm={"rollout_is": rollout_is},
        )
        plans = mini_batch_plans(p, batch)
        ref = reference_quantities(p, batch, plans)
        assert ("old_log_probs" in ref) == recompute
        stats = accumulate_gradients(p, {**batch, **ref}, plans[0])
        results.append((stats, full_gradients(p)))
    (stats_a, grads_a), (stats_b, grads_b) = results
    assert stats_a.keys() == stats_b.keys()
    for key in stats_a:
        assert torch.allclose(stats_a[key], stats_b[key], rtol=1e-6, atol=1e-9), key
    for name in grads_a:
        np.testing.assert_allclose(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("when", ["before", "mid_update"])
def test_a_stop_signal_abandons_the_update_and_leaves_no_trace(tiny_model_dir, when):
    """A stop signal before the step's optimizer step (before the update, or during its
    first micro-batch of several: micro-batches by token budget): ppo_update returns None
    at the next micro-batch boundary, and the weights, AdamW's state and the LR schedule
    are as before, so the same batch trained after a resume gives exactly the update an
    uninterrupted run makes."""
    from hpc_asyncppo.runtime import signals

    actor = {"lr_warmup_steps": 3, "lr_scheduler": "cosine"}
    if when == "mid_update":
        actor |= {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 24}
    a, b = (
        one_rank_policy(tiny_model_dir, actor=actor),
        one_rank_policy(tiny_model_dir, actor=actor),
    )
    batch = make_batch(seed=4)
    forwards = []

    def signal_in_first_forward(module, args, output):
        forwards.append(1)
        if len(forwards) == 1:
            os.kill(os.getpid(), signal.SIGUSR2)

    previous = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    try:
        signals.install_stop_handlers()
        if when == "before":
            os.kill(os.getpid(), signal.SIGUSR2)
            assert signals.stop_requested() == "SIGUSR2"
        hook = b.module.register_forward_hook(signal_in_first_forward)
        assert ppo_update(b, to_tensors(batch, CPU)) is None
        hook.remove()
    finally:
        signals.forget_stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # abandoned at the first boundary: before any forward, or after the first micro-batch
    assert len(forwards) == (0 if when == "before" else 1)
    if when == "mid_update":
        assert len(mini_batch_plans(b, to_tensors(batch, CPU))[0]) > 2
    assert b.schedule.updates == 0 and not b.optimizer.state
    assert all(p.grad is None for p in b.module.parameters())
    assert ppo_update(a, to_tensors(batch, CPU)) == ppo_update(b, to_tensors(batch, CPU))
    for (name, x), (_, y) in zip(
        a.module.named_parameters(), b.module.named_parameters(), strict=True
    ):
        assert torch.equal(gather_full(x), gather_full(y)), name
