"""A checkpoint's score on a data set, without a training job: ``python -m hpc_asyncppo.eval
TARGET [--step N] [--data FILE] [--n N] [--temperature T] [--config C] [--out DIR]
[key=value ...]``.

TARGET is a run directory (its newest valid checkpoint, or ``--step N``'s), one of its
checkpoint folders (``RUN_DIR/checkpoints/step_N``), or a Hugging Face model folder (an
export, the model a run started from, any model). The config is the run's ``config.yaml``
(for a model folder: ``--config``'s, e.g. ``qwen2.5-7b-gsm8k``, or the defaults) with the
``key=value`` overrides on top: ``data.task``, ``data.reward_fn``, ``rollout.engine=vllm``,
``rollout.response_length``, ...

It is the run's validation (``rollout/validation.py``) outside the job: the prompts of
``--data`` (read as ``data.train`` is: JSONL or verl parquet; default: the run's
``data.val``), tokenized the same way, those longer than ``data.max_prompt_length`` left
out as validation leaves them; ``--n`` responses to each (default ``rollout.val_n``) at
``--temperature`` (default ``rollout.val_temperature``; 0: greedy), from the engine the
run's rollout ranks use (``rollout.engine``, ``rollout.torch_threads``) holding the
checkpoint's weights in ``model.dtype``, as the rollout ranks hold them; scored with the
task's reward (or ``data.reward_fn``); summed up by validation's own ``validation_metrics``
(``val/reward/mean``, ``val/pass@k``, per data_source). The prompts go to the engine as
the run's R rollout ranks sent them (rank r's share r, r + R, ...,
``rollout.prompts_per_generate`` groups at a time), so a greedy eval of a checkpoint the
run validated scores what that validation logged (at a step that synced its weights).

``--processes P`` runs P engines at once, data-parallel: process p takes the shares p, p +
P, ... (each share's batches as above; with more processes than the run had rollout ranks,
one share each), on its own ``rollout.tensor_parallel_size`` GPUs of
those this node shows (``CUDA_VISIBLE_DEVICES``); its lines go to a part file, joined in
the end. A process that fails ends the others: one line naming it and its last line, exit
code 1, nothing written.

The weights: a checkpoint is first exported (``export.py``, a LoRA run's adapters merged)
into a temporary folder inside the output's, in ``model.dtype``, and removed at the end:
disk for one copy of the model in that dtype, memory as an export's (one tensor at a time)
and then each process's engine's. A model folder is loaded as it is.

Written: OUT (default ``RUN_DIR/eval/step_N-<data file's stem>``; needed for a model
folder) gets ``generations.jsonl`` (one line per response: the prompt's index,
data_source and text, the response's text and token ids, its reward) and
``summary.json`` (the metrics, what was evaluated and how). Everything is written in a
temporary folder beside OUT and renamed to OUT at the end: an eval that fails leaves
nothing. Bad input (a path that is not a run, checkpoint or model; a data file that is
missing or unreadable; a reward function that does not import) is one line on stderr and
exit code 2. A run with ``data.agent`` is evaluated through its agent: each prompt's n
responses are n sessions of it, on a gateway this process serves (the function run here,
or external agents claiming the sessions: the address is printed), scored with the
rewards the agents give. Multi-turn runs with the project's own tools are not evaluated
here (use the run's validation, ``trainer.test_freq``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_asyncppo.config import Config, ConfigError, load_config
from hpc_asyncppo.paths import CHECKPOINTS, CONFIG, GATEWAY, LAUNCH
from hpc_asyncppo.tasks import Task

GENERATIONS = "generations.jsonl"
SUMMARY = "summary.json"
EVAL = "eval"  # RUN_DIR/eval/: the default place of a run's evals


class EvalError(ValueError):
    """The eval cannot run on this input; the message is one line naming the fix."""


class EvalFailed(RuntimeError):
    """One of the eval's processes failed (its last line is in the message)."""


