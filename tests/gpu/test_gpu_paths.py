"""The CUDA code paths, on a real GPU; skipped where torch sees none (CI has none).

Run on a GPU machine with ``pytest -m gpu tests/gpu``. One GPU is enough for all but the
two-GPU NCCL test: there the rollout rank and the trainer leader share the GPU, so the
weight broadcast goes through host memory (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hpc_asyncppo.config import Config, ModelConfig, RolloutConfig
from hpc_asyncppo.rollout.hf_engine import HFEngine
from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.tasks.next_digit import LEARNED_REWARD, UNTRAINED_REWARD_MAX
from hpc_asyncppo.trainer.policy import Policy
from hpc_asyncppo.transport.weights import pack, plan_buckets, unpack
from tests.conftest import end_spawned_rank
from tests.harness import Run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_weight_buckets_on_the_gpu_are_bit_exact() -> None:
    cuda = torch.device("cuda")
    named = [
        ("a", torch.randn(257, 3, device=cuda, dtype=torch.bfloat16)),
        ("b", torch.randn(1000, device=cuda)),
        ("c", torch.randn(4, 5, device=cuda, dtype=torch.float16)),
    ]
    slots = plan_buckets(named, bucket_bytes=2048)
    out = unpack(pack(named, slots, cuda), slots)
    for name, tensor in named:
        assert out[name].device.type == "cuda" and out[name].dtype == tensor.dtype
        assert torch.equal(out[name], tensor), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollout_log_probs_match_the_trainers_on_the_gpu(
    tiny_model_dir: Path, log_probs_of, dtype: str
) -> None:
    cuda = torch.device("cuda")
    cfg = dataclasses.replace(
        Config(),
        model=ModelConfig(path=str(tiny_model_dir), dtype=dtype),
        rollout=RolloutConfig(response_length=8, n=4),
    )
    engine, policy = HFEngine(cfg.model, cfg.rollout, cuda), Policy(cfg, cuda)
    torch.manual_seed(1)
    prompts = [engine.encode("1 2 3 4 ="), engine.encode("9 ="), engine.encode("5 5 =")]
    gens = engine.generate(prompts, n=4)
    trainer_lp, rollout_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
    assert trainer_lp.device.type == "cuda"
    diff = (trainer_lp.float() - rollout_lp.float()).abs()[mask]
    # Same kernels, same weights; bf16 differs by batch shape (padding) only.
    bound = 1e-4 if dtype == "float32" else 0.1
    print(f"{dtype}: max |rollout - trainer| log-prob {diff.max().item():.2e}")
    assert diff.max().item() < bound


def test_default_job_learns_on_the_gpu(tmp_path: Path) -> None:
    """The README's first command on a GPU machine: both roles on CUDA, and it learns."""
    run_dir = tmp_path / "run"
    proc = Run.start(run_dir, "trainer.record_weight_digests=true").finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rewards = [m["reward/mean"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    assert first < UNTRAINED_REWARD_MAX and last >= LEARNED_REWARD, rewards
    logs = {r: (run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    # Each rank sees only its own GPU set (launch/gpus.py), so each works on its cuda:0.
    expect_sync = "cuda:0" if GPUS >= 2 else "cpu"  # one GPU: the broadcast goes via the host
    assert f"rollout rank on cuda:0; weights travel via {expect_sync}" in logs[0], logs[0]
    assert "trainer rank on cuda:0" in logs[1], logs[1]
    gpus = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text())["gpus"] for r in (0, 1)]
    assert gpus == ([[0], [1]] if GPUS >= 2 else [[0], [0]]), gpus
    print(f"{GPUS} GPU(s); trainer's weights travel via {expect_sync}")
    # After every sync the rollout rank holds exactly the trainer's weights.
    leader = {r["version"]: r["digest"] for r in read_jsonl(run_dir / "weights" / "rank1.jsonl")}
    mine = {r["version"]: r["digest"] for r in read_jsonl(run_dir / "weights" / "rank0.jsonl")}
    assert mine == leader and len(leader) > 10


@pytest.mark.skipif(GPUS != 1, reason="needs exactly one GPU")
def test_trainer_ranks_sharing_a_gpu_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    proc = Run.start(tmp_path / "run", train_ranks=2).finish()
    assert proc.returncode != 0
    assert "2 trainer ranks but this machine shows 1 GPU(s)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _nccl_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hpc_asyncppo.transport.weights import WeightBroadcaster, WeightReceiver

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))  # fmt: skip
    group = dist.new_group([0, 1])
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(7)
    named = [(f"w{i}", torch.randn(300, 70, generator=gen, device=device, dtype=torch.bfloat16))
             for i in range(5)]  # fmt: skip
    if rank == 1:
        WeightBroadcaster(group, 1, bucket_mb=1, device=device).broadcast(3, named)
    else:
        version, got = WeightReceiver(group, 1, device).receive_all()
        ok = version == 3 and all(torch.equal(got[n], t) for n, t in named)
        Path(out).write_text("ok" if ok else "mismatch")
    end_spawned_rank()


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs two GPUs for two ranks")
def test_nccl_weight_broadcast_between_two_gpus_is_bit_exact(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result"
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_nccl_worker, args=(r, port, str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.read_text() == "ok"


def test_checkpoint_of_a_gpu_model_restores_exactly(tmp_path: Path, tiny_model_dir: Path) -> None:
    """bf16 weights, AdamW state and the CUDA RNG, taken from the GPU, round-trip exactly."""
    from hpc_asyncppo.checkpoint.store import load_checkpoint, rng_state, save_checkpoint

    cuda = torch.device("cuda")
    cfg = dataclasses.replace(
        Config(), model=ModelConfig(path=str(tiny_model_dir), dtype="bfloat16")
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.bfloat16).to(cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = sum(p.float().square().sum() for p in model.parameters())
    loss.backward()
    opt.step()
    torch.cuda.manual_seed(11)
    tree = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": rng_state()}
    save_checkpoint(tmp_path / "ck.h5", tree, {"step": 1})
    got, meta = load_checkpoint(tmp_path / "ck.h5")
    assert meta["step"] == 1
    for name, t in model.state_dict().items():
        assert got["model"][name].dtype == t.dtype and torch.equal(got["model"][name], t.cpu()), (
            name
        )
    exp_avg = {k: v["exp_avg"] for k, v in opt.state_dict()["state"].items()}
    for key, t in exp_avg.items():
        assert torch.equal(got["optim"]["state"][key]["exp_avg"], t.cpu())
    assert torch.equal(got["rng"]["cuda"][0], torch.cuda.get_rng_state(0))
