"""The CUDA paths in one short run: ``python -m hpc_asyncppo.gpu_check`` (``scripts/gpu_check.sh``).

Each check is a function of the device, so the suite runs the same functions on the CPU
(``tests/test_gpu_check.py``); on a GPU machine they run on ``cuda:0``:

  gpu_binding          every rank's GPU set under a fake 8-GPU node (the 7B config's layout)
  fsdp2_step           FSDP2 PPO update, bf16 compute over fp32 master weights
  checkpoint           a checkpoint of that policy written from the device, restored onto it,
                       and the next update identical
  default_job_learns   the README's first command (both roles on one GPU), and it learns
  weight_sync_via_host in that job: rollout and trainer share the GPU, so the weights went
                       through host memory (gloo, the weight group's fallback), and the
                       rollout rank held exactly the trainer's weights after every sync
  recipe_budget        one PPO update of a Qwen2.5-7B-architecture model with random weights
                       (Qwen2.5-3B's where memory.py says 7B cannot fit one device) at the 7B
                       recipe's token budget, whole on one rank: peak memory against the
                       config's own arithmetic (memory.py), and tokens/s (on the CPU: a
                       Qwen2-architecture model of the tiny size)
  memory_check         the memory check (memory.py) of the 7B recipe against this device's
                       real size: what it says for rollout and trainer GPUs of this size
  weight_group_peer_missing
                       a weight group whose peer never arrives fails at the join within its
                       timeout (NCCL: the eager connect), instead of hanging
  weight_sync_peer_dies
                       a member killed mid-sync: the sender raises a RuntimeError, the
                       error the sync's recovery catches, and lives (NCCL: needs two GPUs)
  side_stream_sync     the in-flight sync's side thread completes while training kernels
                       queued before it still run (its own CUDA stream); both timed

One line per check and a summary line; exit 0 only if every check passed. Without CUDA:
one line, exit 2 (``--device cpu`` runs them on the CPU anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpc_asyncppo.paths import LOGS, METRICS, RANKS, WEIGHTS
from hpc_asyncppo.tasks.next_digit import LEARNED_REWARD, UNTRAINED_REWARD_MAX

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(device: torch.device) -> None:
    """A one-rank world: the sharded Policy (FSDP2) needs a process group even alone."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        init = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=init, rank=0, world_size=1)


def tiny_model(work: Path) -> Path:
    from hpc_asyncppo.config import DataConfig, TinyModelConfig
    from hpc_asyncppo.models.tiny import build_tiny_model
    from hpc_asyncppo.tasks import load_task

    out = work / "model"
    if (out / "config.json").exists():
        return out
    return build_tiny_model(out, load_task(DataConfig()).vocabulary(), TinyModelConfig(), seed=3)


def random_batch(rows: int, seed: int, prompt: int = 4, length: int = 6) -> dict[str, np.ndarray]:
    """A training batch of ``rows`` rows: left-padded prompts, right-padded responses."""
    rng = np.random.default_rng(seed)
    lengths, prompt_lengths = rng.integers(1, length + 1, rows), rng.integers(1, prompt + 1, rows)
    return {
        "prompt_ids": rng.integers(4, 15, (rows, prompt)).astype(np.int32),
        "prompt_mask": (np.arange(prompt)[None] >= prompt - prompt_lengths[:, None]).astype(
            np.int8
        ),
        "response_ids": rng.integers(4, 15, (rows, length)).astype(np.int32),
        "response_mask": (np.arange(length)[None] < lengths[:, None]).astype(np.int8),
        "rollout_log_probs": -rng.random((rows, length)).astype(np.float32),
        "rewards": rng.random(rows).astype(np.float32),
        "advantages": rng.normal(size=rows).astype(np.float32),
    }


def _policy(work: Path, device: torch.device):
    from hpc_asyncppo.config import Config
    from hpc_asyncppo.trainer.policy import Policy

    ensure_process_group(device)
    cfg = Config()
    model = dataclasses.replace(cfg.model, path=str(tiny_model(work)), dtype="bfloat16")
    cfg = dataclasses.replace(cfg, model=model, actor=dataclasses.replace(cfg.actor, lr=1e-4))
    torch.manual_seed(0)
    return Policy(cfg, device, dist.group.WORLD)