@dataclass
class Target:
    """What TARGET names: a run (``run_dir``, ``step`` None for its newest checkpoint) or a
    model folder (``model``)."""

    run_dir: Path | None = None
    step: int | None = None
    model: Path | None = None


def find_target(path: Path, step: int | None) -> Target:
    path = path.resolve()
    if not path.exists():
        raise EvalError(f"{path} does not exist; give a run directory, a checkpoint folder "
                        "(RUN_DIR/checkpoints/step_N) or a Hugging Face model folder")  # fmt: skip
    if (path / CONFIG).is_file():
        return Target(run_dir=path, step=step)
    if path.parent.name == CHECKPOINTS and path.name.startswith("step_"):
        if step is not None:
            raise EvalError(f"{path} is one checkpoint: drop --step, or give its RUN_DIR")
        try:
            return Target(run_dir=path.parent.parent, step=int(path.name[len("step_") :]))
        except ValueError:
            pass
    if (path / "config.json").is_file():
        if step is not None:
            raise EvalError(f"{path} is a model folder, it has no steps: drop --step")
        return Target(model=path)
    raise EvalError(f"{path} is neither a run directory (no {CONFIG}), a checkpoint folder "
                    "(RUN_DIR/checkpoints/step_N) nor a model folder (no config.json)")  # fmt: skip


def eval_config(
    target: Target, data: Path | None, overrides: list[str], config: str | None = None
) -> tuple[Config, int]:
    """The config the eval runs with (a model folder's: ``config``, a YAML path or a name in
    configs/, or the defaults), and the run's rollout rank count (1 for a model folder):
    the prompts go to the engine in that many shares, as the run's ranks took them."""
    extra = []
    if data is not None:
        if not data.is_file():
            raise EvalError(f"--data {data}: no such file; give a JSONL or verl parquet file")
        extra.append(f"data.val={data.resolve()}")
    if target.model is not None:
        cfg = load_config(config, [f"model.path={target.model}", *extra, *overrides])
        ranks = 1
    elif config is not None:
        raise EvalError(f"{target.run_dir} is a run: it has its own config.yaml; drop --config "
                        "(override its keys with key=value)")  # fmt: skip
    else:
        launch = target.run_dir / LAUNCH
        try:
            counts = json.loads(launch.read_text()) if launch.is_file() else {}
        except json.JSONDecodeError:
            counts = {}
        ranks = int(counts.get("rollout_ranks", 1))
        cfg = load_config(target.run_dir / CONFIG, [*extra, *overrides], ranks,
                          int(counts.get("train_ranks", 1)))  # fmt: skip
    if not cfg.data.val:
        raise EvalError("nothing to evaluate on: give --data FILE (JSONL or verl parquet), "
                        "or a run that has data.val")  # fmt: skip
    if cfg.rollout.multi_turn.enable:
        raise EvalError("multi-turn runs are evaluated by their own validation "
                        "(trainer.test_freq), not here")  # fmt: skip
    return cfg, ranks


def out_folder(target: Target, out: Path | None, step: int | None, data: str) -> Path:
    if out is not None:
        return out.resolve()
    if target.model is not None:
        raise EvalError(f"{target.model} is a model folder: give --out DIR for the results")
    return target.run_dir / EVAL / f"step_{step}-{Path(data).stem}"


def check_out(out: Path) -> None:
    if out.exists():
        raise EvalError(f"{out} already exists; give another --out (or remove that one)")


