"""Time to reward against TRL's GRPOTrainer: the same tiny model, prompts, reward, samples
per step, hyperparameters and cores, several seeds, runs alternated; ratios printed.

    python scripts/bench_vs_trl.py --seeds 1 2 3                                # next_digit
    python scripts/bench_vs_trl.py --seeds 1 2 3 --steps 800 --response-length 56 \\
        --mode "sync=async_training.mode=sync" -- data.task=long_tail           # a long tail
    python scripts/bench_vs_trl.py --seeds 1 2 3 --steps 400 --response-length 10 \\
        --tool-delay "[0, 2]" --trl-time-limit 1200 -- data.task=tool_lookup    # a slow tool

TRL is pinned (``TRL``) and installed by this script into its own environment,
``build/trl-reference`` (a venv over this interpreter's packages: the same torch and
transformers), never into this project's; each TRL run is a subprocess of that venv's
Python running this file with ``--trl-worker``.

Both sides start from the same weights: the tiny model our runs build for ``trainer.seed``
(``models/tiny.py``), written once per seed and given to both as ``model.path``. A step is
16 prompts x 8 responses (our ``actor.ppo_mini_batch_size`` x ``rollout.n``; TRL's
``per_device_train_batch_size`` 128, ``num_generations`` 8), one optimizer step on it:
AdamW at our ``actor.lr``, constant, gradients clipped at 1.0, clip 0.2 / 0.28 (TRL's
``epsilon`` / ``epsilon_high``), token-mean loss (TRL's ``dapo``), group-normalised
advantages, no KL, temperature 1, fp32. Ours runs 1 rollout + 1 trainer rank of one
thread each; TRL one process of 2 torch threads: both use the 2 cores.

Measured per run: the first step whose rolling mean reward (``--window`` steps) reaches
``--target``, and its time from the launch and from the first step (TRL: the start of
training; ours: the first weight sync). Our modes take config overrides, as in
``bench_time_to_reward.py``.

The tool task (``data.task=tool_lookup``, ``--tool-delay``: the lookup tool's seconds per
call, a number or ``[low, high]``): ours with ``rollout.multi_turn`` and the tool config
written with that delay; TRL with its own tool loop (``environment_factory``: one
``Lookup`` environment per sample, its ``lookup`` method the tool, sleeping the same
delay, its reward the tool's 0.1 for one call), the task's chat template on both sides
and a parsing template for the call's words (``TOOL_CALL_TEMPLATE``). Two differences that
are TRL's design: its turn ends at EOS (the model writes ``<eos>`` after its call, one
token more to learn; ours stops at the call's end), and it calls the tools of a batch one
sample at a time (``GRPOTrainer._tool_call_loop``); ours runs up to
``rollout.multi_turn.max_parallel_calls`` at once. ``--trl-time-limit`` stops a TRL run
that has not finished by then: a run that never reached the target counts as at least
that long, and its ratio is printed as a lower bound (``>``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRL = "1.16.0"
VENV = REPO / "build" / "trl-reference"
SAMPLES = {"prompts": 16, "n": 8}  # per step, both sides
# The tool call in the tiny vocabulary's words, for transformers' response parsing (a
# ``response_template``, which TRL's tool loop reads): the model's turn starts after the
# prompt's "=" or a tool's answer, holds calls and text, and ends at EOS
TOOL_CALL_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"(?:=|<tool_response>\s*\S+)\s*",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def trl_python() -> Path:
    """The venv's Python, with TRL installed on first use."""
    python = VENV / "bin" / "python"
    marker = VENV / f"trl-{TRL}"
    if not marker.exists():
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True
        )
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL}"], check=True)
        marker.touch()
    return python


def task_of(overrides: list[str]):
    from hpc_asyncppo.config import DataConfig
    from hpc_asyncppo.tasks import load_task

    task = [o.partition("=")[2] for o in overrides if o.startswith("data.task=")]
    return load_task(DataConfig(task=task[-1] if task else "next_digit"))


def build_model(out: Path, overrides: list[str], seed: int) -> Path:
    from hpc_asyncppo.config import TinyModelConfig
    from hpc_asyncppo.models.tiny import tiny_model

    task = task_of(overrides)
    template = getattr(task, "chat_template", None)  # the tool task's: both sides use it
    return tiny_model(out, task.vocabulary(), TinyModelConfig(), seed, chat_template=template)


