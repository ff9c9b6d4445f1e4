"""Each function in hpc_asyncppo.trainer.algos against numbers worked out by hand.

The expected values are computed with plain Python (math module) in the test,
never by calling the same torch formula, so a wrong formula cannot agree with itself.
"""

import math

import pytest
import torch

from hpc_asyncppo.trainer import algos


def t(rows):
    """A float64 tensor from nested lists (float64 keeps hand arithmetic exact to ~1e-12)."""
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, tol=1e-6):
    assert torch.allclose(actual, t(expected), atol=tol, rtol=0), f"{actual} != {expected}"


# --- masked statistics --------------------------------------------------------


def test_masked_mean_ignores_masked_positions_even_nan():
    values = t([[1.0, 2.0], [3.0, math.nan]])
    mask = t([[1, 1], [1, 0]])
    close(algos.masked_mean(values, mask), (1 + 2 + 3) / 3)
    close(algos.masked_mean(values, mask, dim=-1), [(1 + 2) / 2, 3 / 1])


def test_masked_mean_of_empty_mask_is_zero():
    close(algos.masked_mean(t([5.0, 6.0]), t([0, 0])), 0.0)


def test_masked_whiten_uses_unbiased_variance_and_transforms_padding():
    values = t([1.0, 2.0, 3.0, 100.0])
    mask = t([1, 1, 1, 0])
    mean = (1 + 2 + 3) / 3  # 2
    var = ((1 - 2) ** 2 + 0 + (3 - 2) ** 2) / (3 - 1)  # 1, Bessel-corrected
    scale = 1 / math.sqrt(var + 1e-8)
    expected = [(v - mean) * scale for v in (1.0, 2.0, 3.0, 100.0)]
    close(algos.masked_whiten(values, mask), expected)
    close(algos.masked_whiten(values, mask, shift_mean=False), [e + mean for e in expected])


def test_masked_whiten_rejects_a_single_value():
    with pytest.raises(ValueError, match="at least 2"):
        algos.masked_whiten(t([1.0, 2.0]), t([1, 0]))


# --- GRPO / token advantages --------------------------------------------------


def test_grpo_advantages_normalise_by_group_std():
    scores = t([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0], [4.0, 4.0, 4.0]])
    eps = 1e-6
    # group 0: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    row0 = [(r - 2) / (1 + eps) for r in (1.0, 2.0, 3.0)]
    # group 1: mean 1/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    std1 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    row1 = [(r - 1 / 3) / (std1 + eps) for r in (0.0, 0.0, 1.0)]
    # group 2: all equal -> 0 / (0 + eps) = 0
    close(algos.grpo_advantages(scores, eps=eps), [row0, row1, [0.0, 0.0, 0.0]])