def generate(cfg: Config, task: Task, model: Path, shares: list[int], share_count: int, n: int,
             temperature: float, out: Path) -> int:  # fmt: skip
    """Generate and score the prompts of ``shares`` (share r: prompts r, r + share_count,
    ...), ``rollout.prompts_per_generate`` at a time, one engine on this process's first
    device; one line per response into ``out``. The number of prompts left out as too long."""
    import torch

    from hpc_asyncppo.rollout.engine_factory import make_engine
    from hpc_asyncppo.tasks import tokenize_prompt

    torch.set_num_threads(cfg.rollout.torch_threads)
    torch.manual_seed(cfg.trainer.seed * 1000 + shares[0])
    prompts = list(task.prompts())
    cfg.model.path = str(model)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    engine = make_engine(cfg, device)
    skipped = 0
    if cfg.data.agent:
        try:
            return generate_with_agents(cfg, engine, prompts, shares, share_count, n,
                                        temperature, out)  # fmt: skip
        finally:
            engine.close()
    try:
        with out.open("w") as f:
            for share_index in shares:
                share = []
                for prompt in prompts[share_index::share_count]:
                    ids = tokenize_prompt(engine.tokenizer, prompt)
                    if len(ids) > cfg.data.max_prompt_length:
                        skipped += 1
                    else:
                        share.append((prompt, ids))
                chunk = cfg.rollout.prompts_per_generate
                for start in range(0, len(share), chunk):
                    batch = share[start : start + chunk]
                    for i, (_, ids) in enumerate(batch):
                        engine.submit(("eval", i), ids, n, temperature)
                    done: dict = {}
                    while len(done) < len(batch):
                        done.update(engine.step())
                    for i, (prompt, _) in enumerate(batch):
                        gen = done[("eval", i)]
                        for j in range(n):
                            response = gen.response_ids[j, : gen.response_lengths[j]]
                            text = engine.decode(response)
                            line = {
                                "prompt_index": prompt.index,
                                "data_source": prompt.data_source,
                                "prompt": prompt.text,
                                "sample": j,
                                "response": text,
                                "response_ids": response.tolist(),
                                "reward": float(task.reward(prompt, text)),
                            }
                            f.write(json.dumps(line) + "\n")
    finally:
        engine.close()
    return skipped


def generate_with_agents(cfg: Config, engine, prompts: list, shares: list[int],
                         share_count: int, n: int, temperature: float, out: Path) -> int:  # fmt: skip
    """``data.agent``: each prompt's n responses are n sessions of the run's agent (its
    function, run here as the rollout ranks run it, or external agents claiming them from
    the gateway this process serves: its address is printed, and written with a token
    beside OUT's), scored with the rewards the agents give (a failed session: 0, as
    validation scores it). One line per session: its last sequence's text and tokens."""
    from hpc_asyncppo.rollout.gateway.addresses import make_token
    from hpc_asyncppo.rollout.gateway.agents import AgentRunner
    from hpc_asyncppo.rollout.gateway.requests import Fields
    from hpc_asyncppo.rollout.gateway.server import Gateway, make_app
    from hpc_asyncppo.rollout.gateway.sessions import Sessions
    from hpc_asyncppo.rollout.rollouter import GATHER_S
    from hpc_asyncppo.tasks import tokenize_prompt
    from hpc_asyncppo.tasks.registry import load_agent
    from hpc_asyncppo.tools.tool_parsers import tool_parser

    r, g = cfg.rollout, cfg.gateway
    where = out.parent
    token, agent = make_token(where), load_agent(cfg.data)
    gateway: Gateway | None = None
    threads = r.prompts_per_generate * n
    runner = AgentRunner(agent, lambda: gateway.port, token, threads) if agent else None
    sessions = Sessions(
        engine.tokenizer, engine.eos_id, r.response_length, cfg.data.max_prompt_length,
        g.agent_timeout_s, runner.start if runner else None,
        GATHER_S if r.engine == "hf" else 0.0, g.max_sequences,
        tool_parser(g.tool_parser, engine.tokenizer.chat_template), "score", 0.0,
    )  # fmt: skip
    if runner is not None:
        runner.sessions = sessions
    engine.turn_ends = sessions.turn_ends
    fields = Fields(
        {"temperature": temperature, "top_p": r.top_p, "top_k": r.top_k},
        g.sampling,
        g.parallel_tool_calls,
    )
    app = make_app(sessions, token, Path(cfg.model.path).name or "model", fields,
                   int(g.max_request_mb * 2**20), g.claim_wait_s)  # fmt: skip
    gateway = Gateway(app, "127.0.0.1" if agent else g.host, g.port)
    row = gateway.write_address(where, shares[0])
    if agent is None:
        print(f"eval: claim sessions at {row['url']}/sessions (token: {where}/gateway/token)",
              flush=True)  # fmt: skip
    skipped = 0
    try:
        with out.open("w") as f:
            for share_index in shares:
                share = [p for p in prompts[share_index::share_count]
                         if len(tokenize_prompt(engine.tokenizer, p)) <= cfg.data.max_prompt_length]  # fmt: skip
                skipped += len(prompts[share_index::share_count]) - len(share)
                chunk = r.prompts_per_generate
                for start in range(0, len(share), chunk):
                    batch = share[start : start + chunk]
                    for prompt in batch:
                        sessions.open_group(("eval", prompt.index), f"eval-p{prompt.index}",
                                            prompt, n, temperature=temperature)  # fmt: skip
                    done: dict = {}
                    while len(done) < len(batch):
                        done.update(sessions.step(engine, engine.step))
                    for prompt in batch:
                        gen = done[("eval", prompt.index)]
                        given, _, _, _ = sessions.finish(("eval", prompt.index))
                        rows = (list(range(n)) if gen.row_sessions is None
                                else [max(k for k, s in enumerate(gen.row_sessions) if s == j)
                                      for j in range(n)])  # fmt: skip
                        for j, k in enumerate(rows):
                            response = gen.response_ids[k, : gen.response_lengths[k]]
                            line = {"prompt_index": prompt.index, "data_source": prompt.data_source,
                                    "prompt": prompt.text, "sample": j,
                                    "response": engine.decode(response),
                                    "response_ids": response.tolist(),
                                    "reward": float(given[j])}  # fmt: skip
                            f.write(json.dumps(line) + "\n")
    finally:
        gateway.close()
    return skipped