def check_gpu_binding(device: torch.device, work: Path) -> str:
    """Every rank of the 7B config on a fake 8-GPU node gets its own GPUs (no CUDA used)."""
    from hpc_asyncppo.config import load_config
    from hpc_asyncppo.launch.gpus import bind_gpus

    cfg = load_config("qwen2.5-7b-gsm8k")
    rollout, train = cfg.slurm.rollout, cfg.slurm.train
    r, t = rollout.ranks, train.ranks
    tp = cfg.rollout.tensor_parallel_size
    eight = ",".join(map(str, range(8)))
    sets: dict[str, list[list[int | str]]] = {"rollout": [], "trainer": []}
    for world_rank in range(r + t):
        role, c = ("rollout", rollout) if world_rank < r else ("trainer", train)
        local = (world_rank if world_rank < r else world_rank - r) % c.tasks_per_node
        env = {"SLURM_LOCALID": str(local), "CUDA_VISIBLE_DEVICES": eight}
        sets[role].append(bind_gpus(cfg.slurm, tp, world_rank, r + t, r, env))
    per_node = {role: s[: (rollout if role == "rollout" else train).tasks_per_node]
                for role, s in sets.items()}  # fmt: skip
    for role, node in per_node.items():
        flat = sorted(g for s in node for g in s)
        assert flat == list(range(8)), f"{role} ranks of one node got {node}, not GPUs 0-7 once"
    assert all(len(s) == cfg.rollout.tensor_parallel_size for s in sets["rollout"])
    return f"rollout {per_node['rollout']}, trainer {per_node['trainer']} per node"


def check_fsdp2_step(device: torch.device, work: Path) -> str:
    """One PPO update of the FSDP2 policy: bf16 compute, fp32 master weights that move."""
    from hpc_asyncppo.trainer.batch import to_tensors
    from hpc_asyncppo.trainer.model import gather_full
    from hpc_asyncppo.trainer.policy import peak_memory_mb, ppo_update

    policy = _policy(work, device)
    before = {n: gather_full(p).clone() for n, p in policy.model.named_parameters()}
    assert all(t.dtype == torch.float32 for t in before.values()), "master weights not fp32"
    assert all(p.device.type == device.type for p in policy.model.parameters())
    stats = ppo_update(policy, to_tensors(random_batch(16, seed=1), device))
    assert all(np.isfinite(v) for v in stats.values()), stats
    moved = [bool((gather_full(p) != before[n]).any()) for n, p in policy.model.named_parameters()]
    assert np.mean(moved) > 0.5, f"only {sum(moved)} of {len(moved)} weights changed"
    sent = dict(policy.named_weights())
    assert all(t.dtype == torch.bfloat16 for t in sent.values()), "rollout weights not bf16"
    loss = stats.get("actor/pg_loss", next(iter(stats.values())))
    return f"loss {loss:.4f}, {sum(moved)}/{len(moved)} weights moved, peak {peak_memory_mb(device):.0f} MB"


def check_checkpoint(device: torch.device, work: Path) -> str:
    """A checkpoint part written from the device and restored onto it through the run's own
    protocol (write, commit, verify, read the rows back): same weights, same next step."""
    from hpc_asyncppo.checkpoint import protocol
    from hpc_asyncppo.checkpoint.protocol import restore_trainer_part, write_trainer_part
    from hpc_asyncppo.trainer.batch import to_tensors
    from hpc_asyncppo.trainer.model import gather_full
    from hpc_asyncppo.trainer.policy import ppo_update, trainer_states

    a = _policy(work, device)
    ppo_update(a, to_tensors(random_batch(16, seed=2), device))
    folder = protocol.step_dir(work / "checkpoint_run", 1)
    start = time.monotonic()
    part = write_trainer_part(folder, trainer_states(a), 0)
    protocol.commit(folder, [part], {"step": 1, "train_ranks": 1, "rollout_ranks": 0})
    protocol.verify_all(folder)
    b = _policy(work, device)
    restore_trainer_part(folder, trainer_states(b), 0, 1)
    seconds = time.monotonic() - start
    for (name, x), (_, y) in zip(
        a.module.named_parameters(), b.module.named_parameters(), strict=True
    ):
        assert y.device.type == device.type and torch.equal(gather_full(x), gather_full(y)), name
    batch = to_tensors(random_batch(16, seed=3), device)
    assert ppo_update(a, batch) == ppo_update(b, batch), "the step after the restore differs"
    return f"{part.bytes / 2**20:.1f} MB written and restored in {seconds:.2f} s"


