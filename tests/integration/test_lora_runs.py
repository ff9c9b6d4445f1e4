"""A LoRA run under mpirun (``actor.lora_rank`` > 0, models/lora.py): a real Qwen2-shaped
model, two trainer ranks, stopped by SIGTERM mid-run and resumed on one; every sync carries
the adapters only, and every rollout rank holds the leader's adapters at every version;
every sample is trained once; the checkpoint holds the adapters and names its base; the
export, merged or as a PEFT adapter folder, gives the trainer's logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.config import DataConfig, load_resolved
from hpc_asyncppo.models import lora
from hpc_asyncppo.models.tiny import build_tiny_qwen2
from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.trainer.policy import Policy
from tests.harness import REPO, Run, check_audit, check_weights_match

pytestmark = pytest.mark.mpi
CPU = torch.device("cpu")
LORA = ["actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-2"]


def qwen2_model(out: Path) -> Path:
    """A random Qwen2 (q/k/v biases: a merged weight beside a bias the sync leaves alone)."""
    return build_tiny_qwen2(out, load_task(DataConfig()).vocabulary(), tied=False, seed=0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SIGTERM after step 3 on two trainer ranks; resumed on one for 7 steps more. The first
    attempt's end is out of reach of a test process the machine starves for seconds: the
    resume sets the run's length (``steps_of``)."""
    root = tmp_path_factory.mktemp("lora_run")
    model = qwen2_model(root / "qwen2")
    run = root / "run"
    args = [f"model.path={model}", *LORA, "actor.ppo_mini_batch_size=4", "data.num_prompts=64",
            "trainer.total_steps=100000", "trainer.record_weight_digests=true", "rollout.record_sent_groups=true",
            "checkpoint.save_every=0", "timeouts.sample_wait_s=120",
            # a sync after every step: a checkpoint taken between syncs goes out as a new
            # version on resume, which check_audit's sync schedule does not model
            "async_training.trigger_parameter_sync_step=1"]  # fmt: skip
    job = Run.start(run, *args, train_ranks=2)
    job.wait_for_step(3)
    job.stop()  # exit 143, "continue with" the resume
    steps = protocol.checkpoint_step(protocol.list_checkpoints(run)[0]) + 7
    done = job.resume(f"trainer.total_steps={steps}", train_ranks=1).finish()
    assert done.returncode == 0, done.stdout + done.stderr
    return run


def steps_of(run_dir: Path) -> int:
    """The run's length, as its last attempt was asked for."""
    return load_resolved(run_dir / "config.yaml").trainer.total_steps


def test_a_lora_run_syncs_adapters_only_and_resumes_exactly_once(run_dir):
    steps = steps_of(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["step"] == steps
    trained = check_audit(run_dir, sync_every=1, max_staleness=4)
    assert len({r["uid"] for r in trained}) == len(trained) == steps * 4 * 8
    # both attempts' leaders (rank 1, then rank 1 again) digested what they sent; the
    # rollout rank, what it received: the adapters, equal at every version
    check_weights_match(run_dir, rollout_ranks=1, versions=steps + 1)  # a sync after each step
    # what crossed the sync: the adapters, a small part of the model's bytes
    sent = metrics[-1]["sync/bytes"]
    model_bytes = sum(
        t.numel() * 4
        for _, t in lora.BaseWeights(load_resolved(run_dir / "config.yaml").model.path).read()
    )
    assert 0 < sent < model_bytes / 4, (sent, model_bytes)
    # the final checkpoint: adapters and their optimizer state, and the base it belongs to
    folder = protocol.list_checkpoints(run_dir)[0]
    manifest = protocol.read_manifest(folder)
    with protocol.ShardedReader(folder, manifest, [0]) as reader:
        names = reader.keys("model")
        base = json.loads(str(reader.get("lora_base")))
    assert names and all(lora.is_adapter(n) for n in names)
    assert base["sha256"] == json.loads(lora.base_identity(base["path"]))["sha256"]


def restored(run_dir: Path) -> Policy:
    cfg = load_resolved(run_dir / "config.yaml")
    policy = Policy(cfg, CPU)
    folder = protocol.list_checkpoints(run_dir)[0]
    manifest = protocol.read_manifest(folder)
    parts = protocol.overlapping_parts(0, 1, manifest["train_ranks"])
    with protocol.ShardedReader(folder, manifest, parts) as reader:
        policy.load_state_dict(reader)
    return policy


@torch.no_grad()
def logits_of(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 15, (4, 12), generator=gen)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_the_export_merged_or_as_an_adapter_gives_the_trainers_logits(run_dir, tmp_path):
    from peft import PeftModel

    policy = restored(run_dir)
    policy.module.unshard()
    try:
        expected = logits_of(policy.model)
    finally:
        policy.module.reshard()
    base_path = load_resolved(run_dir / "config.yaml").model.path
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for out, fmt in ((merged, "merged"), (adapter, "adapter")):
        cmd = [sys.executable, "-m", "hpc_asyncppo.export", str(run_dir), str(out),
               "--lora-format", fmt]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    torch.testing.assert_close(logits_of(model), expected, atol=1e-5, rtol=0)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter)
    torch.testing.assert_close(logits_of(peft_model.eval()), expected, atol=1e-5, rtol=0)
    # the adapters moved the model (the comparison has teeth)
    plain = logits_of(AutoModelForCausalLM.from_pretrained(base_path).eval())
    assert (plain - expected).abs().max() > 1e-3
    # --lora-format adapter of a run without LoRA: one line
    bad = subprocess.run(
        [sys.executable, "-m", "hpc_asyncppo.export", str(run_dir), str(tmp_path / "x"),
         "--lora-format", "nope"], capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and not (tmp_path / "x").exists()
