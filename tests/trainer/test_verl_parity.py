"""Each recipe of hpc_asyncppo.trainer.algos equals verl's function of the same name on random
inputs, values and gradients, except the differences its docstrings name.

The reference is verl's own code, never copied here: the test loads it from the verl 0.7.1
wheel, ``build/verl-reference/verl-0.7.1-py3-none-any.whl`` (scripts/test.sh downloads it with
``pip download --no-deps verl==0.7.1 -d build/verl-reference``); without it the test skips,
and fails where CI is "true". The project's docstrings name verl b178a3c. Its
``trainer/ppo/core_algos.py`` is 0.7.1's except that 0.7.1 adds gdpo, dppo_tv and checks for
dp_size > 1 (none used here), changes optimal-token-baseline's default (not offered here) and
changes ``agg_loss``'s "seq-mean-token-sum-norm": b178a3c sums the responses' token sums,
0.7.1 averages them, and both divide by ``loss_scale_factor``. Its ``rollout_corr_helper.py``
and ``utils/groupwise.py`` are 0.7.1's; its ``utils/torch_functional.py`` differs in unrelated
schedule and flash-attention code. So 0.7.1 stands for b178a3c everywhere except
"seq-mean-token-sum-norm", which the project takes from b178a3c: there the reference is
0.7.1's value times the number of responses with a masked-in token (``b178a3c_sum_norm``),
and test_algos.py::test_agg_loss_modes_on_unequal_lengths checks the b178a3c value by hand.

Loading: ``import verl`` runs verl/__init__.py (ray, tensordict, transformers...). The
``verl_ref`` fixture instead makes the packages verl, verl.utils, verl.trainer and
verl.trainer.ppo bare module objects whose ``__path__`` points into the wheel (zipimport),
so no package ``__init__`` runs, and imports verl's real base_config, utils.device,
utils.import_utils, utils.groupwise, utils.torch_functional, trainer.ppo.core_algos and
trainer.ppo.rollout_corr_helper from it. Stubs stand in only for names those modules import
and the compared functions never call: tensordict.TensorDict and
transformers.PreTrainedTokenizer (type hints), verl.protocol.DataProto,
verl.trainer.config's AlgoConfig and RolloutCorrectionConfig, and verl.workers.config's
PolicyLossConfig and ActorConfig, the latter a dataclass on verl's real BaseConfig holding
what the losses read (clip ranges, ``global_batch_info``). ``sys.modules`` is restored after.

Compared (project <- verl), float64, masks with holes and empty rows where the project allows:
    advantages.group_advantages + token_advantages: grpo (with and without
        norm_adv_by_std_in_grpo), drgrpo <- compute_grpo_outcome_advantage; rloo <-
        compute_rloo_outcome_advantage; reinforce_plus_plus_baseline <-
        compute_reinforce_plus_plus_baseline_outcome_advantage
    algos.gae_advantages and advantages.token_advantages (gae) <- compute_gae_advantage_return
    algos.reinforce_pp_advantages and advantages.token_advantages (reinforce_plus_plus) <-
        compute_reinforce_plus_plus_outcome_advantage
    algos.agg_loss / agg_loss_share <- agg_loss (with batch_num_tokens, global_batch_size)
    algos.policy_loss <- compute_policy_loss_vanilla; algos.gspo_policy_loss <-
        compute_policy_loss_gspo (with importance weights, whole batch and parts)
    algos.kl_penalty <- kl_penalty, every kind; algos.value_loss <- compute_value_loss;
    algos.entropy_from_logits <- torch_functional.entropy_from_logits
    algos.rollout_importance_weights <- compute_rollout_correction_weights
    algos.rollout_rejection_mask <- compute_rollout_rejection_mask (token_k1, seq_sum_k1,
        seq_mean_k1 for the levels token, sequence, geometric)
    algos.masked_mean / masked_var / masked_whiten <- torch_functional's of the same names
Not compared: has_reward_variance (verl's dynamic sampling is inline in its DAPO recipe's
trainer, outside the wheel), overlong_penalty (inline in verl's DAPORewardManager.__call__),
and the trainer's entropy and log-probs (model.token_log_probs: importing model.py takes
transformers, seconds).

Differences the project documents, asserted here (the tests after "differences documented"
and the rejection tests): GRPO with one response per group; the rejection bounds' direction
and where the log-ratio is clamped; verl's kl_penalty raising for every "+" kind (the project
computes what verl means by it); agg_loss of a batch with no masked-in token (0, verl's NaN);
the trainer's whitening (whiten_with, REINFORCE++-baseline), whose mean and variance divide by
the count where verl's masked_whiten divides by count + 1e-8 (a relative 1e-8 / count: the
comparisons it touches use ``EPS``). The third documented rejection difference (advantages
before rejection) is in the trainer's pipeline, not in a function.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import os
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hpc_asyncppo.config import _CHOICES, Config
from hpc_asyncppo.trainer import advantages, algos
from hpc_asyncppo.transport.samples import SampleGroup
from tests.harness import REPO

WHEEL = REPO / "build/verl-reference/verl-0.7.1-py3-none-any.whl"
WHEEL_SHA256 = "0f7fb1dd6a37d20f7d8795c65ed0d1b9797ffb9947f283bbefd758dced08e216"  # PyPI's

# Bare packages: their __init__ would import ray, tensordict, transformers...
PACKAGES = ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo")
F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-12}
# The whitening's documented difference (the count against count + 1e-8): a relative
# 1e-8 / count; any formula difference is orders larger
EPS = {"rtol": 2e-8, "atol": 2e-8}
SUM_NORM = "seq-mean-token-sum-norm"
# (seed, responses, padded length); every mask has a full first row and an empty last one
CASES = [(0, 4, 2), (1, 8, 7), (2, 32, 40)]
GROUPS = [(0, 3, 2, 1), (1, 4, 4, 6), (2, 16, 5, 30)]  # (seed, groups, n, length)


def _stub(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _load_verl() -> SimpleNamespace:
    """verl's math modules from the wheel, with the stubs the module docstring lists."""
    for name in PACKAGES:
        package = _stub(name, __path__=[f"{WHEEL}/{name.replace('.', '/')}"])
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, package)

    def placeholder(name: str) -> type:
        return type(name, (), {"__doc__": "stub: never used by the compared functions"})

    _stub("tensordict", TensorDict=placeholder("TensorDict"))
    _stub("transformers", PreTrainedTokenizer=placeholder("PreTrainedTokenizer"))
    _stub("verl.protocol", DataProto=placeholder("DataProto"))
    _stub("verl.trainer.config", AlgoConfig=placeholder("AlgoConfig"))
    _stub(
        "verl.trainer.config.algorithm",
        RolloutCorrectionConfig=placeholder("RolloutCorrectionConfig"),
    )
    base_config = importlib.import_module("verl.base_config")

    @dataclasses.dataclass
    class ActorConfig(base_config.BaseConfig):
        """What verl's policy losses read of its ActorConfig (verl's defaults)."""

        clip_ratio: float = 0.2
        clip_ratio_low: float = 0.2
        clip_ratio_high: float = 0.2
        clip_ratio_c: float = 3.0
        global_batch_info: dict = dataclasses.field(default_factory=dict)

    _stub("verl.workers", __path__=[])
    _stub("verl.workers.config", ActorConfig=ActorConfig)
    _stub("verl.workers.config.actor", PolicyLossConfig=placeholder("PolicyLossConfig"))
    groupwise = importlib.import_module("verl.utils.groupwise")
    sys.modules["verl.utils"].as_torch_index = groupwise.as_torch_index
    sys.modules["verl.utils"].group_mean_std = groupwise.group_mean_std
    return SimpleNamespace(
        F=importlib.import_module("verl.utils.torch_functional"),
        core=importlib.import_module("verl.trainer.ppo.core_algos"),
        corr=importlib.import_module("verl.trainer.ppo.rollout_corr_helper"),
        ActorConfig=ActorConfig,
    )