def run_default_job(device: torch.device, work: Path, steps: int = 300) -> Path:
    """``submit --cluster local`` with the default config; on CUDA, both roles on one GPU."""
    run_dir = work / "default_job"
    if (run_dir / METRICS).exists():
        return run_dir
    env = dict(os.environ)
    if device.type == "cuda":  # roles share the GPU: the case the host-memory sync exists for
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local",
           "--run-dir", str(run_dir), "trainer.record_weight_digests=true",
           f"trainer.total_steps={steps}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=420)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise AssertionError(f"the default job failed (exit {proc.returncode}): {tail}")
    return run_dir


def check_default_job_learns(
    device: torch.device, work: Path, steps: int = 300, min_reward: float | None = LEARNED_REWARD
) -> str:
    """The default job ends, on the device, and (over its full length) learns."""
    from hpc_asyncppo.runlog import read_jsonl

    run_dir = run_default_job(device, work, steps)
    rewards = [m["reward/mean"] for m in read_jsonl(run_dir / METRICS)]
    first, last = float(np.mean(rewards[:10])), float(np.mean(rewards[-20:]))
    if min_reward is not None:
        assert first < UNTRAINED_REWARD_MAX and last >= min_reward, (
            f"reward {first:.2f} -> {last:.2f}"
        )
    logs = (run_dir / LOGS / "rank1.log").read_text()
    on = "cuda:0" if device.type == "cuda" else "cpu"
    assert f"trainer rank on {on}" in logs, f"trainer rank not on {on}"
    return f"reward {first:.2f} -> {last:.2f} over {len(rewards)} logged steps, trainer on {on}"


def check_weight_sync_via_host(device: torch.device, work: Path, steps: int = 300) -> str:
    """In the default job both roles share the device: the weights travel through host
    memory, and after every sync the rollout rank holds exactly the trainer's weights."""
    from hpc_asyncppo.runlog import read_jsonl

    run_dir = run_default_job(device, work, steps)
    log = (run_dir / LOGS / "rank0.log").read_text()
    on = "cuda:0" if device.type == "cuda" else "cpu"
    assert f"rollout rank on {on}; weights travel over gloo" in log, "sync did not go via the host"
    ranks = [json.loads((run_dir / RANKS / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["gpus"] == ranks[1]["gpus"], f"roles on different GPUs: {ranks}"
    leader = {r["version"]: r["digest"] for r in read_jsonl(run_dir / WEIGHTS / "rank1.jsonl")}
    mine = {r["version"]: r["digest"] for r in read_jsonl(run_dir / WEIGHTS / "rank0.jsonl")}
    assert mine == leader and leader, f"rollout digests differ from the trainer's ({len(leader)})"
    where = f"GPUs {ranks[0]['gpus']}" if ranks[0]["gpus"] else "the CPU"
    return f"{len(leader)} syncs bit-exact through host memory, both roles on {where}"


QWEN2_5 = {  # the sizes of Qwen2.5's config.json files (random weights are made here)
    "7B": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
               intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               tie_word_embeddings=False),
    "3B": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36,
               intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
               tie_word_embeddings=True),
    # the CPU stand-in: the same architecture at the tiny model's size
    "tiny": dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2,
                 intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=False),
}  # fmt: skip