def metrics_of(lines: list[dict], n: int) -> dict[str, float]:
    """Validation's metrics (``validation_metrics``) of the generations' lines."""
    import numpy as np

    from hpc_asyncppo.trainer.validation import validation_metrics

    rewards: dict[int, list[float]] = {}
    sources: dict[int, str] = {}
    for line in lines:
        rewards.setdefault(line["prompt_index"], []).append(line["reward"])
        sources[line["prompt_index"]] = line["data_source"]
    order = sorted(rewards)
    table = np.asarray([rewards[i] for i in order], dtype=np.float32).reshape(len(order), n)
    metrics = validation_metrics(table, [sources[i] for i in order], -1)
    del metrics["val/param_version"]
    return metrics


def process_devices(processes: int, per_process: int) -> list[str | None]:
    """Each process's CUDA_VISIBLE_DEVICES (``per_process`` GPUs each, from those this
    process sees), or None each without GPUs."""
    import torch

    if not torch.cuda.is_available():
        return [None] * processes
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if processes * per_process > len(gpus):
        raise EvalError(f"--processes {processes} x rollout.tensor_parallel_size {per_process} "
                        f"needs {processes * per_process} GPUs; this node has {len(gpus)}")  # fmt: skip
    return [",".join(gpus[p * per_process : (p + 1) * per_process]) for p in range(processes)]


