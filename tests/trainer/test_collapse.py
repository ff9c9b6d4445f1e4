"""The collapse watch (``trainer/collapse.py``) on rows shaped as the trainer leader writes
them: each sign named once, at the step it first shows, with the knob to turn; a run that
converges (near-zero entropy at its best reward) never named. A real run driven into
collapse: tests/integration/test_local_runs.py."""

from __future__ import annotations

import math

from hpc_asyncppo.config.schema import TrainerConfig
from hpc_asyncppo.trainer.collapse import CollapseWatch

WINDOW = 5


def rows(rewards: list[float], entropy: list[float] | float = 1.0, **more: list[float]):
    """Metrics rows, steps 1.., with the step's reward, entropy and any other column
    (``more``: a metric's name, ``/`` written ``__``, and its values)."""
    n = len(rewards)
    entropy = entropy if isinstance(entropy, list) else [entropy] * n
    return [
        {"step": i + 1, "reward/mean": rewards[i], "reward/best_group": min(1.0, rewards[i] + 0.1),
         "actor/entropy": entropy[i], "actor/pg_loss": 0.1, "actor/grad_norm": 0.5,
         "actor/lr": 7e-4, "rollout_corr/k3_kl": 0.01,
         **{k.replace("__", "/"): v[i] for k, v in more.items()}}
        for i in range(n)
    ]  # fmt: skip


def watch_lines(watch: CollapseWatch, metrics) -> list[tuple[int, str]]:
    return [(row["step"], line) for row in metrics if (line := watch.observe(row))]


def watch() -> CollapseWatch:
    return CollapseWatch(TrainerConfig(collapse_window=WINDOW))


def test_a_run_that_learns_and_converges_is_never_named():
    rising = [min(1.0, 0.05 * i) for i in range(40)]
    entropy = [max(0.001, 2.5 - 0.1 * i) for i in range(40)]  # to near zero, at reward 1.0
    w = watch()
    assert watch_lines(w, rows(rising, entropy)) == []
    # the noise of a step or two below the peak is not a fall
    noisy = [*rising, 0.5, 0.6, 1.0, 1.0, 1.0, 1.0]
    assert watch_lines(watch(), rows(noisy, 0.01)) == []


def test_a_reward_that_falls_from_its_peak_is_named_once_with_the_peak_and_the_knobs():
    rewards = [0.1] * 5 + [0.8] * 10 + [0.2] * 15
    lines = watch_lines(watch(), rows(rewards))
    assert len(lines) == 1, lines
    step, line = lines[0]
    # the window's mean first falls more than 0.25 below the peak (0.8, steps 6-10) at step 18:
    # (2 * 0.8 + 3 * 0.2) / 5 = 0.44
    assert step == 18, lines
    assert "reward fell from its peak 0.800 (mean of steps 6-10) to 0.440 (steps 14-18)" in line
    assert "async_training.staleness_threshold" in line and "actor.lr" in line


def test_entropy_near_zero_while_the_reward_stays_low_is_named():
    rewards = [0.1] * 20
    entropy = [2.0] * 8 + [0.01] * 12
    metrics = rows(rewards, entropy)
    assert watch_lines(watch(), metrics) == []  # no group ever did better: nothing to lose
    metrics = rows(rewards, entropy)
    metrics[2]["reward/best_group"] = 1.0  # one group once got it right
    lines = watch_lines(watch(), metrics)
    assert [s for s, _ in lines] == [13], lines  # steps 9-13: the first window all under 0.05
    assert "entropy 0.0100 nats per token (steps 9-13)" in lines[0][1]
    assert "a group earned 1.000" in lines[0][1] and "actor.entropy_coeff" in lines[0][1]


def test_samples_far_off_the_policy_are_named_by_kl_or_by_the_masked_share():
    kl = [0.01] * 6 + [3.0] * 6  # windows: 0.608 at step 7, then 1.206, 1.804, 2.402
    lines = watch_lines(watch(), rows([0.3] * 12, rollout_corr__k3_kl=kl))
    assert [s for s, _ in lines] == [10], lines
    assert "rollout-to-trainer KL is 2.402 (steps 6-10)" in lines[0][1]
    masked = [0.0] * 6 + [0.9] * 6  # windows: 0.18, 0.36, 0.54 at step 9
    lines = watch_lines(watch(), rows([0.3] * 12, rollout_corr__is_masked_fraction=masked))
    assert [s for s, _ in lines] == [9], lines
    assert "54% of the tokens' importance weights masked or truncated " in lines[0][1]
    assert "(rollout_corr/is_masked_fraction, steps 5-9)" in lines[0][1]


def test_a_nan_update_is_named_at_once():
    metrics = rows([0.1] * 3)
    metrics[1]["actor/grad_norm"] = math.nan
    lines = watch_lines(watch(), metrics)
    assert lines == [(2, lines[0][1])] and "actor/grad_norm is nan" in lines[0][1], lines
    assert "lower actor.lr (now 0.0007)" in lines[0][1]


def test_a_resumed_watch_goes_on_from_the_runs_peak_and_the_window_off_watches_nothing():
    rewards = [0.1] * 5 + [0.8] * 10 + [0.2] * 15
    before, after = rows(rewards)[:15], rows(rewards)[15:]
    w = watch()
    w.history(before)  # the rows the resumed attempt finds in metrics.jsonl
    lines = watch_lines(w, after)
    assert [s for s, _ in lines] == [18] and "peak 0.800" in lines[0][1], lines
    off = CollapseWatch(TrainerConfig(collapse_window=0))
    assert watch_lines(off, rows(rewards, 0.0)) == []


def test_the_row_carries_the_count_of_signs_and_the_line_of_the_step():
    metrics = rows([0.1] * 5 + [0.8] * 10 + [0.2] * 15)
    w = watch()
    watch_lines(w, metrics)
    assert [r["collapse/signs"] for r in metrics][16:19] == [0, 1, 1]
    assert [r["step"] for r in metrics if "collapse/line" in r] == [18]