def random_qwen(work: Path, size: str) -> Path:
    """A Qwen2 model folder with random bf16 weights (config.json + safetensors)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    out = work / f"qwen2.5-{size.lower()}-random"
    if (out / "config.json").exists():
        return out
    config = Qwen2Config(**QWEN2_5[size], max_position_embeddings=32768, rope_theta=1e6)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    return out


def check_recipe_budget(device: torch.device, work: Path) -> str:
    """One PPO update, on this device alone, of a Qwen2.5 architecture at the 7B recipe's
    token budget (actor.ppo_max_token_len_per_gpu tokens per micro-batch, gradient
    checkpointing, bf16 compute over fp32 masters): peak memory against memory.py's
    arithmetic for one trainer rank, and tokens/s."""
    from hpc_asyncppo.config import load_config
    from hpc_asyncppo.memory import GB, ModelShape, trainer_terms
    from hpc_asyncppo.trainer.batch import to_tensors
    from hpc_asyncppo.trainer.policy import Policy, peak_memory_mb, ppo_update

    ensure_process_group(device)
    recipe = load_config("qwen2.5-7b-gsm8k")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        size = "7B"
        shape = ModelShape.from_config(QWEN2_5["7B"])
        # a rank that does not sync (the update alone), AdamW's foreach step counted: the
        # 7B architecture's 164 GB do not fit an H200 (150.8 GB), whose foreach step peaked
        # near 152 GB when the estimate left it out
        if sum(trainer_terms(recipe, shape, 1, leader=False).values()) > 0.9 * total:
            size = "3B"
        tokens = recipe.actor.ppo_max_token_len_per_gpu
    else:
        size, tokens = "tiny", 512
    folder = random_qwen(work, size)
    overrides = [f"model.path={folder}", "model.attn_implementation=sdpa",
                 f"actor.ppo_max_token_len_per_gpu={tokens}", "trainer.total_steps=1",
                 f"data.max_prompt_length={tokens // 32}",
                 f"rollout.response_length={tokens // 32}"]  # fmt: skip
    cfg = load_config("qwen2.5-7b-gsm8k", overrides)
    policy = Policy(cfg, device, dist.group.WORLD)
    expected = sum(trainer_terms(cfg, ModelShape.of(str(folder)), 1, leader=False).values())
    # 32 rows of up to tokens/16 each, about half of that on average: micro-batches of about
    # the budget (token-budget micro-batches, as the recipe runs)
    rows, half = 32, tokens // 32
    batch = random_batch(rows, seed=2, prompt=half, length=half)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    start = time.monotonic()
    stats = ppo_update(policy, to_tensors(batch, device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.monotonic() - start
    assert all(np.isfinite(v) for v in stats.values()), stats
    used = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    peak = peak_memory_mb(device) * 2**20
    return (
        f"Qwen2.5-{size} architecture, {tokens}-token budget: peak {peak / GB:.1f} GB against "
        f"{expected / GB:.1f} GB by memory.py ({peak / expected:.2f}x), {used / seconds:,.0f} "
        f"tokens/s over one update of {used} tokens"
    )


def check_memory_check(device: torch.device, work: Path) -> str:
    """The 7B recipe against GPUs of this device's size, through the memory check the
    submit command runs (memory.py): what it accepts and refuses, in its own words."""
    import json as _json

    from hpc_asyncppo.config import ConfigError, load_config
    from hpc_asyncppo.memory import check_memory

    if device.type == "cuda":
        gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    else:
        gb = 16.0  # a stand-in size: the check's arithmetic runs all the same
    folder = work / "qwen2.5-7b-config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(_json.dumps(QWEN2_5["7B"]))
    said = []
    for side in ("rollout", "train"):
        cfg = load_config(
            "qwen2.5-7b-gsm8k", [f"model.path={folder}", f"slurm.{side}.gpu_memory_gb={gb:.1f}"]
        )
        ranks = cfg.slurm.train.ranks
        try:
            check_memory(cfg, ranks)
            said.append(f"{side} fits")
        except ConfigError as exc:
            said.append(f"{side} refused: {exc}")
    return f"7B recipe on {gb:.0f} GB GPUs: " + "; ".join(said)


# --- vLLM after a weight sync (scripts/gpu_check.py on a GPU; the vLLM engine's tests) -----
def check_vllm_update(
    engine, update, weights: dict[str, torch.Tensor], hf, prompts: list[list[int]],
    tolerance: float, sent_digest: str | None = None,
) -> str:  # fmt: skip
    """What a sync into vLLM must leave, checked after ``update`` (the engine's
    ``WeightUpdate`` of ``weights``, asked with ``digest=True``): every worker digested
    exactly what the sender sent (``sent_digest``, or the digest of ``weights``), and
    greedy responses to ``prompts`` are ``hf``'s (a transformers model that is given the
    same weights here) greedy continuation (each token its best, or within ``tolerance``
    of it: a near tie may go either way in bf16), with log-probs equal to its log_softmax
    within ``tolerance``. A load that did nothing passes neither. One line."""
    from hpc_asyncppo.runlog import weights_digest

    sent = sent_digest or weights_digest(list(weights.items()))
    assert update.digests and all(d == sent for d in update.digests), (
        f"v{update.version}: worker digests {[d[:12] for d in update.digests]} differ from "
        f"the sender's {sent[:12]}"
    )
    loaded = hf.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= tied, loaded
    for i, prompt in enumerate(prompts):
        engine.submit(("greedy", update.version, i), prompt, 1, temperature=0.0)
    done: dict = {}
    while engine.in_flight:
        done.update(engine.step())
    worst, tokens = 0.0, 0
    for i, prompt in enumerate(prompts):
        greedy = done[("greedy", update.version, i)]
        length = int(greedy.response_lengths[0])
        ids = torch.as_tensor(greedy.response_ids[0, :length], dtype=torch.long)
        device = next(hf.parameters()).device
        with torch.no_grad():
            logits = hf(torch.as_tensor([prompt + ids.tolist()], device=device)).logits[0]
        logits = logits[len(prompt) - 1 : len(prompt) - 1 + length].float().cpu()
        every = torch.log_softmax(logits, -1)
        hf_lp = every.gather(1, ids[:, None]).squeeze(1)
        behind = (every.max(-1).values - hf_lp).max().item() if length else 0.0
        assert behind <= tolerance, (
            f"v{update.version} prompt {i}: a greedy token of vLLM's is {behind:.3g} below "
            "transformers' best"
        )
        diff = (hf_lp - torch.as_tensor(greedy.log_probs[0, :length])).abs().max().item()
        assert diff < tolerance, f"v{update.version} prompt {i}: log-probs differ by {diff:.3g}"
        worst, tokens = max(worst, diff), tokens + length
    return (
        f"v{update.version}: {len(update.digests)} workers' digests equal the sender's; "
        f"{tokens} greedy tokens are transformers', log-probs within {worst:.2g}"
    )


# --- the weight group under NCCL's failures (gloo on the CPU) ------------------------------
GROUP_TIMEOUT_S = 30.0  # the weight group's own timeout in these checks
ALONE_TIMEOUT_S = 5.0  # ... and the lone rank's, which waits it out
HANG_S = 120.0  # a side that has not ended by then hangs: the check fails, naming it


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _run_side(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """One side of a weight group as its own process (``weight_group_side``): a side that
    NCCL tears down, or that hangs, takes only itself."""
    code = f"from hpc_asyncppo.gpu_check import weight_group_side; weight_group_side({args!r})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})  # fmt: skip


def _ended(proc: subprocess.Popen, who: str) -> tuple[int, str, float]:
    """(exit code, last output line, seconds) of a side, killed past ``HANG_S``."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(
            f"{who} hung: killed after {HANG_S:g} s; it said {out[-300:]!r}"
        ) from None
    lines = [line for line in out.splitlines() if line.startswith("side:")]
    return proc.returncode, lines[-1] if lines else out[-300:], time.monotonic() - start


