"""The PPO/GRPO math: advantages, losses, KL penalties, importance weights and the recipes
(DAPO dynamic sampling and overlong penalty, RLOO, REINFORCE++, GSPO, rejection sampling).

Pure torch functions, no state. The math follows verl's `core_algos.py` and
`torch_functional.py` (volcengine/verl) so that numbers are comparable with verl
runs; the few deliberate differences are marked "Differs from verl" in docstrings.

Shape names used throughout:
    B  responses in the batch
    L  padded response length (tokens)
    V  vocabulary size
    G  prompt groups, n responses per group (GRPO), so B = G * n

`response_mask` (B, L) is 1 on the response's own tokens and 0 on padding (and
on tool/observation tokens in multi-turn responses). It may be bool, int or
float. Every mean, variance and loss below is taken over it.

Why one long file: every formula a recipe uses sits beside the others it is compared with
(and with verl's), so that a difference between recipes reads in one place; each function
is short and pure.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# Each name -> the estimator it computes (verl's names and aliases); a "+" suffix keeps the
# value and takes k2's gradient (straight-through), as verl's kl_penalty.
_KL_ESTIMATORS = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "abs": "abs",
}
KL_KINDS = (*_KL_ESTIMATORS, *(f"{name}+" for name in _KL_ESTIMATORS))
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
RS_LEVELS = ("token", "sequence", "geometric")

# Bound on a log-ratio before exp(): exp(20) ~ 4.9e8 is finite in bf16/fp32.
LOG_RATIO_BOUND = 20.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set; NaN/inf in masked-out positions are ignored.

    Args:
        values: any shape, e.g. (B, L).
        mask: same shape as `values`.
        dim: dimension to reduce; None reduces everything to a scalar.
    """
    # torch.where, not values * mask alone: NaN * 0 is NaN, and padding may hold NaN.
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is set (verl's `masked_mean`).

    Args:
        values: any shape, e.g. (B, L).
        mask: same shape as `values`.
        dim: dimension to reduce; None gives a scalar.

    Returns:
        `values`' shape with `dim` removed (a scalar when dim is None). An empty
        mask gives 0, not NaN (the denominator carries +1e-8 as in verl).
    """
    return masked_sum(values, mask, dim) / (mask.sum(dim=dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over all masked positions, scalar (verl's `masked_var`).

    Args:
        values: any shape, e.g. (B, L).
        mask: same shape as `values`.
        unbiased: apply Bessel's correction n / (n - 1), n = number of masked positions.

    Raises:
        ValueError: when `unbiased` and fewer than two positions are masked in.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(
                f"unbiased masked variance needs at least 2 masked-in values, got {int(count)}"
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8), statistics over masked positions only.

    Args:
        values: any shape, e.g. (B, L).
        mask: same shape as `values`; needs at least 2 positions set (unbiased variance).
        shift_mean: if False, the mean is added back, so only the scale changes.

    Returns:
        Same shape as `values`. Masked-out positions are transformed too, not
        zeroed (as in verl); losses must mask them.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantage of each response: (r - group mean) / (group std + eps).

    Args:
        scores: (G, n) one scalar reward per response, row g holding the n
            responses to prompt g.
        norm_by_std: divide by the group's unbiased std (GRPO). False keeps only
            r - mean (Dr.GRPO, https://arxiv.org/abs/2503.20783).
        eps: added to the std so a group of equal rewards gives 0, not NaN.

    Returns:
        (G, n) advantages, detached.

    Differs from verl: with n == 1 verl uses mean 0 and std 1, so the raw
    reward becomes the advantage; here a lone response gets 0, because there is
    no group to be relative to and a raw reward would be on another scale.
    """
    if scores.shape[-1] == 1:
        return torch.zeros_like(scores)
    centered = scores - scores.mean(dim=-1, keepdim=True)
    if not norm_by_std:
        return centered
    return centered / (scores.std(dim=-1, keepdim=True) + eps)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (https://arxiv.org/abs/2402.14740; verl's
    `compute_rloo_outcome_advantage`): each response's reward minus the mean reward of the
    other n - 1 responses to its prompt, i.e. (r - group mean) * n / (n - 1).

    Args:
        scores: (G, n) one scalar reward per response.

    Returns:
        (G, n) advantages, detached. With n == 1 there is no other response: the reward
        itself, as in verl (config validation asks for n >= 2).
    """
    n = scores.shape[-1]
    if n == 1:
        return scores.clone()
    return (scores - scores.mean(dim=-1, keepdim=True)) * n / (n - 1)


@torch.no_grad()
def reinforce_pp_baseline_advantages(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline (https://arxiv.org/abs/2501.03262; verl's
    `compute_reinforce_plus_plus_baseline_outcome_advantage`): r - group mean, spread over
    the response's tokens, then whitened over every token of the batch.

    Whitening over tokens weights each response by its length: with c_i = r_i - mean of
    its group and N = sum of lengths, mu = sum(len_i * c_i) / N and
    var = sum(len_i * (c_i - mu)^2) / (N - 1); A_i = (c_i - mu) / sqrt(var + 1e-8), the
    same on each of its tokens (verl's masked_whiten of the tiled (B, L) scores).

    Args:
        scores: (G, n) one scalar reward per response.
        lengths: (G, n) response lengths in tokens (the masked tokens of each response).

    Returns:
        (G, n) advantages, detached, float64. Needs at least 2 tokens in the batch. A
        group of one response has baseline 0, as in verl.

    Differs from verl as `whiten_with`: mu and var divide by N, verl's by N + 1e-8.
    """
    scores, weights = scores.double(), lengths.double()
    baseline = scores.mean(dim=-1, keepdim=True) if scores.shape[-1] > 1 else 0.0
    centered = scores - baseline
    count = weights.sum()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 response tokens, got {int(count)}")
    mu = (weights * centered).sum() / count
    var = (weights * (centered - mu) ** 2).sum() / (count - 1)
    return (centered - mu) / torch.sqrt(var + 1e-8)


def token_advantages(adv_per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Spread one advantage per response over its tokens.

    Args:
        adv_per_response: (B,), e.g. `grpo_advantages(...).reshape(-1)`.
        response_mask: (B, L).

    Returns:
        (B, L): the response's advantage on its tokens, 0 on masked-out positions.
    """
    return adv_per_response.unsqueeze(-1) * response_mask.to(adv_per_response.dtype)


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (verl's `compute_gae_advantage_return`).

    Backwards over t: delta_t = r_t + gamma * V_{t+1} - V_t and
    A_t = delta_t + gamma * lam * A_{t+1}, with V and A equal to 0 after the
    last token. Masked-out positions are skipped: the running next value and
    advantage pass through them unchanged, so trailing padding gets A = 0 and a
    masked observation token in the middle gets the advantage of the next
    response token.

    Args:
        token_rewards: (B, L) reward at each token (usually only the last is non-zero).
        values: (B, L) critic values at each token.
        response_mask: (B, L); needs at least 2 positions set in the batch (whitening).
        gamma: discount factor.
        lam: GAE lambda.
        whiten: False returns A_t as it is, for a caller that whitens with moments
            taken over more than this batch (`whiten_with`, several trainer ranks).

    Returns:
        advantages: (B, L) A_t whitened over the masked positions of the whole
            batch (padding positions are whitened too, as in verl, not zeroed).
        returns: (B, L) A_t + V_t before whitening, the critic's target.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        next_advantage = torch.where(mask[:, t] > 0, advantage, next_advantage)
        advantages[:, t] = next_advantage
    returns = advantages + values
    return (masked_whiten(advantages, mask) if whiten else advantages), returns


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262; verl's
    `compute_reinforce_plus_plus_outcome_advantage`): discounted returns, whitened over
    the whole batch, no baseline and no critic.

    Backwards over t: G_t = r_t + gamma * G_{t+1} over the unmasked positions; a masked
    position is a hole the running return passes through unchanged (as GAE's does), so
    trailing padding gets G = 0 and an observation token inside a response neither cuts
    the return nor counts a discount step. Differs from verl only there: verl resets the
    running return at every masked position, which cuts a multi-turn response's return
    at its first observation; on single-turn responses the two are equal, bit for bit.
    With the reward on the last token, G_t = gamma^(k) * r, k the unmasked positions after t.

    Args:
        token_rewards: (B, L) reward at each token (usually only the last is non-zero).
        response_mask: (B, L); needs at least 2 positions set in the batch (whitening).
        gamma: discount factor.
        whiten: False returns the returns as the advantages, for a caller that whitens
            with moments over more than this batch (`whiten_with`, several trainer ranks).

    Returns:
        advantages: (B, L) returns whitened over the masked positions, times the mask.
        returns: (B, L) G_t before whitening.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        step = token_rewards[:, t] + gamma * running
        returns[:, t] = step  # at a masked position too, as verl's (never trained on)
        running = torch.where(mask[:, t] > 0, step, running)
    if not whiten:
        return returns, returns
    return masked_whiten(returns, mask) * mask, returns


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(3,) float64: count, sum and sum of squares of `values` over `mask`, to be summed
    over every part of a batch (e.g. all-reduced over trainer ranks) for `whiten_with`."""
    v = torch.where(mask.bool(), values, 0.0).double()
    m = mask.double()
    return torch.stack([m.sum(), (v * m).sum(), (v * v * m).sum()])


def whiten_with(values: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """`masked_whiten` with the moments of the whole batch (`masked_moments`, summed).

    Args:
        values: (B, L), this part of the batch.
        moments: (3,) count, sum, sum of squares over the whole batch; count >= 2.

    Returns:
        (values - mean) / sqrt(unbiased var + 1e-8), same shape as `values`.

    Differs from verl: the mean and variance divide by the count, verl's `masked_whiten`
    (`masked_mean`) by the count + 1e-8: a relative difference of about 1e-8 / count.
    """
    count, total, squares = moments.tolist()
    if count < 2:
        raise ValueError(f"unbiased masked variance needs at least 2 masked-in values, got {count}")
    mean = total / count
    var = max(squares / count - mean * mean, 0.0) * count / (count - 1)
    return ((values - mean) * (var + 1e-8) ** -0.5).to(values.dtype)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (verl's `agg_loss`, single process).

    Modes:
        "token-mean": sum over all masked tokens / number of masked tokens.
        "seq-mean-token-sum": per response sum over its tokens, then mean over responses.
        "seq-mean-token-mean": per response mean over its tokens, then mean over responses.
        "seq-mean-token-sum-norm": verl's: the sum over responses of their token sums,
            / `norm_length` (verl's `loss_scale_factor`, a constant: the longest possible
            response), with no mean over responses ("turns off seq-dim averaging"). The
            loss and its gradient grow with the number of responses; no length bias
            (Dr.GRPO's MAX_TOKENS). Before, this project also divided by the number of
            responses (Dr.GRPO's 1/G), a loss that many times smaller than verl's.
    In the seq-mean modes a response with no masked-in token is left out of the mean.
    Differs from verl: a batch with no masked-in token gives 0, verl's NaN (0 / 0).

    Args:
        loss_mat: (B, L) per-token loss.
        loss_mask: (B, L).
        loss_agg_mode: one of LOSS_AGG_MODES.
        norm_length: "seq-mean-token-sum-norm"'s divisor; None: L, the padded width (verl's
            default, the max response length when rows are padded to it).

    Returns:
        Scalar tensor. Normalisers come from this batch only: verl's
        `batch_num_tokens` / `global_batch_size` / `dp_size` arguments for
        data-parallel rescaling are not taken; the caller weights micro-batches.

    Raises:
        ValueError: unknown mode (the message lists the valid ones).
    """
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum().clamp(min=1)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    token_counts = loss_mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (token_counts + 1e-8)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_losses.sum() / (loss_mask.shape[-1] if norm_length is None else norm_length)
    return masked_mean(seq_losses, token_counts > 0)


def agg_loss_share(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_tokens: float,
    global_seqs: float,
    norm_length: float | None = None,
) -> torch.Tensor:
    """This part's share of `agg_loss` over a whole mini-batch split into parts
    (micro-batches, trainer ranks): summing the shares of every part gives `agg_loss` of
    the whole, whatever the split. verl's `agg_loss` with `batch_num_tokens` and
    `global_batch_size` does the same.

    Modes:
        "token-mean": sum over this part's masked tokens / `global_tokens`.
        "seq-mean-token-sum": sum over this part's responses of their token sums / `global_seqs`.
        "seq-mean-token-mean": sum over this part's responses of their token means / `global_seqs`.
        "seq-mean-token-sum-norm": sum over this part's responses of their token sums
            / `norm_length` (verl's: no division by `global_seqs`).

    Args:
        loss_mat: (B, L) per-token loss of this part.
        loss_mask: (B, L).
        loss_agg_mode: one of LOSS_AGG_MODES.
        global_tokens: masked tokens in the whole mini-batch (`loss_normalisers`, summed).
        global_seqs: responses with at least one masked token in the whole mini-batch.
        norm_length: "seq-mean-token-sum-norm"'s divisor, the same for every part (the
            configured max response length: a part's own width L would depend on the
            split, since micro-batches are trimmed to their longest response).

    Raises:
        ValueError: unknown mode, or "seq-mean-token-sum-norm" without `norm_length`.

    Returns:
        Scalar tensor; 0 for a part with no masked token.
    """
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / max(global_tokens, 1.0)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (loss_mask.sum(dim=-1) + 1e-8)  # verl's, as agg_loss's
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if norm_length is None:
            raise ValueError("seq-mean-token-sum-norm over a split batch needs norm_length")
        return seq_losses.sum() / norm_length
    return seq_losses.sum() / max(global_seqs, 1.0)


def loss_normalisers(loss_mask: torch.Tensor) -> torch.Tensor:
    """(2,) float64: masked tokens and responses with at least one, of a (B, L) mask; sum
    them over every part of a mini-batch for `agg_loss_share`'s `global_tokens`, `global_seqs`."""
    tokens = loss_mask.sum(dim=-1)
    return torch.stack([tokens.sum(), (tokens > 0).sum()]).double()


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    is_weights: torch.Tensor | None = None,
    normalisers: tuple[float, float] | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual-clip (verl's `compute_policy_loss_vanilla`).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)). Per token:
        A >= 0: max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        A < 0:  min(that, -A * clip_ratio_c)   (dual-clip, https://arxiv.org/abs/1912.09729)
    then, if given, times `is_weights`, then reduced with `agg_loss`.

    Args:
        log_prob: (B, L) log-probs of the sampled tokens under the policy being trained.
        old_log_prob: (B, L) log-probs under the policy before this update (no grad needed).
        advantages: (B, L).
        response_mask: (B, L).
        clip_ratio_low: ratio is clipped below at 1 - clip_ratio_low.
        clip_ratio_high: ratio is clipped above at 1 + clip_ratio_high.
        clip_ratio_c: dual-clip bound for negative advantages; must be > 1.
        loss_agg_mode: one of LOSS_AGG_MODES.
        is_weights: optional (B, L) truncated importance weights correcting for
            rollout/trainer mismatch (`rollout_importance_weights`); detached here.
        normalisers: (global tokens, global responses) when this batch is one part of
            a mini-batch: the loss is then this part's `agg_loss_share`, and each stat
            its share of the mini-batch's token mean.
        norm_length: "seq-mean-token-sum-norm"'s divisor (see `agg_loss_share`).

    Returns:
        loss: scalar, differentiable w.r.t. `log_prob`.
        stats: detached scalars "pg_clipfrac" (fraction of tokens where the
            clipped term was used), "pg_clipfrac_lower" (fraction where the
            dual-clip bound was used) and "ppo_kl" (mean old - new log-prob).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(ppo_losses, dual_bound), ppo_losses)
    if is_weights is not None:
        losses = losses * is_weights.detach()

    with torch.no_grad():
        stats = {
            "pg_clipfrac": _token_mean((clipped > unclipped).float(), response_mask, normalisers),
            "pg_clipfrac_lower": _token_mean(
                ((ppo_losses > dual_bound) & (advantages < 0)).float(), response_mask, normalisers
            ),
            "ppo_kl": _token_mean(-log_ratio, response_mask, normalisers),
        }
    return aggregate(losses, response_mask, loss_agg_mode, normalisers, norm_length), stats


def _token_mean(
    values: torch.Tensor, mask: torch.Tensor, normalisers: tuple[float, float] | None
) -> torch.Tensor:
    """Token mean of a whole batch, or this part's share of the mini-batch's."""
    if normalisers is None:
        return masked_mean(values, mask)
    return masked_sum(values, mask) / max(normalisers[0], 1.0)


def gspo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    is_weights: torch.Tensor | None = None,
    normalisers: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level clipped surrogate (https://arxiv.org/abs/2507.18071; verl's
    `compute_policy_loss_gspo`).

    Per response i the importance ratio is the geometric mean of its token ratios,
    s_i = exp(mean over its masked tokens of (log_prob - old_log_prob)). Each token
    carries s_i as its value and its own log-prob's gradient:
    log s_i,t = sg[log s_i] + log_prob_t - sg[log_prob_t], clamped above at 10. Per token:
    max(-A * s_i,t, -A * clip(s_i,t, 1 - low, 1 + high)) (no dual-clip), then, if given,
    times `is_weights`, then reduced with "seq-mean-token-mean" whatever
    `actor.loss_agg_mode` says, as in verl. GSPO's clip ranges are much narrower than
    PPO's (verl's recipe: low 3e-4, high 4e-4), since s_i is a per-token average.

    Args:
        log_prob: (B, L) log-probs of the sampled tokens under the policy being trained.
        old_log_prob: (B, L) log-probs under the policy before this update.
        advantages: (B, L), usually one value per response spread over its tokens.
        response_mask: (B, L).
        clip_ratio_low, clip_ratio_high: s is clipped to [1 - low, 1 + high].
        is_weights: optional (B, L) weights (`rollout_importance_weights`), detached here.
        normalisers: as in `policy_loss` (only the responses count is used).

    Returns:
        loss: scalar, differentiable w.r.t. `log_prob`.
        stats: detached "pg_clipfrac" (token fraction where the clipped term was used),
            "pg_clipfrac_lower" (always 0: no dual-clip) and "ppo_kl" (mean old - new
            log-prob), each this part's share when `normalisers` are given.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        losses = losses * is_weights.detach()
    with torch.no_grad():
        stats = {
            "pg_clipfrac": _token_mean((clipped > unclipped).float(), response_mask, normalisers),
            "pg_clipfrac_lower": torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
            "ppo_kl": _token_mean(-log_ratio, response_mask, normalisers),
        }
    return aggregate(losses, response_mask, "seq-mean-token-mean", normalisers), stats


def aggregate(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    normalisers: tuple[float, float] | None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """`agg_loss` of a whole batch (`normalisers` None), or `agg_loss_share` of a part."""
    if normalisers is None:
        return agg_loss(loss_mat, loss_mask, loss_agg_mode, norm_length)
    return agg_loss_share(loss_mat, loss_mask, loss_agg_mode, *normalisers, norm_length)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    Kinds (http://joschu.net/blog/kl-approx.html; verl's names, aliases after the slash):
        "k1" / "kl": logp - ref.
        "abs": |logp - ref|.
        "k2" / "mse": 0.5 * (logp - ref)^2.
        "k3" / "low_var_kl": exp(ref - logp) - (ref - logp) - 1, with ref - logp
            clamped to [-20, 20] and the result to [-10, 10] as in verl.
        any of them + "+" (e.g. "k3+"): the value of that estimator with the gradient of
            k2 (straight-through: k2 - sg[k2] + sg[value]). k1's and k3's expectations are
            the KL but their expected gradients are not its gradient; k2's is
            (https://arxiv.org/abs/2505.17508). "k2+" is k2. Differs from verl: verl's
            `kl_penalty` means the same (its docstring and `kl_penalty_forward`) but
            raises NotImplementedError for every "+" name (b178a3c and 0.7.1 pass the name
            with its "+" on to `kl_penalty_forward`, which does not know it).

    Args:
        log_prob: (B, L) policy log-probs.
        ref_log_prob: (B, L) reference-model log-probs.
        kind: one of KL_KINDS.

    Returns:
        (B, L) per-token penalty; masking is left to the caller.

    Raises:
        ValueError: unknown kind (the message lists the valid ones).
    """
    straight_through = kind.endswith("+")
    estimator = _KL_ESTIMATORS.get(kind[:-1] if straight_through else kind)
    if estimator is None:
        raise ValueError(f"unknown kl kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    diff = log_prob - ref_log_prob
    if estimator == "k1":
        value = diff
    elif estimator == "abs":
        value = diff.abs()
    elif estimator == "k2":
        value = 0.5 * diff.square()
    else:
        log_ratio = torch.clamp(-diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        value = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)
    if not straight_through or estimator == "k2":
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position.

    Args:
        logits: (B, L, V).

    Returns:
        (B, L): logsumexp(logits) - sum(softmax(logits) * logits), in nats.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def value_loss(
    vpreds: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    normalisers: tuple[float, float] | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss (verl's `compute_value_loss`).

    Per token: max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2); the loss is
    0.5 * agg_loss of that.

    Args:
        vpreds: (B, L) values from the critic being trained.
        values_old: (B, L) values from the critic that scored the rollout.
        returns: (B, L) targets (`gae_advantages`' returns).
        response_mask: (B, L).
        cliprange_value: c above.
        loss_agg_mode: one of LOSS_AGG_MODES.
        normalisers: as in `policy_loss`.
        norm_length: as in `policy_loss`.

    Returns:
        loss: scalar, differentiable w.r.t. `vpreds`.
        clipfrac: detached scalar, fraction of tokens where the clipped term was larger
            (this part's share of it when `normalisers` are given).
    """
    vpreds_clipped = torch.clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * aggregate(
        torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, normalisers, norm_length
    )
    frac = (clipped > unclipped).float()
    if normalisers is None:
        clipfrac = masked_mean(frac, response_mask)
    else:
        clipfrac = masked_sum(frac, response_mask) / max(normalisers[0], 1.0)
    return loss, clipfrac.detach()


@torch.no_grad()
def rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float,
    mode: str = "truncate",
    lower: float | None = None,
) -> torch.Tensor:
    """Importance weights pi_old / pi_rollout (rollout engine vs trainer mismatch, and the
    staleness of the policy that sampled): truncated (TIS, verl's ``rollout_is``) or masked.

    Levels (mode "truncate"):
        "token": w_t = min(exp(old_t - rollout_t), threshold).
        "sequence": w = min(exp(sum over the response's masked tokens of
            (old_t - rollout_t)), threshold), the same on every token of the response.
    Mode "mask" (token level only): w_t = exp(old_t - rollout_t) where
        lower <= w_t <= threshold, else 0. With ``lower`` unset it is AReaL's decoupled PPO
        with ``behav_imp_weight_cap`` = threshold (the proximal policy is the trainer's
        weights before the update, the behaviour policy the rollout's); with lower = 0.5,
        threshold = 5 it is IcePop (Ring-1T, arXiv 2510.18855; OpenRLHF's "icepop"). A
        token whose weight is outside the bounds trains nothing, and stays in the loss's
        normalisers (as in both).
    Log-ratios are clamped to [-20, 20] before exp so long responses cannot overflow.

    Args:
        old_log_prob: (B, L) log-probs recomputed by the trainer before the update.
        rollout_log_prob: (B, L) log-probs reported by the rollout engine when sampling.
        response_mask: (B, L).
        level: one of IS_LEVELS.
        threshold: truncation bound (TIS), e.g. 2.0; the mask's upper bound, e.g. 5.0.
        mode: one of IS_MODES.
        lower: the mask's lower bound (mode "mask"); None: none.

    Returns:
        (B, L) detached weights, 0 on masked-out positions.

    Raises:
        ValueError: unknown level or mode, or mode "mask" at the sequence level (the
        message lists the valid ones).
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-weight mode {mode!r}; valid modes: "
                         f"{', '.join(IS_MODES)}")  # fmt: skip
    if mode == "mask" and level != "token":
        raise ValueError(f"importance-weight mode 'mask' works per token, not at level {level!r}")
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        log_weight = log_ratio
    elif level == "sequence":
        log_weight = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(
            f"unknown importance-weight level {level!r}; valid levels: {', '.join(IS_LEVELS)}"
        )
    weights = torch.exp(torch.clamp(log_weight, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if mode == "mask":
        inside = (weights <= threshold) & (weights >= (0.0 if lower is None else lower))
        return torch.where((mask > 0) & inside, weights, 0.0)
    return torch.where(mask > 0, torch.clamp(weights, max=threshold), 0.0)


def m2po_cutoff(squared: torch.Tensor, threshold: float) -> float:
    """M2PO's selection (Second-Moment Trust Policy Optimization, arXiv 2510.01161, as AReaL
    implements it: ``get_m2po_loss_mask``): of the squared log-ratios ``squared`` (1-D, every
    response token of the trainer step's batch, all trainer ranks'; AReaL selects within each
    micro-batch, which a different split would change), the largest are masked out until
    the mean of those kept is below ``threshold`` (e.g. 0.04). Returns the bound: a token
    trains when its squared log-ratio is below it (inf: none masked).

    When no count of masked tokens brings the mean below the threshold, only the smallest
    values are kept (as AReaL). Differs from AReaL on ties: AReaL masks a count of tokens in
    its sort's order, which of equal values arbitrary; here every token equal to the
    smallest one masked is masked too (the mean of those kept stays below the threshold,
    and the selection is the same whatever the order or the split over ranks)."""
    if squared.numel() == 0:
        return float("inf")
    values = torch.sort(squared.double(), descending=True).values
    n = values.numel()
    # the mean of values[i:] for every i: what remains once the i largest are masked
    suffix = torch.flip(torch.cumsum(torch.flip(values, [0]), 0), [0])
    means = suffix / torch.arange(n, 0, -1, dtype=torch.float64)
    below = torch.nonzero(means < threshold)
    first = int(below[0]) if below.numel() else n - 1
    return float("inf") if first == 0 else float(values[first - 1])


def m2po_keep(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cutoff: float,
) -> torch.Tensor:
    """(B, L) float mask, 1 on the response tokens M2PO keeps (their squared log-ratio
    (rollout - old)^2 below ``m2po_cutoff``'s bound), 0 elsewhere. Masked tokens leave the
    loss and its normalisers, as rejection sampling's do."""
    squared = (rollout_log_prob - old_log_prob).double() ** 2
    return ((squared < cutoff) & (response_mask > 0)).to(old_log_prob.dtype)


@torch.no_grad()
def rollout_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None = None,
) -> torch.Tensor:
    """Which tokens to keep when rejecting off-policy ones (verl's `rollout_rs`): those whose
    importance ratio pi_old / pi_rollout lies in [lower, upper].

    Levels (the ratio compared with the thresholds):
        "token": each token's own exp(old_t - rollout_t); a token outside is masked out.
        "sequence": the response's product of token ratios, exp(sum of log-ratios).
        "geometric": the response's geometric mean, exp(mean of log-ratios) (thresholds
            close to 1, e.g. 1.001). At both sequence levels a response outside the
            bounds loses all its tokens.
    The statistic (a token's log-ratio, or the sum or mean) is clamped to [-20, 20] before
    exp, against overflow.

    Differences from verl b178a3c (its names are verl's older API: ``rollout_rs``,
    ``rollout_rs_threshold``, ``rollout_rs_threshold_lower``), kept on purpose:
    - verl bounds pi_rollout / pi_old; this bounds pi_old / pi_rollout, the importance
      weight's direction (as verl's own math document, and its code before 518bada21).
      The two agree only when lower = 1 / upper, the default here.
    - verl clamps each token's log-ratio to +-20 before the sequence sum; this clamps the
      sum (or mean) itself: a token past e^20 then still counts in full, so a response
      holding one is rejected, not let through by the clamp.
    - verl applies the rejection mask to the response mask before computing advantages
      (REINFORCE++ whitens over kept tokens, its return restarts at a rejected token);
      here advantages are those of the whole sampled response, and rejection only takes
      tokens out of the loss and its normalisers: the advantage belongs to the
      trajectory that was sampled, rejection decides which of its tokens train.

    Args:
        old_log_prob: (B, L) log-probs recomputed by the trainer before the update.
        rollout_log_prob: (B, L) log-probs reported by the rollout engine when sampling.
        response_mask: (B, L).
        level: one of RS_LEVELS.
        upper: upper bound on the ratio.
        lower: lower bound; None: 1 / upper, as in verl.

    Returns:
        (B, L) float mask, 1 on kept tokens, 0 on rejected ones and on padding; multiply
        the loss mask by it.

    Raises:
        ValueError: unknown level (the message lists the valid ones).
    """
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        statistic = log_ratio
    elif level == "sequence":
        statistic = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    elif level == "geometric":
        statistic = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(
            f"unknown rejection-sampling level {level!r}; valid levels: {', '.join(RS_LEVELS)}"
        )
    ratio = torch.exp(torch.clamp(statistic, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    low = 1.0 / upper if lower is None else lower
    keep = (ratio >= low) & (ratio <= upper) & (mask > 0)
    return keep.to(old_log_prob.dtype)


def rejection_counts(keep: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(4,) float64: tokens rejected, response tokens, responses with a rejected token and
    responses, of a `rollout_rejection_mask` over (B, L); sum them over every trainer rank
    for the fractions masked out of the whole batch."""
    mask = response_mask.double()
    rejected = mask * (1 - keep.double())
    responses = mask.sum(dim=-1) > 0
    return torch.stack(
        [
            rejected.sum(),
            mask.sum(),
            ((rejected.sum(dim=-1) > 0) & responses).sum().double(),
            responses.sum().double(),
        ]
    )


def has_reward_variance(metric: torch.Tensor) -> torch.Tensor:
    """Which groups dynamic sampling keeps (DAPO, https://arxiv.org/abs/2503.14476; verl's
    `filter_groups`): those whose responses do not all score the same.

    Args:
        metric: (G, n) the filtered metric of each response (its reward).

    Returns:
        (G,) bool: True where the group has two different values, or a single response.
        A group of equal values has GRPO advantage 0 everywhere: no learning signal.

    Differs from verl: verl keeps a group when np.std > 0, which a rounding residue of the
    mean can make true for equal values (std of [0.1, 0.1, 0.1] is 1.4e-17); here equal
    means equal.
    """
    if metric.shape[-1] == 1:
        return torch.ones(metric.shape[:-1], dtype=torch.bool, device=metric.device)
    return metric.amax(dim=-1) > metric.amin(dim=-1)


def overlong_penalty(
    lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`): 0 up to
    max_response_length - buffer_len tokens, then falling linearly to -penalty_factor at
    max_response_length. Added to the reward.

    penalty = min(0, -(length - (max_response_length - buffer_len)) / buffer_len * factor)

    Args:
        lengths: any shape, e.g. (G, n): response lengths in tokens.
        max_response_length: the longest a response can be (`rollout.response_length`).
        buffer_len: tokens before the limit where the penalty ramps in (>= 1).
        penalty_factor: the penalty at max_response_length, as a positive number.

    Returns:
        Same shape as `lengths`, float64, each <= 0.
    """
    expected = max_response_length - buffer_len
    exceed = lengths.double() - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