@pytest.fixture(scope="module")
def verl_ref():
    """verl 0.7.1's core_algos (``core``), rollout_corr_helper (``corr``), torch_functional
    (``F``) and the ActorConfig stub; sys.modules as it was afterwards."""
    if not WHEEL.exists():
        reason = (
            f"verl's reference wheel is not at {WHEEL}: scripts/test.sh downloads it "
            "(pip download --no-deps verl==0.7.1 -d build/verl-reference)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    digest = hashlib.sha256(WHEEL.read_bytes()).hexdigest()
    assert digest == WHEEL_SHA256, f"{WHEEL} is not PyPI's verl 0.7.1 wheel (sha256 {digest})"
    saved = {name: module for name, module in sys.modules.items() if _loaded_here(name)}
    try:
        yield _load_verl()
    finally:
        for name in [name for name in sys.modules if _loaded_here(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        for path in [p for p in sys.path_importer_cache if p.startswith(str(WHEEL))]:
            del sys.path_importer_cache[path]


def _loaded_here(name: str) -> bool:
    """verl's modules and the stubs: what the fixture takes out of sys.modules afterwards
    (and puts back what was there). Real libraries verl's modules import stay loaded."""
    return name.split(".")[0] in ("verl", "tensordict", "transformers")


# --- inputs and comparisons ---------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def random_mask(g: torch.Generator, rows: int, width: int, holes: bool = True) -> torch.Tensor:
    """(rows, width) float64: random lengths, the first row full and the last empty; with
    ``holes``, random masked-out tokens inside the other responses (rejected tokens)."""
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0], lengths[-1] = width, 0
    mask = torch.arange(width)[None] < lengths[:, None]
    if holes:
        mask[1:] &= torch.rand(rows - 1, width, generator=g) > 0.25
    return mask.to(F64)


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def assert_same(ours, theirs, inputs=(), tol: dict = TIGHT) -> None:
    """Equal values and, for each of ``inputs``, equal gradients (of a random weighting of
    the outputs, so that every output element counts)."""
    torch.testing.assert_close(ours, theirs, **tol)
    if not inputs:
        return
    weights = torch.randn(ours.shape, generator=generator(99), dtype=ours.dtype)
    ours_grads, verl_grads = (
        torch.autograd.grad(out, inputs, weights, allow_unused=True, materialize_grads=True)
        for out in (ours, theirs)
    )
    for i, (a, b) in enumerate(zip(ours_grads, verl_grads, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"gradient of input {i}: {m}")


def nonempty_rows(mask: torch.Tensor) -> float:
    return float((mask.sum(dim=-1) > 0).sum())


def b178a3c_sum_norm(value_0_7_1: torch.Tensor, mask: torch.Tensor, seqs: float | None = None):
    """verl b178a3c's "seq-mean-token-sum-norm" from 0.7.1's: b178a3c sums the responses'
    token sums where 0.7.1 averages them over ``global_batch_size`` (default: the responses
    with a masked-in token); both divide by loss_scale_factor."""
    return value_0_7_1 * (nonempty_rows(mask) if seqs is None else seqs)


def verl_value(value_0_7_1: torch.Tensor, mode: str, mask: torch.Tensor) -> torch.Tensor:
    """verl b178a3c's value of an aggregation in ``mode``, from 0.7.1's."""
    return b178a3c_sum_norm(value_0_7_1, mask) if mode == SUM_NORM else value_0_7_1


# --- every option the config offers has a case here ----------------------------------------

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")  # whole groups
RS_OPTIONS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def test_every_offered_option_has_a_parity_case():
    """The config's choices are exactly those compared below, so a new option needs a case."""
    assert set(_CHOICES["algorithm.adv_estimator"]) == {*ESTIMATORS, *advantages.PER_TOKEN}
    assert set(_CHOICES["actor.loss_agg_mode"]) == set(algos.LOSS_AGG_MODES)
    assert set(_CHOICES["actor.kl_loss_type"]) == set(algos.KL_KINDS)
    assert set(_CHOICES["actor.policy_loss.loss_mode"]) == {"vanilla", "gspo"}
    assert set(_CHOICES["algorithm.rollout_is"]) == {"none", *algos.IS_LEVELS}
    assert set(_CHOICES["algorithm.rollout_rs"]) == {"none", *RS_OPTIONS}


# --- advantages ---------------------------------------------------------------------------


def group_inputs(seed: int, groups: int, n: int, length: int):
    """Scores (G, n), some groups binary (ties, equal groups), some continuous; lengths
    1..length with one empty response; the (B, L) prefix mask; verl's token-level rewards
    (the score on the last token) and group index."""
    g = generator(seed)
    scores = randn(g, groups, n)
    scores[::2] = (scores[::2] > 0).to(F64)
    lengths = torch.randint(1, length + 1, (groups, n), generator=g)
    lengths[-1, -1] = 0
    flat = lengths.reshape(-1)
    mask = (torch.arange(length)[None] < flat[:, None]).to(F64)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(flat.numel()), (flat - 1).clamp(min=0)] = scores.reshape(-1)
    index = np.repeat(np.arange(groups), n)
    return scores, lengths, mask, token_rewards, index


def project_group_advantages(estimator: str, scores, lengths, mask, norm: bool = True):
    """The trainer's path: group_advantages on the leader, then token_advantages per rank."""
    cfg = Config()
    cfg.algorithm.adv_estimator = estimator
    cfg.algorithm.norm_adv_by_std_in_grpo = norm
    groups = [
        SampleGroup(seed=0, epoch=0, prompt_index=i, rollout_rank=0, param_version_start=0,
                    param_version_end=0, prompt_ids=np.zeros(1, np.int32),
                    response_ids=np.zeros((row.numel(), 1), np.int32),
                    response_lengths=row.numpy(), rollout_log_probs=np.zeros((row.numel(), 1)),
                    rewards=np.zeros(row.numel(), np.float32))
        for i, row in enumerate(lengths)
    ]  # fmt: skip
    per_response = advantages.group_advantages(cfg, groups, scores.numpy())
    batch = {"advantages": torch.from_numpy(per_response).reshape(-1), "response_mask": mask}
    return advantages.token_advantages(cfg.algorithm, batch, None, lambda x: x)["advantages"]


@pytest.mark.parametrize(("seed", "groups", "n", "length"), GROUPS)
@pytest.mark.parametrize(
    ("estimator", "norm", "verl_name", "verl_kwargs"),
    [
        ("grpo", True, "compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": True}),
        ("grpo", False, "compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}),
        ("drgrpo", True, "compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}),
        ("rloo", True, "compute_rloo_outcome_advantage", {}),
        (
            "reinforce_plus_plus_baseline",
            True,
            "compute_reinforce_plus_plus_baseline_outcome_advantage",
            {},
        ),
    ],
)
def test_group_advantages_equal_verls(
    verl_ref, seed, groups, n, length, estimator, norm, verl_name, verl_kwargs
):
    """The (B, L) advantages the trainer trains on equal verl's estimator of the same rewards
    (drgrpo is verl's grpo without the std, whatever norm_adv_by_std_in_grpo says): groups of
    equal rewards, an empty response."""
    scores, lengths, mask, token_rewards, index = group_inputs(seed, groups, n, length)
    ours = project_group_advantages(estimator, scores, lengths, mask, norm)
    verl_fn = getattr(verl_ref.core, verl_name)
    theirs, _ = verl_fn(
        token_level_rewards=token_rewards, response_mask=mask, index=index, **verl_kwargs
    )
    # REINFORCE++-baseline whitens: its mean is over the count, verl's over count + 1e-8
    assert_same(ours, theirs, tol=EPS if estimator == "reinforce_plus_plus_baseline" else TIGHT)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_with_one_response_per_group_differs_as_documented(verl_ref, norm):
    """Documented (grpo_advantages): with n == 1 verl takes mean 0 and std 1, so the advantage
    is the reward (over 1 + epsilon with the std); here it is 0. RLOO's lone response keeps
    its reward in both, and REINFORCE++-baseline's has baseline 0 in both."""
    scores, lengths, mask, token_rewards, index = group_inputs(3, 5, 1, 4)
    theirs, _ = verl_ref.core.compute_grpo_outcome_advantage(
        token_rewards, mask, index, norm_adv_by_std_in_grpo=norm
    )
    reward = scores.reshape(-1) / (1 + 1e-6 if norm else 1)
    # verl's lone-response std is torch.tensor(1.0), float32: 1 + 1e-6 rounds to 1 + 9.5e-7
    assert_same(theirs, algos.token_advantages(reward, mask), tol={"rtol": 1e-7, "atol": 0.0})
    ours = algos.token_advantages(algos.grpo_advantages(scores, norm).reshape(-1), mask)
    assert torch.all(ours == 0) and torch.any(theirs != 0)
    rloo, _ = verl_ref.core.compute_rloo_outcome_advantage(token_rewards, mask, index)
    assert_same(algos.token_advantages(algos.rloo_advantages(scores).reshape(-1), mask), rloo)
    ours = project_group_advantages("reinforce_plus_plus_baseline", scores, lengths, mask)
    theirs, _ = verl_ref.core.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_rewards, mask, index
    )
    assert_same(ours, theirs, tol=EPS)


def token_inputs(seed: int, rows: int, width: int, holes: bool = True):
    g = generator(seed)
    return randn(g, rows, width), randn(g, rows, width), random_mask(g, rows, width, holes)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_equals_verls(verl_ref, seed, rows, width, gamma, lam):
    """gae_advantages, rewards on every token and masks with holes (observation tokens): the
    whitened advantages (padding whitened too) and the returns equal verl's."""
    rewards, values, mask = token_inputs(seed, rows, width)
    ours = algos.gae_advantages(rewards, values, mask, gamma, lam)
    theirs = verl_ref.core.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    assert_same(ours[0], theirs[0])
    assert_same(ours[1], theirs[1])


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_equals_verls(verl_ref, seed, rows, width, gamma):
    """reinforce_pp_advantages, rewards on every token, single-turn masks: advantages and
    returns equal verl's. With holes (observation tokens) they differ by design: verl's
    return restarts after a masked-out token, ours passes through it (test_algos)."""
    rewards, _, mask = token_inputs(seed, rows, width, holes=False)
    ours = algos.reinforce_pp_advantages(rewards, mask, gamma)
    theirs = verl_ref.core.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=SimpleNamespace(gamma=gamma)
    )
    assert_same(ours[0], theirs[0])
    assert_same(ours[1], theirs[1])


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("estimator", advantages.PER_TOKEN)
def test_per_token_advantages_of_the_trainer_equal_verls(verl_ref, seed, rows, width, estimator):
    """The trainer's path (advantages.token_advantages: the reward on each response's last
    token, whitening with all-reduced moments, here of one rank) equals verl's estimator."""
    g = generator(seed)
    rewards, values = randn(g, rows), randn(g, rows, width)
    mask = random_mask(g, rows, width, holes=False)  # collate's masks: no holes
    algo = Config().algorithm
    algo.adv_estimator, algo.gamma, algo.lam = estimator, 0.9, 0.8
    batch = {"rewards": rewards, "response_mask": mask}
    ours = advantages.token_advantages(algo, batch, values, lambda x: x)
    token_rewards = torch.zeros_like(mask)
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    token_rewards[torch.arange(rows), last] = rewards
    if estimator == "gae":
        theirs = verl_ref.core.compute_gae_advantage_return(token_rewards, values, mask, 0.9, 0.8)
        assert_same(ours["returns"], theirs[1])
    else:
        theirs = verl_ref.core.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, mask, config=SimpleNamespace(gamma=0.9)
        )
    # whiten_with's mean is over the count, verl's over count + 1e-8
    assert_same(ours["advantages"], theirs[0], tol=EPS)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