def test_grpo_advantages_without_std_is_dr_grpo():
    scores = t([[0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    expected = [[-0.5, -0.5, 0.5, 0.5], [0.75, -0.25, -0.25, -0.25]]
    close(algos.grpo_advantages(scores, norm_by_std=False), expected)


def test_grpo_advantages_of_single_response_groups_are_zero():
    close(algos.grpo_advantages(t([[3.0], [-1.0]])), [[0.0], [0.0]])


def test_grpo_advantages_are_detached():
    scores = t([[0.0, 1.0]]).requires_grad_()
    assert not algos.grpo_advantages(scores).requires_grad


def test_token_advantages_broadcast_over_response_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(algos.token_advantages(t([0.5, -2.0]), mask), [[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]])


# --- GAE ----------------------------------------------------------------------

GAMMA, LAM = 0.9, 0.8


def two_token_gae_by_hand(r0, r1, v0, v1):
    """A_1 = r1 - v1 (nothing after the last token); A_0 = delta_0 + gamma * lam * A_1."""
    a1 = r1 + GAMMA * 0.0 - v1
    a0 = (r0 + GAMMA * v1 - v0) + GAMMA * LAM * a1
    return a0, a1


def test_gae_two_tokens_matches_hand_recursion_and_whitens():
    rewards, values, mask = t([[0.0, 1.0]]), t([[0.5, 0.2]]), t([[1, 1]])
    a0, a1 = two_token_gae_by_hand(0.0, 1.0, 0.5, 0.2)  # 0.256, 0.8
    advantages, returns = algos.gae_advantages(rewards, values, mask, GAMMA, LAM)
    close(returns, [[a0 + 0.5, a1 + 0.2]])  # returns = pre-whitening A + V
    # Two values whitened with the unbiased variance land on -+1/sqrt(2).
    close(advantages, [[-1 / math.sqrt(2), 1 / math.sqrt(2)]])


def test_gae_padding_and_whitening_over_the_batch():
    rewards = t([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    values = t([[0.5, 0.2, 7.0], [1.5, 3.0, 4.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    a0, a1 = two_token_gae_by_hand(0.0, 1.0, 0.5, 0.2)
    b0 = 2.0 - 1.5  # last token of row 1: r - v
    raw = [[a0, a1, 0.0], [b0, 0.0, 0.0]]  # trailing padding carries A = 0
    advantages, returns = algos.gae_advantages(rewards, values, mask, GAMMA, LAM)
    close(returns, [[a0 + 0.5, a1 + 0.2, 7.0], [b0 + 1.5, 3.0, 4.0]])

    real = [a0, a1, b0]
    mean = sum(real) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in real) / 2)
    close(advantages, [[(x - mean) / std for x in row] for row in raw])
    close(algos.masked_mean(advantages, mask), 0.0)


def test_gae_skips_masked_tokens_inside_a_response():
    # The middle token is masked out (an observation): its reward and value are
    # ignored, and it carries the next response token's advantage.
    rewards, values, mask = t([[0.0, 5.0, 1.0]]), t([[0.5, 9.0, 0.2]]), t([[1, 0, 1]])
    a0, a1 = two_token_gae_by_hand(0.0, 1.0, 0.5, 0.2)
    _, returns = algos.gae_advantages(rewards, values, mask, GAMMA, LAM)
    close(returns, [[a0 + 0.5, a1 + 9.0, a1 + 0.2]])


# --- loss aggregation ---------------------------------------------------------

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
UNEQUAL_MASK = [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        # verl's: the responses' token sums summed (not averaged over the 2 responses),
        # divided by the padded width 3, not by each response's own length: 3.333 (the
        # formula this project had, which also divided by 2, gave 1.667)
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) + 4) / 3),
    ],
)
def test_agg_loss_modes_on_unequal_lengths(mode, expected):
    close(algos.agg_loss(t(LOSS), t(UNEQUAL_MASK), mode), expected)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_leaves_out_fully_masked_responses(mode):
    with_empty_row = algos.agg_loss(
        t([*LOSS, [7.0, 8.0, 9.0]]), t([*UNEQUAL_MASK, [0, 0, 0]]), mode
    )
    close(with_empty_row, algos.agg_loss(t(LOSS), t(UNEQUAL_MASK), mode).item())


def test_seq_mean_token_sum_norm_divides_by_the_given_max_length():
    loss = algos.agg_loss(t(LOSS), t(UNEQUAL_MASK), "seq-mean-token-sum-norm", norm_length=10)
    close(loss, ((1 + 2 + 3) + 4) / 10)


def test_agg_loss_rejects_unknown_mode_listing_valid_ones():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        algos.agg_loss(t(LOSS), t(UNEQUAL_MASK), "seq-sum")


# --- policy loss --------------------------------------------------------------


def test_policy_loss_clipping_and_dual_clip_by_hand():
    # low = high = 0.2 -> ratio clipped to [0.8, 1.2]; clip_ratio_c = 3.
    #   a: A=+1,   ratio 1.5 -> max(-1.5, -1.2) = -1.2             (clipped)
    #   b: A=-1,   ratio 5   -> max(5, 1.2) = 5, dual-clip min(5, 3) = 3
    #   c: A=-1,   ratio 0.5 -> max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8 (clipped)
    #   d: A=+0.5, ratio 1   -> -0.5
    # Row 1's last two positions are padding with an absurd ratio and advantage.
    ratios = [[1.5, 5.0, 0.5], [1.0, 1e6, 1e6]]
    log_prob = t([[math.log(r) for r in row] for row in ratios])
    old_log_prob = torch.zeros_like(log_prob)
    advantages = t([[1.0, -1.0, -1.0], [0.5, -100.0, 100.0]])
    mask = t(UNEQUAL_MASK)

    loss, stats = algos.policy_loss(
        log_prob, old_log_prob, advantages, mask, 0.2, 0.2, 3.0, "token-mean"
    )
    close(loss, (-1.2 + 3.0 + 0.8 - 0.5) / 4)
    close(stats["pg_clipfrac"], 2 / 4)  # a and c
    close(stats["pg_clipfrac_lower"], 1 / 4)  # b
    close(stats["ppo_kl"], -(math.log(1.5) + math.log(5.0) + math.log(0.5) + 0.0) / 4)

    loss, _ = algos.policy_loss(
        log_prob, old_log_prob, advantages, mask, 0.2, 0.2, 3.0, "seq-mean-token-mean"
    )
    close(loss, ((-1.2 + 3.0 + 0.8) / 3 + -0.5) / 2)


def test_policy_loss_asymmetric_clip_range():
    # low 0.2, high 0.28 (DAPO clip-higher): ratio 1.5 with A=+1 is cut at 1.28, ratio 0.5 with A=-1 at 0.8.
    log_prob, old = t([[math.log(1.5), math.log(0.5)]]), t([[0.0, 0.0]])
    advantages, mask = t([[1.0, -1.0]]), t([[1, 1]])
    loss, _ = algos.policy_loss(log_prob, old, advantages, mask, 0.2, 0.28, 3.0, "token-mean")
    close(loss, (-1.28 + 0.8) / 2)


def test_policy_loss_clamps_log_ratio_at_20():
    log_prob, old = t([[50.0, 0.0]]), t([[0.0, 0.0]])
    _, stats = algos.policy_loss(
        log_prob, old, t([[1.0, 1.0]]), t([[1, 1]]), 0.2, 0.2, 3.0, "token-mean"
    )
    close(stats["ppo_kl"], (-20.0 + 0.0) / 2)


def test_policy_loss_rejects_clip_ratio_c_not_above_one():
    zeros = t([[0.0]])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.policy_loss(zeros, zeros, zeros, t([[1]]), 0.2, 0.2, 1.0, "token-mean")


def test_policy_loss_importance_weights_scale_tokens_and_get_no_gradient():
    # Nothing clipped: ratio 1, so loss = mean(-A * w * ratio) and
    # d loss / d log_prob_t = -A_t * w_t * ratio_t / N.
    log_prob = t([[0.0, 0.0]]).requires_grad_()
    is_weights = t([[0.5, 2.0]]).requires_grad_()
    advantages = t([[2.0, 1.0]])
    loss, _ = algos.policy_loss(
        log_prob, t([[0.0, 0.0]]), advantages, t([[1, 1]]), 0.2, 0.2, 3.0, "token-mean", is_weights
    )
    close(loss, (-2.0 * 0.5 + -1.0 * 2.0) / 2)
    loss.backward()
    close(log_prob.grad, [[-2.0 * 0.5 / 2, -1.0 * 2.0 / 2]])
    assert is_weights.grad is None


def test_policy_loss_stats_are_detached():
    log_prob = t([[0.1, -0.2]]).requires_grad_()
    _, stats = algos.policy_loss(
        log_prob, t([[0.0, 0.0]]), t([[1.0, -1.0]]), t([[1, 1]]), 0.2, 0.2, 3.0, "token-mean"
    )
    assert set(stats) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert not any(value.requires_grad for value in stats.values())


# --- KL, entropy, value loss --------------------------------------------------

LOGP = [[-1.0, -2.0]]
REF = [[-1.5, -1.0]]  # logp - ref = [0.5, -1.0]; ref - logp = [-0.5, 1.0]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [[0.5, -1.0]]),
        ("abs", [[0.5, 1.0]]),
        ("mse", [[0.5 * 0.25, 0.5 * 1.0]]),
        ("low_var_kl", [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]]),
        ("k1", [[0.5, -1.0]]),
        ("k2", [[0.5 * 0.25, 0.5 * 1.0]]),
        ("k3", [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]]),
        ("k1+", [[0.5, -1.0]]),
        ("k2+", [[0.5 * 0.25, 0.5 * 1.0]]),
        ("k3+", [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]]),
        ("low_var_kl+", [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]]),
    ],
)
def test_kl_penalty_kinds(kind, expected):
    close(algos.kl_penalty(t(LOGP), t(REF), kind), expected)


