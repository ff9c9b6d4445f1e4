"""Signs that a run is going wrong, read from the metrics rows the trainer leader writes,
each named in one line with the knob most likely to help.

A sign is judged on the mean of the last ``trainer.collapse_window`` steps (one bad step is
noise), against the run's own history, and only once that many steps were trained:

- ``nonfinite``: the update's loss, gradient norm or entropy is NaN or infinite (at once,
  no window: the weights are already lost).
- ``reward_drop``: the reward fell from its own peak (the best window so far) by more than
  ``trainer.collapse_reward_drop``.
- ``entropy``: the policy's entropy is under ``trainer.collapse_entropy`` (nats per token)
  while its reward stays more than ``collapse_reward_drop`` below the best step's best
  group: it repeats answers that do not pay. A run that converged (near-zero entropy at
  its best reward) is not collapsing and is not named.
- ``off_policy``: the samples are too far from the policy that trains on them: the
  rollout-to-trainer KL (``rollout_corr/k3_kl``) over ``trainer.collapse_kl``, or more
  than ``trainer.collapse_masked_fraction`` of the tokens' importance weights masked or
  truncated by the run's correction.

Each sign is named once per attempt, the first step it shows: the line goes to the leader's
log, into that step's metrics row (``collapse/line``, which the progress display and the
report print; ``collapse/signs`` counts the signs named so far, a number the trackers
plot), and, with ``trainer.stop_on_collapse``, ends the attempt as a ``CollapseError``
that the launcher does not retry (a restart from the checkpoint before would train into
the same state). ``trainer.collapse_window=0`` turns the watch off.

Memory: the last ``collapse_window`` values of six metrics and four numbers of history.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from hpc_asyncppo.config.schema import TrainerConfig

# metrics a non-finite value of which means the update itself broke
UPDATE_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")
# the shares of tokens whose importance weights a correction masked or truncated
MASKED = ("rollout_corr/is_truncated_fraction", "rollout_corr/is_masked_fraction",
          "rollout_rs/masked_fraction", "m2po/masked_fraction")  # fmt: skip


class CollapseError(RuntimeError):
    """``trainer.stop_on_collapse``: the run showed a collapse sign (the message is its
    line). An input error to the launcher: not restarted."""


class CollapseWatch:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.window = cfg.collapse_window
        self.recent: dict[str, deque[float]] = {}
        self.peak = -math.inf  # the best windowed reward so far
        self.peak_steps = (0, 0)
        self.best_group = -math.inf  # the best mean reward of any step's best group
        self.named: set[str] = set()  # signs named in this attempt

    def history(self, rows: Iterable[dict]) -> None:
        """The run's rows before this attempt (a resume): the peak and the window go on
        from them; signs are named anew."""
        if self.window <= 0:
            return
        for row in rows:
            self._add(row)

    def observe(self, row: dict) -> str | None:
        """The step's metrics row: the line of the signs first shown at this step (several:
        joined by "; "), else None. Adds ``collapse/signs`` (and ``collapse/line``) to ``row``."""
        if self.window <= 0:
            return None
        self._add(row)
        new = []
        for sign, line in self._signs(row):
            if sign not in self.named:
                self.named.add(sign)
                new.append(line)
        row["collapse/signs"] = len(self.named)
        if new:
            row["collapse/line"] = "; ".join(new)
            return row["collapse/line"]
        return None

    # --- the signs ----------------------------------------------------------------------
    def _add(self, row: dict) -> None:
        for key in ("reward/mean", "actor/entropy", "rollout_corr/k3_kl", *MASKED):
            if key in row and _finite(row[key]):
                self.recent.setdefault(key, deque(maxlen=self.window)).append(row[key])
        if "reward/best_group" in row and _finite(row["reward/best_group"]):
            self.best_group = max(self.best_group, row["reward/best_group"])
        reward = self.recent.get("reward/mean")
        if reward is not None and len(reward) == self.window:
            now = sum(reward) / self.window
            if now > self.peak:
                self.peak, self.peak_steps = now, (row["step"] - self.window + 1, row["step"])

    def _mean(self, key: str) -> float | None:
        values = self.recent.get(key)
        if not values or len(values) < self.window:
            return None
        return sum(values) / len(values)

    def _signs(self, row: dict) -> list[tuple[str, str]]:
        cfg, step, signs = self.cfg, row["step"], []
        steps = f"steps {step - self.window + 1}-{step}"
        broken = [k for k in UPDATE_METRICS if k in row and not _finite(row[k])]
        if broken:
            signs.append(("nonfinite", (
                f"collapse at step {step}: {broken[0]} is {row[broken[0]]}: the update "
                f"diverged; lower actor.lr (now {_num(row.get('actor/lr'))}) or set "
                "actor.grad_clip")))  # fmt: skip
        reward = self._mean("reward/mean")
        if reward is None:
            return signs
        if self.peak - reward > cfg.collapse_reward_drop:
            first, last = self.peak_steps
            signs.append(("reward_drop", (
                f"collapse at step {step}: the reward fell from its peak {self.peak:.3f} "
                f"(mean of steps {first}-{last}) to {reward:.3f} ({steps}), more than "
                f"trainer.collapse_reward_drop={cfg.collapse_reward_drop}; lower "
                "async_training.staleness_threshold or actor.lr")))  # fmt: skip
        entropy = self._mean("actor/entropy")
        if (entropy is not None and entropy < cfg.collapse_entropy
                and self.best_group - reward > cfg.collapse_reward_drop):  # fmt: skip
            signs.append(("entropy", (
                f"collapse at step {step}: entropy {entropy:.4f} nats per token ({steps}), "
                f"under trainer.collapse_entropy={cfg.collapse_entropy}, at reward "
                f"{reward:.3f} where a group earned {self.best_group:.3f}: the policy "
                "repeats answers that do not pay; set actor.entropy_coeff > 0 or lower "
                "actor.lr")))  # fmt: skip
        kl = self._mean("rollout_corr/k3_kl")
        masked = [(k, m) for k in MASKED if (m := self._mean(k)) is not None]
        worst = max(masked, key=lambda km: km[1], default=None)
        if kl is not None and kl > cfg.collapse_kl:
            signs.append(("off_policy", (
                f"collapse at step {step}: the rollout-to-trainer KL is {kl:.3f} ({steps}), "
                f"over trainer.collapse_kl={cfg.collapse_kl}: the samples are too far off "
                "the policy; lower async_training.staleness_threshold or actor.lr")))  # fmt: skip
        elif worst is not None and worst[1] > cfg.collapse_masked_fraction:
            signs.append(("off_policy", (
                f"collapse at step {step}: {worst[1]:.0%} of the tokens' importance "
                f"weights masked or truncated ({worst[0]}, {steps}), over "
                f"trainer.collapse_masked_fraction={cfg.collapse_masked_fraction}: the "
                "samples are too far off the policy; lower "
                "async_training.staleness_threshold or actor.lr")))  # fmt: skip
        return signs


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _num(value: object) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else "?"