def generate_in_processes(cfg: Config, task: Task, model: Path, share_count: int, processes: int,
                          n: int, temperature: float, tmp: Path) -> tuple[list[dict], int]:  # fmt: skip
    """The shares split among ``processes`` (process p: shares p, p + processes, ...), each
    its own engine (on its own GPUs), running at once; their lines and skipped prompts.
    More processes than shares: one share each (the run's batches are then not kept)."""
    share_count = max(share_count, processes)
    from hpc_asyncppo.config import to_yaml

    if processes == 1:
        skipped = generate(cfg, task, model, list(range(share_count)),
                           share_count, n, temperature, tmp / GENERATIONS)  # fmt: skip
        return read_lines(tmp / GENERATIONS), skipped
    (tmp / "config.yaml").write_text(to_yaml(cfg))
    devices = process_devices(processes, cfg.rollout.tensor_parallel_size)
    procs = []
    for p in range(processes):
        shares = list(range(p, share_count, processes))
        spec = {"config": str(tmp / "config.yaml"), "model": str(model), "shares": shares,
                "share_count": share_count, "n": n, "temperature": temperature,
                "out": str(tmp / f"part{p}.jsonl")}  # fmt: skip
        (tmp / f"part{p}.json").write_text(json.dumps(spec))
        env = dict(os.environ)
        if devices[p] is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices[p]
        cmd = [sys.executable, "-m", "hpc_asyncppo.eval", "--part", str(tmp / f"part{p}.json")]
        with (tmp / f"part{p}.log").open("w") as log_file:
            procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env))
    try:
        while any(proc.poll() is None for proc in procs):
            failed = [p for p, proc in enumerate(procs) if proc.poll() not in (None, 0)]
            if failed:
                break
            time.sleep(0.5)
        for p, proc in enumerate(procs):
            if proc.poll() not in (None, 0):
                tail = (tmp / f"part{p}.log").read_text().strip().splitlines()[-1:] or [""]
                raise EvalFailed(f"eval process {p} of {processes} failed (exit code "
                                 f"{proc.returncode}): {tail[0][:300]}")  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines, skipped = [], 0
    for p in range(processes):
        lines += read_lines(tmp / f"part{p}.jsonl")
        skipped += json.loads((tmp / f"part{p}.done").read_text())["skipped"]
    with (tmp / GENERATIONS).open("w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    for name in [
        f"part{p}{ext}" for p in range(processes) for ext in (".json", ".jsonl", ".log", ".done")
    ]:
        (tmp / name).unlink()
    (tmp / "config.yaml").unlink()
    return lines, skipped


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def part_main(spec_path: str) -> int:
    """One of ``--processes``' processes (``--part SPEC.json``, written by the first)."""
    from hpc_asyncppo.config import load_resolved
    from hpc_asyncppo.tasks import load_val_task

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_resolved(spec["config"])
    skipped = generate(cfg, load_val_task(cfg.data), Path(spec["model"]), spec["shares"],
                       spec["share_count"], spec["n"], spec["temperature"], Path(spec["out"]))  # fmt: skip
    Path(spec["out"]).with_suffix(".done").write_text(json.dumps({"skipped": skipped}))
    return 0


def run_eval(
    target_path: Path,
    step: int | None = None,
    data: Path | None = None,
    n: int | None = None,
    temperature: float | None = None,
    out: Path | None = None,
    overrides: list[str] | None = None,
    config: str | None = None,
    processes: int = 1,
) -> tuple[Path, dict]:
    """Evaluate; returns OUT and the summary written there. EvalError, ConfigError,
    DatasetError or ExportError (one line each) on bad input, with nothing written;
    EvalFailed when a process failed."""
    from hpc_asyncppo.export import candidate_checkpoints, export_checkpoint, write_atomically
    from hpc_asyncppo.tasks import load_val_task

    target = find_target(target_path, step)
    cfg, ranks = eval_config(target, data, list(overrides or []), config)
    task = load_val_task(cfg.data)  # the data and the reward, before any weights are read
    n = cfg.rollout.val_n if n is None else n
    temperature = cfg.rollout.val_temperature if temperature is None else temperature
    if n < 1 or temperature < 0 or processes < 1:
        raise EvalError(f"--n {n} --temperature {temperature} --processes {processes}: n and "
                        "processes must be >= 1, temperature >= 0")  # fmt: skip
    checkpoint = None
    if target.run_dir is not None:
        checkpoint = candidate_checkpoints(target.run_dir, target.step)[0]  # checks --step
        out = out_folder(target, out, int(checkpoint.name[len("step_") :]), cfg.data.val)
    else:
        out = out_folder(target, out, None, cfg.data.val)
    check_out(out)
    summary: dict = {}

    def write(tmp: Path) -> None:
        nonlocal checkpoint
        start = time.monotonic()
        model = target.model
        if target.run_dir is not None:
            model = tmp / "weights"
            checkpoint = export_checkpoint(target.run_dir, model, target.step, cfg.model.dtype)
        lines, skipped = generate_in_processes(
            cfg, task, model, ranks, processes, n, temperature, tmp
        )
        shutil.rmtree(tmp / GATEWAY, ignore_errors=True)  # agents' gateway: its token, address
        if not lines:
            raise EvalError(f"data.val={cfg.data.val}: no prompt fits data.max_prompt_length="
                            f"{cfg.data.max_prompt_length}; raise it")  # fmt: skip
        if target.run_dir is not None:
            shutil.rmtree(model)
        summary.update({
            **metrics_of(lines, n),
            "val/skipped_prompts": skipped,
            "target": str(target.run_dir or target.model),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "step": int(checkpoint.name[len("step_") :]) if checkpoint else None,
            "data": cfg.data.val,
            "task": cfg.data.task,
            "reward_fn": cfg.data.reward_fn or None,
            "n": n,
            "temperature": temperature,
            "engine": cfg.rollout.engine,
            "dtype": cfg.model.dtype,
            "processes": processes,
            "seconds": round(time.monotonic() - start, 1),
        })  # fmt: skip
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")

    write_atomically(out, write)  # export.py's: a temporary folder, fsynced, renamed
    return out, summary