# d/d logp of each estimator at logp - ref = [0.5, -1.0] (ref - logp = [-0.5, 1.0]):
#   k1: 1; k2: logp - ref; k3: d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
K2_GRAD = [[0.5, -1.0]]


@pytest.mark.parametrize(
    ("kind", "expected_grad"),
    [
        ("k1", [[1.0, 1.0]]),
        ("k2", K2_GRAD),
        ("k3", [[1 - math.exp(-0.5), 1 - math.exp(1.0)]]),
        ("k1+", K2_GRAD),
        ("k2+", K2_GRAD),
        ("k3+", K2_GRAD),
        ("abs+", K2_GRAD),
    ],
)
def test_kl_plus_kinds_take_the_gradient_of_k2(kind, expected_grad):
    logp = t(LOGP).requires_grad_()
    algos.kl_penalty(logp, t(REF), kind).sum().backward()
    close(logp.grad, expected_grad)


def test_low_var_kl_is_clamped_to_ten():
    # ref - logp = 15: exp(15) - 16 is huge -> 10. ref - logp = -30: clamped to -20
    # first, exp(-20) + 20 - 1 ~ 19 -> 10.
    close(algos.kl_penalty(t([[0.0, 0.0]]), t([[15.0, -30.0]]), "low_var_kl"), [[10.0, 10.0]])