def weight_group_side(args: list[str]) -> None:
    """A side of the weight group checks: ``alone PORT BACKEND TIMEOUT`` (rank 0 of a
    group of two whose peer never comes), ``leader ...`` (sends 8 buckets) or ``member
    ...`` (receives them; a fault set in its environment kills it mid-sync). Prints one
    ``side:`` line: what happened, and how long it took."""
    from hpc_asyncppo.transport.weight_group import WeightGroupSpec, open_weight_group
    from hpc_asyncppo.transport.weights import WeightBroadcaster, WeightReceiver

    role, port, backend, timeout_s = args[0], int(args[1]), args[2], float(args[3])
    device = torch.device("cuda", 1 if role == "member" else 0) if backend == "nccl" else CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = WeightGroupSpec("127.0.0.1", port, 2, backend, timeout_s)
    start = time.monotonic()
    try:
        group = open_weight_group(spec, 1 if role == "member" else 0)
        if role == "member":
            WeightReceiver(group, 0, device).receive_all()
        else:
            named = [(f"w{i}", torch.ones(2**18, device=device)) for i in range(8)]
            WeightBroadcaster(group, 0, 1, device).broadcast(0, named)
        print(f"side: {role} completed in {time.monotonic() - start:.1f} s", flush=True)
    except RuntimeError as exc:  # what the sync's recovery catches, on both backends
        said = " ".join(str(exc).split())[:160]
        print(f"side: {role} raised {type(exc).__name__} after {time.monotonic() - start:.1f} s: "
              f"{said}", flush=True)  # fmt: skip
        os._exit(3)
    os._exit(0)