def test_masked_statistics_equal_verls(verl_ref, seed, rows, width):
    """masked_mean (whole and per row), masked_var (biased and not) and masked_whiten (with
    and without the mean shift) equal verl's, with gradients to the values."""
    g = generator(seed)
    (values,) = leaves(randn(g, rows, width, scale=3.0) + 1.0)
    mask = random_mask(g, rows, width)
    F = verl_ref.F
    assert_same(algos.masked_mean(values, mask), F.masked_mean(values, mask), [values])
    assert_same(algos.masked_mean(values, mask, -1), F.masked_mean(values, mask, -1), [values])
    for unbiased in (True, False):
        ours = algos.masked_var(values, mask, unbiased)
        assert_same(ours, F.masked_var(values, mask, unbiased), [values])
    for shift in (True, False):
        ours = algos.masked_whiten(values, mask, shift)
        assert_same(ours, F.masked_whiten(values, mask, shift), [values])


# --- loss aggregation ---------------------------------------------------------------------


def parts(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Three row ranges of each tensor (micro-batches or trainer ranks); with the masks of
    random_mask, the last part of the smallest case holds only the empty row."""
    return list(zip(*(t.tensor_split(3) for t in tensors), strict=True))


def batch_info(mask: torch.Tensor, norm_length: float) -> tuple[tuple[float, float], dict]:
    """The project's normalisers of a whole mini-batch, and verl's global_batch_info."""
    tokens, seqs = algos.loss_normalisers(mask).tolist()
    verl_info = {
        "dp_size": 1,
        "batch_num_tokens": tokens,
        "global_batch_size": seqs,
        "loss_scale_factor": norm_length,
    }
    return (tokens, seqs), verl_info


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_equals_verls(verl_ref, seed, rows, width, mode):
    """agg_loss of a whole batch (value and gradient), and "seq-mean-token-sum-norm" both with
    the padded width and a given length as divisor (b178a3c's: 0.7.1's times the responses)."""
    g = generator(seed)
    (loss,) = leaves(randn(g, rows, width))
    mask = random_mask(g, rows, width)
    ours = algos.agg_loss(loss, mask, mode)
    theirs = verl_ref.core.agg_loss(loss, mask, mode)
    assert_same(ours, verl_value(theirs, mode, mask), [loss])
    if mode != SUM_NORM:
        return
    ours = algos.agg_loss(loss, mask, mode, norm_length=3 * width)
    theirs = verl_ref.core.agg_loss(loss, mask, mode, loss_scale_factor=3 * width)
    assert_same(ours, b178a3c_sum_norm(theirs, mask), [loss])


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_share_equals_verls_with_global_normalisers(verl_ref, seed, rows, width, mode):
    """Each part's agg_loss_share equals verl's agg_loss of that part given the mini-batch's
    batch_num_tokens and global_batch_size (what verl's workers pass, dp_size 1), values and
    gradients, a part of only an empty row included."""
    g = generator(seed)
    (loss,) = leaves(randn(g, rows, width))
    mask = random_mask(g, rows, width)
    (tokens, seqs), info = batch_info(mask, 2 * width)
    for loss_part, mask_part in parts(loss, mask):
        ours = algos.agg_loss_share(loss_part, mask_part, mode, tokens, seqs, 2 * width)
        theirs = verl_ref.core.agg_loss(loss_part, mask_part, mode, **info)
        if mode == SUM_NORM:
            theirs = b178a3c_sum_norm(theirs, mask_part, seqs)
        assert_same(ours, theirs, [loss])


# --- policy losses ------------------------------------------------------------------------

CLIPS = [(0.2, 0.28, 3.0), (0.1, 0.3, 1.5)]  # clip_ratio_low, _high, _c
GSPO_CLIPS = [(3e-4, 4e-4), (0.2, 0.3)]


def policy_inputs(seed: int, rows: int, width: int, spread: float = 0.5):
    """Log-probs, old log-probs at ratios around 1 (clipped and dual-clipped ones among
    them, and two log-ratios past +-20), advantages of both signs, importance weights."""
    g = generator(seed)
    old = -torch.rand(rows, width, generator=g, dtype=F64) * 5
    log_prob = old + randn(g, rows, width, scale=spread)
    log_prob[0, 0], log_prob[0, -1] = old[0, 0] + 25.0, old[0, -1] - 30.0
    adv = randn(g, rows, width)
    is_weights = torch.rand(rows, width, generator=g, dtype=F64) * 2
    return log_prob, old, adv, is_weights, random_mask(g, rows, width)


def verl_config(verl_ref, low: float, high: float, c: float = 3.0, info: dict | None = None):
    return verl_ref.ActorConfig(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, global_batch_info=info or {}
    )


def assert_stats(ours: dict[str, torch.Tensor], theirs: dict[str, float]) -> None:
    for name, value in ours.items():
        assert value.item() == pytest.approx(theirs[f"actor/{name}"], rel=1e-12, abs=1e-12), name


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_loss_equals_verls_vanilla(verl_ref, seed, rows, width, mode, clips, weighted):
    """policy_loss (clip, clip-higher, dual-clip, the +-20 clamp, importance weights) equals
    compute_policy_loss_vanilla: the loss, its gradients to the log-probs, the old log-probs
    and the advantages, and the stats."""
    log_prob, old, adv, is_weights, mask = policy_inputs(seed, rows, width)
    log_prob, old, adv = leaves(log_prob, old, adv)
    weights = is_weights if weighted else None
    ours, ours_stats = algos.policy_loss(log_prob, old, adv, mask, *clips, mode, weights)
    config = verl_config(verl_ref, *clips)
    theirs, verl_stats = verl_ref.core.compute_policy_loss_vanilla(
        old, log_prob, adv, mask, mode, config, weights
    )
    assert_same(ours, verl_value(theirs, mode, mask), [log_prob, old, adv])
    assert_stats(ours_stats, verl_stats)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_policy_loss_shares_equal_verls_with_global_batch_info(verl_ref, seed, rows, width, mode):
    """policy_loss of each part with the mini-batch's normalisers (the trainer's path) equals
    compute_policy_loss_vanilla given global_batch_info, importance weights included, with
    gradients."""
    log_prob, old, adv, is_weights, mask = policy_inputs(seed, rows, width)
    log_prob, old, adv = leaves(log_prob, old, adv)
    normalisers, info = batch_info(mask, 2 * width)
    config = verl_config(verl_ref, *CLIPS[0], info=info)
    for lp, o, a, w, m in parts(log_prob, old, adv, is_weights, mask):
        ours, _ = algos.policy_loss(lp, o, a, m, *CLIPS[0], mode, w, normalisers, 2 * width)
        theirs, _ = verl_ref.core.compute_policy_loss_vanilla(o, lp, a, m, mode, config, w)
        if mode == SUM_NORM:
            theirs = b178a3c_sum_norm(theirs, m, normalisers[1])
        assert_same(ours, theirs, [log_prob, old, adv])


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("clips", GSPO_CLIPS)
@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_equals_verls(verl_ref, seed, rows, width, clips, weighted):
    """gspo_policy_loss equals compute_policy_loss_gspo (sequence ratios near 1 for GSPO's
    narrow clip, one past the clamp at e^10): loss, gradients, stats; and each part's share
    with the mini-batch's normalisers equals verl's given global_batch_info."""
    log_prob, old, adv, is_weights, mask = policy_inputs(seed, rows, width, spread=2e-3)
    log_prob[1] += 12.0
    log_prob, old, adv = leaves(log_prob, old, adv)
    weights = is_weights if weighted else None
    ours, ours_stats = algos.gspo_policy_loss(log_prob, old, adv, mask, *clips, weights)
    theirs, verl_stats = verl_ref.core.compute_policy_loss_gspo(
        old, log_prob, adv, mask, "token-mean", verl_config(verl_ref, *clips), weights
    )
    assert_same(ours, theirs, [log_prob, old, adv])
    assert_stats(ours_stats, verl_stats)
    normalisers, info = batch_info(mask, 2 * width)
    config = verl_config(verl_ref, *clips, info=info)
    for lp, o, a, w, m in parts(log_prob, old, adv, is_weights, mask):
        w = w if weighted else None
        ours, _ = algos.gspo_policy_loss(lp, o, a, m, *clips, w, normalisers)
        theirs, _ = verl_ref.core.compute_policy_loss_gspo(o, lp, a, m, "token-mean", config, w)
        assert_same(ours, theirs, [log_prob, old, adv])


# --- KL, value loss, entropy ---------------------------------------------------------------

BASE_KL_KINDS = [kind for kind in algos.KL_KINDS if not kind.endswith("+")]
PLUS_KL_KINDS = [kind for kind in algos.KL_KINDS if kind.endswith("+")]


def kl_inputs(seed: int, rows: int, width: int) -> list[torch.Tensor]:
    """Log-probs and reference log-probs 3 nats apart on average (k3 past its clamp at 10
    often), two differences past +-20."""
    g = generator(seed)
    log_prob, ref = randn(g, rows, width, scale=3.0), randn(g, rows, width, scale=3.0)
    ref[0, 0], ref[-1, -1] = log_prob[0, 0] + 25.0, log_prob[-1, -1] - 30.0
    return leaves(log_prob, ref)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("kind", BASE_KL_KINDS)
def test_kl_penalty_equals_verls(verl_ref, seed, rows, width, kind):
    """kl_penalty of every kind without "+" equals verl's, per token, with gradients to both
    log-probs (through k3's clamps too)."""
    log_prob, ref = kl_inputs(seed, rows, width)
    ours = algos.kl_penalty(log_prob, ref, kind)
    assert_same(ours, verl_ref.core.kl_penalty(log_prob, ref, kind), [log_prob, ref])


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("kind", PLUS_KL_KINDS)
def test_kl_plus_kinds_are_verls_straight_through(verl_ref, seed, rows, width, kind):
    """A "+" kind has the value of verl's kl_penalty of its estimator and the gradient of
    verl's k2, the straight-through verl's kl_penalty means for it (and raises for: see below)."""
    log_prob, ref = kl_inputs(seed, rows, width)
    ours = algos.kl_penalty(log_prob, ref, kind)
    assert_same(ours, verl_ref.core.kl_penalty(log_prob, ref, kind[:-1]))
    ours_grads = torch.autograd.grad(ours.sum(), [log_prob, ref])
    k2_grads = torch.autograd.grad(
        verl_ref.core.kl_penalty(log_prob, ref, "k2").sum(), [log_prob, ref]
    )
    for a, b in zip(ours_grads, k2_grads, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("cliprange", [0.2, 0.5])
def test_value_loss_equals_verls(verl_ref, seed, rows, width, mode, cliprange):
    """value_loss equals compute_value_loss (note verl's argument order: returns before the
    old values): the loss, its gradients to the new values, old values and returns, and the
    clip fraction."""
    g = generator(seed)
    vpreds, values_old, returns = leaves(*(randn(g, rows, width) for _ in range(3)))
    mask = random_mask(g, rows, width)
    ours, ours_clipfrac = algos.value_loss(vpreds, values_old, returns, mask, cliprange, mode)
    theirs, verl_clipfrac = verl_ref.core.compute_value_loss(
        vpreds, returns, values_old, mask, cliprange, mode
    )
    assert_same(ours, verl_value(theirs, mode, mask), [vpreds, values_old, returns])
    assert_same(ours_clipfrac, verl_clipfrac)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
def test_entropy_from_logits_equals_verls(verl_ref, seed, rows, width):
    """entropy_from_logits equals torch_functional.entropy_from_logits, with the gradient to
    the logits."""
    (logits,) = leaves(randn(generator(seed), rows, width, 11, scale=3.0))
    ours = algos.entropy_from_logits(logits)
    assert_same(ours, verl_ref.F.entropy_from_logits(logits), [logits])


# --- rollout correction: importance weights and rejection sampling -------------------------


def rollout_inputs(seed: int, rows: int, width: int, spread: float):
    """Old and rollout log-probs (log-ratios ~ ``spread``) and a mask with holes and an empty
    row; rows 0 and 1 are full, for the tests to set."""
    g = generator(seed)
    rollout = -torch.rand(rows, width, generator=g, dtype=F64) * 5
    old = rollout + randn(g, rows, width, scale=spread)
    mask = random_mask(g, rows, width)
    mask[1] = 1.0
    return old, rollout, mask


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("level", algos.IS_LEVELS)
@pytest.mark.parametrize("threshold", [2.0, 5.0])
def test_importance_weights_equal_verls(verl_ref, seed, rows, width, level, threshold):
    """rollout_importance_weights equals compute_rollout_correction_weights (verl's log_ratio
    is old - rollout): truncation, the +-20 clamp of tokens (25, -30) and of sums, 0 on
    padding."""
    old, rollout, mask = rollout_inputs(seed, rows, width, spread=1.0)
    old[0, 0], old[1, -1] = rollout[0, 0] + 25.0, rollout[1, -1] - 30.0
    ours = algos.rollout_importance_weights(old, rollout, mask, level, threshold)
    theirs, _ = verl_ref.corr.compute_rollout_correction_weights(
        old - rollout, mask, level, threshold
    )
    assert_same(ours, theirs)


# per level: the upper bound, the log-ratios' spread, row 1's statistic (far past the bound)
RS_CASES = {"token": (1.5, 0.5, 15.0), "sequence": (4.0, 0.4, 30.0), "geometric": (1.05, 0.1, 15.0)}


def rejection_inputs(seed: int, rows: int, width: int, level: str, row0_statistic: float):
    """``rollout_inputs`` at the level's spread, every token log-ratio within +-20: row 0's
    log-ratio statistic (token, sum or mean) is ``row0_statistic``, row 1's far past the
    upper bound (sequence: a sum of 30, no token past 20)."""
    upper, spread, far = RS_CASES[level]
    old, rollout, mask = rollout_inputs(seed, rows, width, spread)
    tokens = width if level == "sequence" else 1
    old[0] = rollout[0] + row0_statistic / tokens
    old[1] = rollout[1] + far / tokens
    return old, rollout, mask, upper


def verl_keep(verl_ref, old, rollout, mask, level: str, threshold: float | str):
    keep, _ = verl_ref.corr.compute_rollout_rejection_mask(
        old - rollout, mask, RS_OPTIONS[level], threshold
    )
    return keep


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("level", algos.RS_LEVELS)
def test_rejection_equals_verls_where_equal_by_construction(verl_ref, seed, rows, width, level):
    """rollout_rejection_mask with lower = 1 / upper (both sides' default) and token
    log-ratios within +-20 keeps exactly the tokens verl's token_k1, seq_sum_k1 and
    seq_mean_k1 keep (row 0, ratio 1, kept; row 1 rejected)."""
    old, rollout, mask, upper = rejection_inputs(seed, rows, width, level, 0.0)
    ours = algos.rollout_rejection_mask(old, rollout, mask, level, upper)
    assert_same(ours, verl_keep(verl_ref, old, rollout, mask, level, upper))
    assert_same(ours, algos.rollout_rejection_mask(old, rollout, mask, level, upper, 1 / upper))
    assert torch.all(ours[0] == 1) and torch.all(ours[1] == 0)


@pytest.mark.parametrize(("seed", "rows", "width"), CASES)
@pytest.mark.parametrize("level", algos.RS_LEVELS)
def test_rejection_bounds_the_inverse_ratio_of_verls_as_documented(
    verl_ref, seed, rows, width, level
):
    """Documented (rollout_rejection_mask): the bounds [lower, upper] are on pi_old /
    pi_rollout, verl's on pi_rollout / pi_old. So ours with [lower, upper] is verl's with
    [1 / upper, 1 / lower]; verl's with [lower, upper] rejects row 0, whose ratio
    upper^0.75 lies inside ours, [upper^-0.5, upper], and outside verl's, [upper^-0.5,
    upper^0.5] on pi_old / pi_rollout."""
    upper = RS_CASES[level][0]
    old, rollout, mask, _ = rejection_inputs(seed, rows, width, level, 0.75 * math.log(upper))
    lower = upper**-0.5  # not 1 / upper: bounds the two directions treat differently
    ours = algos.rollout_rejection_mask(old, rollout, mask, level, upper, lower)
    assert_same(ours, verl_keep(verl_ref, old, rollout, mask, level, f"{1 / upper}_{1 / lower}"))
    same_bounds = verl_keep(verl_ref, old, rollout, mask, level, f"{lower}_{upper}")
    assert torch.all(ours[0] == 1) and torch.all(same_bounds[0] == 0)


@pytest.mark.parametrize(("level", "bound"), [("sequence", 10.0), ("geometric", 5.0)])
def test_rejection_clamps_the_sum_where_verl_clamps_each_token_as_documented(
    verl_ref, level, bound
):
    """Documented (rollout_rejection_mask): log-ratios 30 and -15 sum to 15 (mean 7.5), past
    the bound; verl clamps the 30 to 20 first (5, mean 2.5) and keeps the response."""
    old, rollout = torch.tensor([[30.0, -15.0]], dtype=F64), torch.zeros(1, 2, dtype=F64)
    mask, upper = torch.ones(1, 2, dtype=F64), math.exp(bound)
    assert_same(algos.rollout_rejection_mask(old, rollout, mask, level, upper), 0 * mask)
    assert_same(verl_keep(verl_ref, old, rollout, mask, level, upper), mask)


# --- differences documented in the project's docstrings ----------------------------------


@pytest.mark.parametrize("kind", PLUS_KL_KINDS)
def test_verls_kl_penalty_raises_for_the_plus_kinds_as_documented(verl_ref, kind):
    """Documented (kl_penalty): verl's kl_penalty passes a "+" name on to
    kl_penalty_forward, which does not know it; test_kl_plus_kinds_are_verls_straight_through
    shows the project computes what verl means by it."""
    log_prob, ref = kl_inputs(0, 4, 3)
    with pytest.raises(NotImplementedError):
        verl_ref.core.kl_penalty(log_prob, ref, kind)


@pytest.mark.parametrize("mode", [mode for mode in algos.LOSS_AGG_MODES if mode != SUM_NORM])
def test_agg_loss_of_a_batch_without_tokens_is_0_where_verls_is_nan_as_documented(verl_ref, mode):
    """Documented (agg_loss): an all-padding batch gives 0 (a step of nothing trains
    nothing), verl's 0 / 0."""
    loss, mask = randn(generator(0), 3, 4), torch.zeros(3, 4, dtype=F64)
    assert algos.agg_loss(loss, mask, mode).item() == 0.0
    assert torch.isnan(verl_ref.core.agg_loss(loss, mask, mode))


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus_baseline", *advantages.PER_TOKEN])
def test_whitening_divides_by_the_count_where_verl_adds_1e8_as_documented(verl_ref, estimator):
    """Documented (whiten_with, reinforce_pp_baseline_advantages): the whitened advantages
    of a small batch (3 tokens) are verl's to a relative 1e-8 / count, and not to 1e-12."""
    scores, lengths, mask, token_rewards, index = group_inputs(0, 3, 2, 1)
    if estimator == "reinforce_plus_plus_baseline":
        ours = project_group_advantages(estimator, scores, lengths, mask)
        theirs, _ = verl_ref.core.compute_reinforce_plus_plus_baseline_outcome_advantage(
            token_rewards, mask, index
        )
    else:
        algo = Config().algorithm
        algo.adv_estimator = estimator
        batch = {"rewards": scores.reshape(-1), "response_mask": mask}
        ours = advantages.token_advantages(algo, batch, torch.zeros_like(mask), lambda x: x)
        ours = ours["advantages"]
        if estimator == "gae":
            theirs, _ = verl_ref.core.compute_gae_advantage_return(
                token_rewards, torch.zeros_like(mask), mask, 1.0, 1.0
            )
        else:
            theirs, _ = verl_ref.core.compute_reinforce_plus_plus_outcome_advantage(
                token_rewards, mask, config=SimpleNamespace(gamma=1.0)
            )
    assert_same(ours, theirs, tol=EPS)
    assert not torch.allclose(ours, theirs, **TIGHT)