def test_kl_penalty_rejects_unknown_kind_listing_valid_ones():
    with pytest.raises(ValueError, match="k1, kl, k2, mse, k3, low_var_kl, abs, k1\\+"):
        algos.kl_penalty(t(LOGP), t(REF), "full")


def test_entropy_from_logits():
    # position 0: uniform over 2 -> ln 2; position 1: p = [1/4, 3/4].
    logits = t([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    expected = [[math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]
    close(algos.entropy_from_logits(logits), expected)


def test_value_loss_by_hand():
    # c = 0.2.
    #   token 0: v 1.0, v_old 0.5, R 2.0 -> clip(1.0) = 0.7; (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 1.69 (clipped)
    #   token 1: v 2.5, v_old 2.0, R 1.0 -> clip(2.5) = 2.2; (1.5)^2 = 2.25, (1.2)^2 = 1.44 -> 2.25
    #   token 2: padding
    vpreds = t([[1.0, 2.5, 50.0]])
    values_old = t([[0.5, 2.0, 0.0]])
    returns = t([[2.0, 1.0, -50.0]])
    loss, clipfrac = algos.value_loss(
        vpreds, values_old, returns, t([[1, 1, 0]]), 0.2, "token-mean"
    )
    close(loss, 0.5 * (1.69 + 2.25) / 2)
    close(clipfrac, 1 / 2)


# --- rollout importance weights -----------------------------------------------

# old - rollout = [[0.5, -1, pad], [1, 0.5, pad]]
OLD = [[-1.0, -2.0, -0.5], [0.0, 0.0, 0.0]]
ROLLOUT = [[-1.5, -1.0, -9.0], [-1.0, -0.5, -9.0]]
IS_MASK = [[1, 1, 0], [1, 1, 0]]


def test_token_importance_weights_truncate_each_token():
    weights = algos.rollout_importance_weights(t(OLD), t(ROLLOUT), t(IS_MASK), "token", 1.5)
    # exp(0.5) = 1.649 -> 1.5; exp(-1) = 0.368; exp(1) = 2.718 -> 1.5; exp(0.5) -> 1.5
    close(weights, [[1.5, math.exp(-1.0), 0.0], [1.5, 1.5, 0.0]])


def test_sequence_importance_weights_share_one_truncated_weight():
    weights = algos.rollout_importance_weights(t(OLD), t(ROLLOUT), t(IS_MASK), "sequence", 1.5)
    row0 = math.exp(0.5 - 1.0)  # 0.607, under the threshold
    row1 = min(math.exp(1.0 + 0.5), 1.5)  # 4.48 -> 1.5
    close(weights, [[row0, row0, 0.0], [row1, row1, 0.0]])


@pytest.mark.parametrize("level", algos.IS_LEVELS)
def test_importance_weights_do_not_overflow_and_are_detached(level):
    old = t([[1000.0, 1000.0], [-1000.0, -1000.0]]).requires_grad_()
    weights = algos.rollout_importance_weights(
        old, t([[0.0, 0.0], [0.0, 0.0]]), t([[1, 1], [1, 1]]), level, 2.0
    )
    assert not weights.requires_grad
    close(weights[0], [2.0, 2.0])
    assert torch.all(torch.isfinite(weights)) and torch.all(weights[1] >= 0)


def test_importance_weights_reject_unknown_level():
    with pytest.raises(ValueError, match="token, sequence"):
        algos.rollout_importance_weights(t(OLD), t(ROLLOUT), t(IS_MASK), "geometric", 2.0)


def test_masked_importance_weights_keep_those_inside_the_bounds_whole():
    # ratios exp(old - rollout): [[1.649, 0.368, pad], [2.718, 1.649, pad]]
    weights = algos.rollout_importance_weights(
        t(OLD), t(ROLLOUT), t(IS_MASK), "token", 2.0, mode="mask", lower=0.5
    )
    close(weights, [[math.exp(0.5), 0.0, 0.0], [0.0, math.exp(0.5), 0.0]])
    # no lower bound (AReaL's decoupled PPO cap): only the one above 2.0 trains nothing
    weights = algos.rollout_importance_weights(t(OLD), t(ROLLOUT), t(IS_MASK), "token", 2.0,
                                               mode="mask")  # fmt: skip
    close(weights, [[math.exp(0.5), math.exp(-1.0), 0.0], [0.0, math.exp(0.5), 0.0]])


def test_masked_importance_weights_equal_icepops_published_form():
    """OpenRLHF's "icepop" (openrlhf/models/loss.py): k = exp(old - rollout), weight
    k * (low <= k <= high), bounds included, on random log-probs and at both bounds."""
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(6, 9, generator=gen, dtype=torch.float64) - 2.0
    rollout = old + torch.randn(6, 9, generator=gen, dtype=torch.float64)
    rollout[0, :2] = old[0, :2] - torch.log(torch.tensor([0.5, 5.0], dtype=torch.float64))
    mask = (torch.rand(6, 9, generator=gen) > 0.2).double()
    k = torch.exp(old - rollout)
    expected = k * ((k >= 0.5) & (k <= 5.0)) * mask
    got = algos.rollout_importance_weights(old, rollout, mask, "token", 5.0, "mask", 0.5)
    close(got, expected)
    assert 0 < int(((got == 0) & (mask > 0)).sum()) < int(mask.sum())  # some masked, not all


def test_importance_weights_reject_unknown_mode_and_mask_per_sequence():
    with pytest.raises(ValueError, match="truncate, mask"):
        algos.rollout_importance_weights(t(OLD), t(ROLLOUT), t(IS_MASK), "token", 2.0, "clip")
    with pytest.raises(ValueError, match="per token"):
        algos.rollout_importance_weights(t(OLD), t(ROLLOUT), t(IS_MASK), "sequence", 2.0, "mask")


# --- M2PO ---------------------------------------------------------------------------


def areal_m2po_kept(squared: list[float], threshold: float) -> list[bool]:
    """AReaL's selection as published (areal/engine/ppo/actor.py ``get_m2po_loss_mask``),
    step by step: sort descending, mask the k largest for the first k whose remaining mean
    is below the threshold (none found: all but the smallest)."""
    order = sorted(range(len(squared)), key=lambda i: -squared[i])
    values = [squared[i] for i in order]
    k = next(
        (i for i in range(len(values)) if sum(values[i:]) / len(values[i:]) < threshold),
        len(values) - 1,
    )
    kept = [True] * len(squared)
    for i in order[:k]:
        kept[i] = False
    return kept


def test_m2po_masks_the_largest_until_the_second_moment_is_below_the_threshold():
    # sorted: 0.25, 0.09, 0.01, 0.0001; mean 0.0875 >= 0.04; without 0.25: 0.0334 < 0.04
    squared = torch.tensor([0.01, 0.25, 0.0001, 0.09], dtype=torch.float64)
    assert algos.m2po_cutoff(squared, 0.04) == pytest.approx(0.25)  # 0.25 and above masked
    assert algos.m2po_cutoff(squared, 0.1) == float("inf")  # already below: none masked
    assert algos.m2po_cutoff(squared, 1e-6) == pytest.approx(0.01)  # never: the smallest kept
    assert algos.m2po_cutoff(torch.zeros(0, dtype=torch.float64), 0.04) == float("inf")


@pytest.mark.parametrize("seed", range(5))
def test_m2po_keeps_what_areals_selection_keeps(seed):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(5, 11, generator=gen, dtype=torch.float64) - 2.0
    rollout = old + 0.3 * torch.randn(5, 11, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 11, generator=gen) > 0.3).double()
    squared = ((rollout - old) ** 2)[mask > 0]
    cutoff = algos.m2po_cutoff(squared, 0.04)
    keep = algos.m2po_keep(old, rollout, mask, cutoff)
    assert keep[mask > 0].bool().tolist() == areal_m2po_kept(squared.tolist(), 0.04)
    assert not keep[mask == 0].any()
    kept = squared[keep[mask > 0].bool()]
    assert 0 < kept.numel() < squared.numel() and float(kept.mean()) < 0.04


def test_m2po_masks_every_token_equal_to_the_smallest_one_masked():
    """AReaL masks a count of tokens in its sort's order, which of equal values arbitrary:
    of [0.1, 0.1, 0] at 0.06 it masks one 0.1 (the other kept: mean 0.05). Here both go,
    whatever the order: what is kept stays below the threshold on any split of the batch."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = torch.tensor([[0.1**0.5, -(0.1**0.5), 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    cutoff = algos.m2po_cutoff(((rollout - old) ** 2).flatten(), 0.06)
    assert algos.m2po_keep(old, rollout, mask, cutoff).tolist() == [[0.0, 0.0, 1.0]]
    assert areal_m2po_kept([0.1, 0.1, 0.0], 0.06).count(False) == 1


# --- losses over a mini-batch split into parts (micro-batches, trainer ranks) ---------------


def test_agg_loss_share_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # the whole mini-batch has 6 tokens in 3 responses; this part is 4 of them, 2 responses
    assert algos.agg_loss_share(loss, mask, "token-mean", 6, 3).item() == pytest.approx(10 / 6)
    assert algos.agg_loss_share(loss, mask, "seq-mean-token-sum", 6, 3).item() == pytest.approx(
        (6 + 4) / 3
    )
    assert algos.agg_loss_share(loss, mask, "seq-mean-token-mean", 6, 3).item() == pytest.approx(
        (2 + 4) / 3
    )
    assert algos.agg_loss_share(
        loss, mask, "seq-mean-token-sum-norm", 6, 3, norm_length=4
    ).item() == pytest.approx((6 + 4) / 4)  # no division by the 3 responses (verl)
    assert algos.loss_normalisers(mask).tolist() == [4.0, 2.0]


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_shares_of_any_split_add_up_to_the_whole_batch_loss(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(10, 7, generator=g)
    lengths = torch.tensor([7, 1, 3, 0, 5, 2, 7, 4, 6, 1])
    mask = (torch.arange(7)[None] < lengths[:, None]).int()
    whole = algos.agg_loss(loss, mask, mode)
    tokens, seqs = algos.loss_normalisers(mask).tolist()
    for cuts in ([10], [5, 5], [1, 2, 3, 4], [3, 3, 3, 1]):
        parts = zip(loss.split(cuts), mask.split(cuts), strict=True)
        total = sum(
            algos.agg_loss_share(lp, mp, mode, tokens, seqs, norm_length=7) for lp, mp in parts
        )
        assert total.item() == pytest.approx(whole.item(), rel=1e-6), cuts
    # a per-part mean (what the old code did) is not the same number on this batch
    halves = [
        algos.agg_loss(lp, mp, mode) for lp, mp in zip(loss.split(5), mask.split(5), strict=True)
    ]
    if mode != "seq-mean-token-mean":
        assert abs(sum(halves).item() / 2 - whole.item()) > 1e-3


def test_whitening_with_summed_moments_equals_whitening_the_whole():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.3).int()
    whole = algos.masked_whiten(values, mask)
    moments = algos.masked_moments(values[:3], mask[:3]) + algos.masked_moments(
        values[3:], mask[3:]
    )
    parts = torch.cat(
        [algos.whiten_with(values[:3], moments), algos.whiten_with(values[3:], moments)]
    )
    assert torch.allclose(parts, whole, atol=1e-6)


# --- RLOO and REINFORCE++ -------------------------------------------------------------------


def test_rloo_subtracts_the_mean_of_the_other_responses():
    scores = t([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    # group 0: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2; group 1: 0 - 1/2, 0 - 1/2, 1 - 0
    close(algos.rloo_advantages(scores), [[-1.5, 0.0, 1.5], [-0.5, -0.5, 1.0]])
    close(algos.rloo_advantages(t([[3.0]])), [[3.0]])  # no other response: verl's raw reward


def test_reinforce_pp_baseline_whitens_over_tokens_weighted_by_length():
    scores = t([[1.0, 0.0], [1.0, 1.0]])
    lengths = t([[2, 1], [1, 2]])
    # centred by the group mean: [0.5, -0.5], [0, 0]; over the 6 tokens:
    c = [0.5, -0.5, 0.0, 0.0]
    w = [2, 1, 1, 2]
    mu = sum(wi * ci for wi, ci in zip(w, c, strict=True)) / 6  # 1/12
    var = sum(wi * (ci - mu) ** 2 for wi, ci in zip(w, c, strict=True)) / 5
    expected = [(ci - mu) / math.sqrt(var + 1e-8) for ci in c]
    close(algos.reinforce_pp_baseline_advantages(scores, lengths), [expected[:2], expected[2:]])
    # the same as whitening the (B, L) tiled advantages over the response tokens (verl's way)
    tiled = t([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = t([[1, 1], [1, 0], [1, 0], [1, 1]])
    verl_way = algos.masked_whiten(tiled, mask)[:, 0].reshape(2, 2)
    close(verl_way, [expected[:2], expected[2:]])


def test_reinforce_pp_discounts_returns_and_whitens_them():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: row 0 returns 0.25, 0.5, 1; row 1 (last token at t=1) 1, 2, and 0 on padding
    advantages, returns = algos.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    values = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean = sum(values) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 4 + 1e-8)
    w = [(v - mean) / std for v in values]
    close(advantages, [w[:3], [w[3], w[4], 0.0]])


def test_reinforce_pp_passes_through_an_observation_token():
    # a masked-out token inside a response (an observation) is a hole, as in GAE: the
    # return reaches the tokens before it (verl's resets there) and the hole counts no
    # discount step: gamma 0.5 gives 0.5 one trained token before the reward
    _, returns = algos.reinforce_pp_advantages(t([[0.0, 0.0, 1.0]]), t([[1, 0, 1]]), 0.5, False)
    close(returns[:, [0, 2]], [[0.5, 1.0]])  # (the hole's own return is never trained on)


def test_a_multi_turn_responses_reward_sits_on_its_last_trained_token():
    """Tokens 1-2 are an observation, token 5 padding: the reward goes on token 4 (not on
    token 2, the count of trained tokens minus one, where GAE would drop it), and the
    return reaches token 0 over the hole with two discount steps, not four."""
    from hpc_asyncppo.config import Config
    from hpc_asyncppo.trainer.advantages import token_advantages

    algo = Config().algorithm
    algo.adv_estimator, algo.gamma, algo.lam = "gae", 0.5, 1.0
    mask = t([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    batch = {"rewards": t([1.0, 0.0]), "response_mask": mask}
    out = token_advantages(algo, batch, torch.zeros_like(mask), lambda x: x)
    close(out["returns"][0, [0, 3, 4]], [0.25, 0.5, 1.0])


# --- GSPO -----------------------------------------------------------------------------------


def test_gspo_uses_one_geometric_mean_ratio_per_response():
    log_prob = t([[-1.0, -2.0], [-0.5, 0.0]]).requires_grad_()
    old = t([[-1.2, -1.9], [-1.0, 0.0]])
    mask = t([[1, 1], [1, 0]])
    adv = t([[1.0, 1.0], [1.0, 1.0]])
    loss, stats = algos.gspo_policy_loss(log_prob, old, adv, mask, 0.2, 0.2)
    # row 0: log-ratios 0.2, -0.1 -> s = exp(0.05) on both tokens, inside [0.8, 1.2]
    s0 = math.exp(0.05)
    # row 1: log-ratio 0.5 -> s = exp(0.5) = 1.65, clipped to 1.2 (A > 0): loss -1.2, no gradient
    expected = (-s0 + -1.2) / 2  # seq-mean-token-mean of [-s0, -s0] and [-1.2]
    assert loss.item() == pytest.approx(expected, abs=1e-7)  # verl's +1e-8 in the means
    loss.backward()
    # d(-A * s_t)/d logp_t = -s0 on each token of row 0, / 2 tokens / 2 responses
    close(log_prob.grad, [[-s0 / 4, -s0 / 4], [0.0, 0.0]])
    assert stats["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    assert stats["ppo_kl"].item() == pytest.approx(-(0.2 - 0.1 + 0.5) / 3)


def test_gspo_has_no_dual_clip_and_ignores_token_level_ratios():
    # A < 0, mean log-ratio 1.5: s = exp(1.5) = 4.48 -> max(4.48, 1.2 * 1) = 4.48, where
    # token-level dual-clip PPO would stop at clip_ratio_c = 3
    log_prob = t([[0.0, 0.0]])
    old = t([[-1.0, -2.0]])
    mask = t([[1, 1]])
    adv = t([[-1.0, -1.0]])
    loss, _ = algos.gspo_policy_loss(log_prob, old, adv, mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(math.exp(1.5))
    ppo, _ = algos.policy_loss(log_prob, old, adv, mask, 0.2, 0.2, 3.0, "seq-mean-token-mean")
    assert ppo.item() == pytest.approx((math.exp(1.0) + 3.0) / 2)


def test_gspo_shares_of_a_split_add_up():
    g = torch.Generator().manual_seed(2)
    log_prob, old = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    adv = torch.randn(6, 1, generator=g).expand(6, 4)
    mask = (torch.arange(4)[None] < torch.tensor([4, 1, 3, 2, 4, 1])[:, None]).int()
    whole, _ = algos.gspo_policy_loss(log_prob, old, adv, mask, 0.2, 0.3)
    norms = tuple(algos.loss_normalisers(mask).tolist())
    parts = [
        algos.gspo_policy_loss(log_prob[i:j], old[i:j], adv[i:j], mask[i:j], 0.2, 0.3,
                               normalisers=norms)[0]
        for i, j in ((0, 1), (1, 4), (4, 6))
    ]  # fmt: skip
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)


# --- rejection sampling, dynamic sampling, overlong penalty -----------------------------------

# old - rollout log-ratios: row 0 ratios 3, 1, 0.4; row 1 ratios 1.5, 1.5 and padding
RS_OLD = [[math.log(3.0), 0.0, math.log(0.4)], [math.log(1.5), math.log(1.5), 0.0]]
RS_ROLLOUT = [[0.0, 0.0, 0.0], [0.0, 0.0, math.nan]]
RS_MASK = [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize(
    ("level", "lower", "expected"),
    [
        # bounds [1/2, 2]: 3 and 0.4 fall outside
        ("token", None, [[0, 1, 0], [1, 1, 0]]),
        ("token", 0.3, [[0, 1, 1], [1, 1, 0]]),
        # products: row 0 3 * 1 * 0.4 = 1.2 (kept), row 1 1.5 * 1.5 = 2.25 (rejected)
        ("sequence", None, [[1, 1, 1], [0, 0, 0]]),
        # geometric means: row 0 1.2^(1/3) = 1.06, row 1 1.5: both kept
        ("geometric", None, [[1, 1, 1], [1, 1, 0]]),
    ],
)
def test_rollout_rejection_mask_by_hand(level, lower, expected):
    keep = algos.rollout_rejection_mask(t(RS_OLD), t(RS_ROLLOUT), t(RS_MASK), level, 2.0, lower)
    close(keep, expected)


def test_rejection_counts_by_hand():
    keep = algos.rollout_rejection_mask(t(RS_OLD), t(RS_ROLLOUT), t(RS_MASK), "token", 2.0)
    # 2 of 5 response tokens rejected, both in response 0 (1 of 2 responses)
    assert algos.rejection_counts(keep, t(RS_MASK)).tolist() == [2.0, 5.0, 1.0, 2.0]


def test_geometric_rejection_with_tight_bounds():
    # bounds [0.95, 1.1]: row 0's 1.06 stays, row 1's 1.5 goes
    keep = algos.rollout_rejection_mask(
        t(RS_OLD), t(RS_ROLLOUT), t(RS_MASK), "geometric", 1.1, 0.95
    )
    close(keep, [[1, 1, 1], [0, 0, 0]])


def test_rejection_bounds_pi_old_over_pi_rollout_where_verl_bounds_the_inverse():
    """Bounds [0.5, 3.5] (lower != 1 / upper, where the two directions differ): row 0's
    pi_old / pi_rollout ratios 3, 1, 0.4. Here 3 is kept and 0.4 rejected; verl b178a3c,
    bounding pi_rollout / pi_old = 1/3, 1, 2.5, would reject the first and keep the last."""
    keep = algos.rollout_rejection_mask(t(RS_OLD), t(RS_ROLLOUT), t(RS_MASK), "token", 3.5, 0.5)
    close(keep[0], [1, 1, 0])


def test_sequence_rejection_clamps_the_sum_not_each_token():
    """Token log-ratios 30 and -15: the sum 15 (ratio e^15 > 2) is rejected. verl clamps
    each token first (20 - 15 = 5, still > log 2 here), so take bounds that tell them
    apart: upper e^10. The clamped sum 15 is rejected; verl's 5 would be kept."""
    old, rollout, mask = t([[30.0, -15.0]]), t([[0.0, 0.0]]), t([[1, 1]])
    keep = algos.rollout_rejection_mask(old, rollout, mask, "sequence", math.exp(10.0), 0.0)
    close(keep, [[0, 0]])
    # and a sum beyond the bound is clamped to it, never overflowing exp
    keep = algos.rollout_rejection_mask(t([[30.0, 30.0]]), rollout, mask, "sequence", 1e30, 0.0)
    close(keep, [[1, 1]])


def test_rollout_rejection_mask_rejects_unknown_level():
    with pytest.raises(ValueError, match="token, sequence, geometric"):
        algos.rollout_rejection_mask(t(RS_OLD), t(RS_ROLLOUT), t(RS_MASK), "group", 2.0)


def test_groups_with_equal_rewards_have_no_variance():
    metric = t([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.1, 0.1, 0.1], [0.25, 0.5, 0.25]])
    assert algos.has_reward_variance(metric).tolist() == [False, True, False, True]
    assert algos.has_reward_variance(t([[5.0], [2.0]])).tolist() == [True, True]


def test_overlong_penalty_ramps_over_the_buffer():
    # max 10 tokens, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10
    lengths = torch.tensor([[5, 6, 7], [8, 9, 10]])
    close(algos.overlong_penalty(lengths, 10, 4, 1.0), [[0.0, 0.0, -0.25], [-0.5, -0.75, -1.0]])
    close(algos.overlong_penalty(torch.tensor([10, 3]), 10, 4, 0.5), [-0.5, 0.0])