def format_summary(summary: dict, out: Path) -> str:
    what = summary["checkpoint"] or summary["target"]
    how = "greedy" if summary["temperature"] == 0 else f"temperature {summary['temperature']}"
    k = summary["n"]
    lines = [
        f"{what} on {summary['data']} ({summary['val/prompts']} prompts, n={k}, {how}):",
        f"  reward/mean {summary['val/reward/mean']:.4f}   pass@{k} {summary[f'val/pass@{k}']:.4f}",
    ]
    for key, value in summary.items():
        if key.startswith("val/") and key.count("/") == 3:  # val/<source>/...
            lines.append(f"  {key[4:]} {value:.4f}")
    if summary["val/skipped_prompts"]:
        lines.append(f"  {summary['val/skipped_prompts']} prompts longer than "
                     "data.max_prompt_length were left out")  # fmt: skip
    lines.append(f"written: {out / GENERATIONS}, {out / SUMMARY}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m hpc_asyncppo.eval") -> int:
    from hpc_asyncppo.submit import OneLineParser  # a bad flag is one line

    parser = OneLineParser(
        prog=prog,
        description="Score a run's checkpoint (or a model folder) on a data set with the "
        "task's reward, as the run's validation does.",
    )
    parser.add_argument(
        "target", type=Path, help="RUN_DIR, RUN_DIR/checkpoints/step_N, or a HF model folder"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="JSONL or verl parquet (default: the run's data.val)",
    )
    parser.add_argument("--n", type=int, default=None, help="responses per prompt (rollout.val_n)")
    parser.add_argument(
        "--temperature", type=float, default=None, help="0: greedy (rollout.val_temperature)"
    )
    parser.add_argument(
        "--config", default=None, help="a model folder's config: YAML path or name in configs/"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="new folder (default RUN_DIR/eval/step_N-<data>)"
    )
    parser.add_argument(
        "--processes", type=int, default=1,
        help="engines at once, each on its own GPUs (rollout.tensor_parallel_size each)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--part"]:
        return part_main(argv[1])
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after flags
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from hpc_asyncppo.checkpoint.store import CheckpointError
    from hpc_asyncppo.export import ExportError
    from hpc_asyncppo.tasks.jsonl import DatasetError

    try:
        out, summary = run_eval(args.target, args.step, args.data, args.n, args.temperature,
                                args.out, args.overrides, args.config, args.processes)  # fmt: skip
    except (EvalError, ConfigError, DatasetError, ExportError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EvalFailed as exc:
        print(f"error: {exc}; nothing was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(format_summary(summary, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