def check_weight_group_peer_missing(device: torch.device, work: Path) -> str:
    """A weight group whose peer never arrives fails within its timeout, at the join (the
    group meets eagerly), instead of hanging there or at the first broadcast."""
    code, said, seconds = _ended(
        _run_side(["alone", str(_free_port()), _backend(device), str(ALONE_TIMEOUT_S)]),
        "the lone rank",
    )
    assert code == 3 and "raised" in said, f"exit {code}: {said}"
    assert seconds < ALONE_TIMEOUT_S + 60, f"failed only after {seconds:.0f} s: {said}"
    return f"{_backend(device)}: {said.removeprefix('side: ')}"


def check_weight_sync_peer_dies(device: torch.device, work: Path) -> str:
    """A member killed as the 3rd bucket of a sync arrives: the sender raises the error the
    sync's recovery catches (a RuntimeError, as gloo's), instead of the process being torn
    down or hanging."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return "not run: NCCL needs a GPU per member, and this machine has one"
    from hpc_asyncppo.runtime.faults import FAULTS_ENV, RUN_DIR_ENV

    port, backend, timeout_s = str(_free_port()), _backend(device), str(GROUP_TIMEOUT_S)
    (work / "peer_dies").mkdir(parents=True, exist_ok=True)
    fault = {FAULTS_ENV: "kill_rank@bucket=3:sync=1", RUN_DIR_ENV: str(work / "peer_dies")}
    member = _run_side(["member", port, backend, timeout_s], fault)
    leader = _run_side(["leader", port, backend, timeout_s])
    member_code, _, _ = _ended(member, "the member")
    code, said, seconds = _ended(leader, "the leader")
    assert member_code == -9, f"the member was not killed by its fault (exit {member_code})"
    assert code == 3 and "raised" in said, f"the leader: exit {code}: {said}"
    return f"{backend}: {said.removeprefix('side: ')}"


def check_side_stream_sync(device: torch.device, work: Path) -> str:
    """The in-flight sync's side thread beside a busy training stream: the broadcast (of a
    one-rank weight group: the sender's own work, no peer needed) completes while the
    training kernels queued before it are still running, as it waits only for the event
    its tensors were made under. Both timed. On the CPU there are no streams: the code
    path runs, the overlap is not checked."""
    from hpc_asyncppo.transport.weight_group import WeightGroupSpec, open_weight_group
    from hpc_asyncppo.transport.weights import WeightBroadcaster

    spec = WeightGroupSpec("127.0.0.1", _free_port(), 1, _backend(device), GROUP_TIMEOUT_S)
    group = open_weight_group(spec, 0)
    sender = WeightBroadcaster(group, 0, 64, device)
    cuda = device.type == "cuda"
    named = [(f"w{i}", torch.randn(2**22 if cuda else 2**12, device=device)) for i in range(8)]
    x = torch.randn(4096 if cuda else 64, 4096 if cuda else 64, device=device)
    sender.broadcast(0, named)  # the buffers and the communicator, before timing
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.monotonic()
    training_done = torch.cuda.Event() if device.type == "cuda" else None
    sending = sender.broadcast_in_background(1, named)
    for _ in range(200 if cuda else 2):  # the training stream, busy
        x = torch.tanh(x @ x)
    if training_done is not None:
        training_done.record()
    sync_s = float(sending.result(HANG_S))
    sent_at = time.monotonic() - start
    if training_done is not None:
        overlapped = not training_done.query()
        torch.cuda.synchronize(device)
        train_s = time.monotonic() - start
        group.close()
        assert overlapped, (
            f"the sync ({sync_s:.3f} s) waited for the training stream ({train_s:.3f} s)"
        )
        return f"sync {sync_s:.3f} s done at {sent_at:.3f} s, while training ran to {train_s:.3f} s"
    group.close()
    return f"sync {sync_s:.3f} s on the side thread (no streams on the CPU)"


def check_lora_merge(device: torch.device, work: Path) -> str:
    """LoRA syncs into the transformers engine on this device (a random Qwen2.5-3B
    architecture on a GPU): the first reads the targeted base weights from the model's
    files, the next merges from the base it holds, with the folder gone; each merged weight
    is base + B @ A computed on the device. Timed against a full sync of the same model."""
    from hpc_asyncppo.config import ModelConfig, RolloutConfig
    from hpc_asyncppo.models import lora
    from hpc_asyncppo.rollout.hf_engine import HFEngine

    folder = random_qwen(work, "3B" if device.type == "cuda" else "tiny")
    engine = HFEngine(ModelConfig(path=str(folder), dtype="bfloat16"), RolloutConfig(), device)
    base = {n: p.detach().clone() for n, p in engine.named_parameters()}

    def adapters(seed: int) -> dict[str, torch.Tensor]:  # rank 8 on every projection
        g = torch.Generator(device=device).manual_seed(seed)
        out = {}
        for name, p in base.items():
            if name.endswith("_proj.weight"):
                module = name.removesuffix(".weight")
                out[module + lora.LORA_A] = torch.randn((8, p.shape[1]), generator=g, device=device)
                out[module + lora.LORA_B] = (
                    torch.randn((p.shape[0], 8), generator=g, device=device) / 100
                )
        return out

    def timed(load: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.monotonic()
        load()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.monotonic() - start

    full_s = timed(lambda: engine.load_weights(base, version=1))
    first_s = timed(lambda: engine.load_weights(adapters(1), version=2))
    away = folder.with_name(folder.name + ".away")
    folder.rename(away)
    try:
        second = adapters(2)
        lora_s = timed(lambda: engine.load_weights(second, version=3))
    finally:
        away.rename(folder)
    merged = dict(lora.merged_weights(second, base.items(), base[next(iter(base))].dtype))
    for name, param in engine.named_parameters():
        assert torch.equal(param, merged.get(name, base[name])), name
    gb = engine.base.held_bytes / 1e9
    return (
        f"LoRA sync {lora_s:.3f} s from the held base ({gb:.1f} GB; the first, reading it, "
        f"{first_s:.3f} s) against a full sync {full_s:.3f} s; {len(merged)} weights merged"
    )


CHECKS: dict[str, Callable[[torch.device, Path], str]] = {
    "gpu_binding": check_gpu_binding,
    "fsdp2_step": check_fsdp2_step,
    "checkpoint": check_checkpoint,
    "default_job_learns": check_default_job_learns,
    "weight_sync_via_host": check_weight_sync_via_host,
    "recipe_budget": check_recipe_budget,
    "memory_check": check_memory_check,
    "weight_group_peer_missing": check_weight_group_peer_missing,
    "weight_sync_peer_dies": check_weight_sync_peer_dies,
    "side_stream_sync": check_side_stream_sync,
    "lora_merge": check_lora_merge,
}


def run_checks(device: torch.device, work: Path, names: list[str]) -> int:
    """Run the checks, one line each and a summary; the number that failed."""
    failed, start = 0, time.monotonic()
    for name in names:
        t0 = time.monotonic()
        try:
            detail, status = CHECKS[name](device, work), "OK"
        except Exception as exc:  # noqa: BLE001 - report every check, then the summary
            detail, status = f"{type(exc).__name__}: {' '.join(str(exc).split())}", "FAILED"
            failed += 1
        print(f"gpu_check: {name}: {status} ({detail}) [{time.monotonic() - t0:.1f} s]", flush=True)
    passed = len(names) - failed
    print(f"gpu_check: {passed}/{len(names)} checks passed on {device} in "
          f"{time.monotonic() - start:.0f} s", flush=True)  # fmt: skip
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--work", default="", help="work folder; default: a new temp folder")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing run")
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {names}")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one line per check, nothing between
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    return 1 if run_checks(device, work, args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