def tool_delay(overrides: list[str]) -> tuple[float, float] | None:
    """The lookup tool's delay range (``LookupTool.delay``) from the tool config our runs
    are given, or None when they run without tools."""
    from hpc_asyncppo.config.files import tool_config_file
    from hpc_asyncppo.tools.base import load_tools

    if "rollout.multi_turn.enable=true" not in overrides:
        return None
    path = [
        o.partition("=")[2]
        for o in overrides
        if o.startswith("rollout.multi_turn.tool_config_path=")
    ]
    return load_tools(tool_config_file(path[-1]))["lookup"].delay


def run_ours(model: Path, overrides: list[str], steps: int, seed: int, run_dir: Path) -> dict:
    from hpc_asyncppo.runlog import split_metrics

    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local",
           "--run-dir", str(run_dir), f"model.path={model}", f"trainer.total_steps={steps}",
           f"trainer.seed={seed}", "checkpoint.save_every=0", *overrides]  # fmt: skip
    launched = time.time()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows, _ = split_metrics(
        [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    )
    start = rows[0]["time/unix"] - rows[0]["time/elapsed_s"]
    return {
        "launched": launched,
        "start": start,
        "steps": [(r["step"], r["reward/mean"], r["time/unix"]) for r in rows],
        "trainer_tokens_per_s": sum(r["tokens/trained"] for r in rows)
        / sum(r["time/train_s"] for r in rows),
    }


def run_trl(
    model: Path, overrides: list[str], steps: int, seed: int, out: Path, limit_s: float | None
) -> dict:
    """One TRL run in its venv; stopped after ``limit_s`` (its steps so far are kept, and
    ``cut_s`` says when it was stopped)."""
    launched = time.time()
    cmd = [str(trl_python()), str(Path(__file__).resolve()), "--trl-worker", str(out),
           "--model", str(model), "--steps", str(steps), "--seeds", str(seed), "--", *overrides]  # fmt: skip
    with (out / "trl.log").open("w") as log:  # TRL's and transformers' warnings
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
        try:
            code, cut = proc.wait(timeout=limit_s), None
        except subprocess.TimeoutExpired:
            proc.kill()
            code, cut = proc.wait(), time.time() - launched
    if code and cut is None:
        sys.exit(f"TRL run failed ({code}):\n{(out / 'trl.log').read_text()[-3000:]}")
    record = json.loads((out / "trl.json").read_text())
    return {"launched": launched, "cut_s": cut, **record}


def trl_worker(out: Path, model: Path, overrides: list[str], steps: int, seed: int) -> None:
    """One TRL run (inside the TRL venv): writes out/trl.json with each step's reward."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_asyncppo.config import Config
    from hpc_asyncppo.tasks import Prompt

    torch.set_num_threads(2)
    cfg = Config()
    length = next(
        (int(o.partition("=")[2]) for o in overrides if o.startswith("rollout.response_length=")),
        cfg.rollout.response_length,
    )
    task = task_of(overrides)
    prompts = list(task.prompts())
    truths = {p.text: p.ground_truth for p in prompts}
    tokenizer = AutoTokenizer.from_pretrained(model)
    delay = tool_delay(overrides)
    tools: dict = {}
    if delay is None:
        dataset = Dataset.from_dict({"prompt": [p.text for p in prompts]})

        def reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
            return [
                task.reward(Prompt(0, p, truths[p]), c)
                for p, c in zip(prompts, completions, strict=True)
            ]

    else:
        # conversations, so that TRL runs its tool loop; the answer goes to each sample's
        # environment (``reset``) and to the reward
        dataset = Dataset.from_dict(
            {
                "prompt": [[{"role": "user", "content": p.text}] for p in prompts],
                "answer": [p.ground_truth for p in prompts],
            }
        )
        tokenizer.response_template = TOOL_CALL_TEMPLATE
        # TRL asks the template to write an assistant message's tool calls (ours keeps the
        # model's tokens and never renders them): the task's template, writing them too
        tokenizer.chat_template = task.chat_template.replace(
            "{{ m['content'] }} <eos> ",
            "{{ m['content'] }}{% for c in m['tool_calls'] or [] %} <tool_call> "
            "{{ c['function'] | tojson }}</tool_call>{% endfor %} <eos> ",
        )
        assert tokenizer.chat_template != task.chat_template
        rng = random.Random(seed)

        class Lookup:
            """One sample's lookup tool: the answer, after the same delay as ours."""

            def reset(self, answer: str, **_: object) -> None:
                self.answer, self.calls = answer, 0

            def lookup(self) -> str:
                """Look up the answer to the question"""
                time.sleep(rng.uniform(*delay))
                self.calls += 1
                return self.answer

            def get_reward(self) -> float:  # the tool's reward: 0.1 for one call
                return 0.1 if self.calls == 1 else 0.0

        tools["environment_factory"] = Lookup

        def reward(completion_ids: list[list[int]], answer: list[str], **_: object) -> list[float]:
            # the whole trajectory's words (the tool's answers included), as ours are judged
            texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
            return [
                task.reward(Prompt(0, "", truth), text)
                for truth, text in zip(answer, texts, strict=True)
            ]

    record: dict = {"start": None, "steps": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["start"] = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                record["steps"].append((state.global_step, logs["reward"], time.time()))
                (out / "trl.json").write_text(json.dumps(record))  # kept if the run is cut

    args = GRPOConfig(
        output_dir=str(out / "trl"), seed=seed, max_steps=steps, use_cpu=True, bf16=False,
        learning_rate=cfg.actor.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.actor.weight_decay, max_grad_norm=cfg.actor.grad_clip,
        per_device_train_batch_size=SAMPLES["prompts"] * SAMPLES["n"],
        gradient_accumulation_steps=1, num_generations=SAMPLES["n"], steps_per_generation=1,
        num_iterations=1, max_completion_length=length, temperature=cfg.rollout.temperature,
        top_p=1.0, top_k=0, beta=0.0, epsilon=cfg.actor.clip_ratio_low,
        epsilon_high=cfg.actor.clip_ratio_high, loss_type="dapo", scale_rewards="group",
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        **tools,
    )
    trainer.train()
    (out / "trl.json").write_text(json.dumps(record))


def measure(result: dict, window: int, target: float) -> dict:
    steps = result["steps"]
    rewards = [r for _, r, _ in steps]
    reached = next(
        (
            steps[i]
            for i in range(window - 1, len(steps))
            if statistics.fmean(rewards[i - window + 1 : i + 1]) >= target
        ),
        None,
    )
    startup = result["start"] - result["launched"]
    cut = result.get("cut_s")  # TRL's, when stopped at --trl-time-limit
    if reached:
        times = (reached[2] - result["launched"], reached[2] - result["start"])
    elif cut:  # it would have taken longer than it ran: a lower bound
        times = (cut, cut - startup)
    else:
        times = (None, None)
    return {
        "cut_s": cut,
        "bound": cut is not None and not reached,
        "step": reached[0] if reached else None,
        "from_launch_s": times[0],
        "from_start_s": times[1],
        "startup_s": startup,
        "s_per_step": (steps[-1][2] - result["start"]) / steps[-1][0],
        "final_reward": statistics.fmean(rewards[-window:]),
        "trainer_tokens_per_s": result.get("trainer_tokens_per_s"),  # ours only
    }


def median(values: list) -> float | None:
    return statistics.median(values) if values and None not in values else None


def fmt(v: float | None, spec: str = "8.1f") -> str:
    return format(v, spec) if v is not None else "   never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--response-length", type=int, default=None)
    parser.add_argument("--mode", action="append", default=[],
                        help='another of ours: "NAME=key=value ..." (fully_async plus these)')  # fmt: skip
    parser.add_argument("--no-default", action="store_true",
                        help="leave out fully_async without --mode's")  # fmt: skip
    parser.add_argument("--tool-delay", default=None,
                        help='the lookup tool\'s seconds per call: "1" or "[0, 2]" (data.task=tool_lookup)')  # fmt: skip
    parser.add_argument("--trl-time-limit", type=float, default=None,
                        help="stop a TRL run after this many seconds from its launch")  # fmt: skip
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value for our runs (and the task)")
    args = parser.parse_args()
    overrides = list(args.overrides)
    if args.response_length:
        overrides.append(f"rollout.response_length={args.response_length}")
    if args.trl_worker:
        trl_worker(args.trl_worker, args.model, overrides, args.steps, args.seeds[0])
        return
    trl_python()  # installed before any timing
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        if args.tool_delay is not None:
            from hpc_asyncppo.tasks.tool_lookup import lookup_tool_config

            config = Path(tmp) / "tools.yaml"
            config.write_text(lookup_tool_config(args.tool_delay))
            overrides += ["rollout.multi_turn.enable=true",
                          f"rollout.multi_turn.tool_config_path={config}"]  # fmt: skip
        compare(args, overrides, Path(tmp))


def compare(args: argparse.Namespace, overrides: list[str], tmp: Path) -> None:
    """Each seed's model, TRL and each of our modes on it (alternated), then the table."""
    modes: dict[str, list[str] | None] = {"trl": None}
    if not args.no_default:
        modes = {"fully_async": [], **modes}
    for spec in args.mode:
        name, _, rest = spec.partition("=")
        modes[name] = rest.split()
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for i, seed in enumerate(args.seeds):
        model = build_model(tmp / f"model-{seed}", overrides, seed)
        for name in list(modes) if i % 2 == 0 else list(modes)[::-1]:
            where = tmp / f"{name}-{seed}"
            if modes[name] is None:
                where.mkdir()
                raw = run_trl(model, overrides, args.steps, seed, where, args.trl_time_limit)
            else:
                raw = run_ours(model, [*overrides, *modes[name]], args.steps, seed, where)
            out = measure(raw, args.window, args.target)
            results[name].append(out)
            print(
                f"{name:12s} seed {seed}: reward {args.target} (rolling {args.window}) at step "
                f"{out['step']}, {fmt(out['from_launch_s'], '.1f')} s from launch, "
                f"{fmt(out['from_start_s'], '.1f')} s from the first step (start-up "
                f"{out['startup_s']:.1f} s); {out['s_per_step']:.3f} s per step, final reward "
                f"{out['final_reward']:.3f}"
                + (
                    f", trainer {out['trainer_tokens_per_s']:.0f} tokens/s"
                    if out["trainer_tokens_per_s"]
                    else ""
                )
                + (
                    f"; stopped at {out['cut_s']:.0f} s, step {raw['steps'][-1][0]}"
                    if out["cut_s"]
                    else ""
                ),
                flush=True,
            )
    given = " ".join(overrides) or "no overrides"
    print(f"TRL {TRL}, {args.steps} steps, seeds {args.seeds}, {given}; medians")
    print("mode          launch s  first-step s  start-up s  s/step  steps to target  reached"
          "  final reward  TRL's time / mode's (launch, first step)")  # fmt: skip
    trl = {k: median([r[k] for r in results["trl"]]) for k in ("from_launch_s", "from_start_s")}
    # a TRL run stopped before the target counts as its time so far: the median and the
    # ratios are then lower bounds (">")
    bound = ">" if any(r["bound"] for r in results["trl"]) else ""
    for name, rs in results.items():
        m = {k: median([r[k] for r in rs]) for k in rs[0] if k not in ("cut_s", "bound")}
        ratios = [trl[k] / m[k] if trl[k] and m[k] else None for k in trl]
        reached = sum(r["step"] is not None for r in rs)
        finals = [r["final_reward"] for r in rs]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        times, ratio = ("", bound) if name != "trl" else (bound, "")
        launch, first = (
            times + fmt(m[k], ".1f").strip() for k in ("from_launch_s", "from_start_s")
        )
        print(
            f"{name:12s} {launch:>8s} {first:>13s} {m['startup_s']:11.1f} {m['s_per_step']:7.3f} "
            f"{fmt(m['step'], '.0f').strip():>16s} {reached:>5d}/{len(rs)}  "
            f"{statistics.fmean(finals):.3f} +- {spread:.3f}  "
            f"{ratio}{fmt(ratios[0], '.2f')}x {ratio}{fmt(ratios[1], '.2f')}x"
        )


if __name__ == "__main__":
    main()
