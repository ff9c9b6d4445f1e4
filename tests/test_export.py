"""``python -m hpc_asyncppo.export``: a real run (2 trainer ranks under mpirun, a tiny Qwen2
with tied embeddings) exported to a Hugging Face folder that transformers and vLLM load,
whose logits equal the trainer's model restored from the same checkpoint; bad input gets
one line and leaves nothing behind; the export's memory stays far below the model's size."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.protocol import write_trainer_part
from hpc_asyncppo.config import (
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    load_resolved,
    to_yaml,
)
from hpc_asyncppo.export import INDEX
from hpc_asyncppo.export import main as export_main
from hpc_asyncppo.models.tiny import build_tiny_qwen2
from hpc_asyncppo.paths import HF_FINAL
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.trainer.policy import Policy, trainer_states
from tests.conftest import vllm_environment
from tests.harness import REPO, SMALL, Run, leftovers, one_line_error

CPU = torch.device("cpu")
STEPS = 6


def qwen2_model(out: Path, tied: bool, **size: int) -> Path:
    """A random Qwen2 with the default task's tokenizer (2 heads of 32: vLLM's CPU kernels)."""
    return build_tiny_qwen2(out, load_task(DataConfig()).vocabulary(), tied, seed=0, **size)


def export(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpc_asyncppo.export", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps on 2 trainer ranks, checkpoints at steps 3 and 6, hf_final at the end."""
    root = tmp_path_factory.mktemp("export_run")
    model = qwen2_model(root / "qwen2_tied", tied=True)
    run = root / "run"
    proc = Run.start(run, f"model.path={model}", *SMALL, f"trainer.total_steps={STEPS}",
                     "checkpoint.save_every=3", "checkpoint.save_hf_final=true",
                     train_ranks=2).finish()  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(protocol.read_manifest(protocol.step_dir(run, STEPS))["parts"]) == [
        "leader.h5", "rollout0.h5", "trainer0.h5", "trainer1.h5"
    ]  # fmt: skip
    return run


def restored_policy(run_dir: Path, step: int, dtype: str) -> Policy:
    """The trainer's model (one rank here) restored from the 2-rank checkpoint of ``step``."""
    cfg = load_resolved(run_dir / "config.yaml")
    cfg.model.dtype = dtype
    policy = Policy(cfg, CPU)
    folder = protocol.step_dir(run_dir, step)
    manifest = protocol.read_manifest(folder)
    parts = protocol.overlapping_parts(0, 1, manifest["train_ranks"])
    with protocol.ShardedReader(folder, manifest, parts) as reader:
        policy.load_state_dict(reader)
    return policy


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 15, (4, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    return ids, mask


@torch.no_grad()
def trainer_logits(policy: Policy) -> torch.Tensor:
    ids, mask = fixed_batch()
    policy.module.unshard()  # whole weights, cast to the compute dtype as in training
    try:
        return policy.model(input_ids=ids, attention_mask=mask).logits
    finally:
        policy.module.reshard()


@torch.no_grad()
def exported_logits(folder: Path) -> tuple[torch.Tensor, object]:
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    ids, mask = fixed_batch()
    return model.eval()(input_ids=ids, attention_mask=mask).logits, model


@pytest.mark.mpi
def test_fp32_export_has_the_trainers_logits(run_dir, tmp_path):
    out = tmp_path / "fp32"
    proc = export(run_dir, out, "--max-shard-mb", "0.1")
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for name in ("config.json", "generation_config.json", INDEX, "tokenizer.json"):
        assert name in files
    logits, model = exported_logits(out)
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, saved once
    expected = trainer_logits(restored_policy(run_dir, STEPS, "float32"))
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    # checkpoint.save_hf_final wrote the same model at the end of the run
    final, _ = exported_logits(run_dir / HF_FINAL)
    assert torch.equal(final, logits)


@pytest.mark.mpi
def test_bf16_export_is_exactly_the_bf16_trainers(run_dir, tmp_path):
    out = tmp_path / "bf16"
    proc = export(run_dir, out, "--dtype", "bf16", "--step", "3")
    assert proc.returncode == 0, proc.stderr
    logits, model = exported_logits(out)
    assert model.dtype == torch.bfloat16
    expected = trainer_logits(restored_policy(run_dir, 3, "bfloat16"))
    assert expected.dtype == torch.bfloat16
    assert torch.equal(logits, expected), (logits.float() - expected.float()).abs().max()


@pytest.mark.mpi
def test_vllm_loads_the_export_and_generates_the_trainers_log_probs(
    run_dir, tmp_path, monkeypatch, log_probs_of, vllm_cache
):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh --with-vllm)")
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine

    for key, value in vllm_environment(tmp_path, vllm_cache).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "hf"
    assert export(run_dir, out).returncode == 0
    rollout = RolloutConfig(engine="vllm", n=4, response_length=8)
    engine = VLLMEngine(ModelConfig(path=str(out)), rollout, CPU, max_prompt_length=16, seed=3)
    try:
        prompts = [engine.encode(text) for text in ("1 2 3 =", "9 =", "4 0 7 7 2 =")]
        gens = engine.generate(prompts, rollout.n)
    finally:
        engine.close()
    assert all((g.response_lengths >= 1).all() for g in gens)
    policy = restored_policy(run_dir, STEPS, "float32")
    lp, vllm_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
    diff = (lp - vllm_lp).abs()[mask]
    assert diff.max().item() < 1e-4, f"max diff {diff.max().item()}"


@pytest.mark.mpi
def test_bad_input_gets_one_line_and_leaves_nothing(run_dir, tmp_path, capsys):
    def export_here(*args: str | Path) -> subprocess.CompletedProcess:
        """The export's main in this process (the command line itself: the first case)."""
        code = export_main([str(a) for a in args])
        said = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, said.out, said.err)

    one_line_error(export(tmp_path / "nope", tmp_path / "a"), "nope", "does not exist")
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    one_line_error(export_here(not_a_run, tmp_path / "a"), "config.yaml")
    no_checkpoint = tmp_path / "no_ckpt"
    no_checkpoint.mkdir()
    shutil.copy(run_dir / "config.yaml", no_checkpoint)
    one_line_error(export_here(no_checkpoint, tmp_path / "a"), "no checkpoint", "save_final")
    one_line_error(export_here(run_dir, tmp_path / "a", "--step", "4"), "step 4", "3, 6")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    one_line_error(export_here(run_dir, taken), str(taken), "not an empty folder")
    assert [p.name for p in taken.iterdir()] == ["x"]
    assert not (tmp_path / "a").exists() and leftovers(tmp_path) == []


@pytest.mark.mpi
def test_a_corrupt_newest_checkpoint_falls_back_and_is_refused_by_step(run_dir, tmp_path):
    """A flipped byte in a tensor of step 6's trainer1.h5: the default export warns and takes
    step 3; --step 6 fails with one line and leaves no folder, not even a temporary one."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("model", HF_FINAL))
    part = protocol.step_dir(copy, STEPS) / "trainer1.h5"
    with h5py.File(part, "r") as f:
        dataset = f["tree/model/model.norm.weight"]
        offset = dataset.id.get_offset()
    with part.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    one_line_error(export(copy, tmp_path / "six", "--step", str(STEPS)), "checksum")
    assert not (tmp_path / "six").exists() and leftovers(tmp_path) == []
    proc = export(copy, tmp_path / "newest")
    assert proc.returncode == 0, proc.stderr
    assert "step_00000003" in proc.stdout and "trying an older checkpoint" in proc.stderr
    good = tmp_path / "three"
    assert export(run_dir, good, "--step", "3").returncode == 0
    assert torch.equal(exported_logits(tmp_path / "newest")[0], exported_logits(good)[0])


# The exporting process's peak resident memory: the kernel's exact high-water mark
# (VmHWM), started afresh once the imports are done
PEAK_PROBE = """
import sys
from pathlib import Path
from hpc_asyncppo.export import main
import transformers.models.qwen2.modeling_qwen2  # what the export imports, before measuring

def kib(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024

Path("/proc/self/clear_refs").write_text("5")
base = kib("VmRSS")
rc = main(sys.argv[1:])
print(base, kib("VmHWM"))
sys.exit(rc)
"""


def test_peak_memory_of_an_export_is_a_fraction_of_the_model(tmp_path):
    """A 30M-parameter Qwen2 (114 MiB in fp32) checkpointed by the trainer (a GAE policy,
    with its value head), exported in 16 MiB shards: the exporting process grows by a few
    of its largest tensor (8 MiB), not by the model; the value head is left out. Measured
    here: 35.6 MiB of growth, 0.31 x the model (printed with -s)."""
    model = qwen2_model(
        tmp_path / "model", tied=False, vocab_size=4096, hidden_size=512,
        intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8,
    )  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    # a GAE policy: its checkpoint holds a value head, which is no part of the HF model
    cfg = Config(model=ModelConfig(path=str(model)), algorithm=AlgorithmConfig(adv_estimator="gae"))
    (run / "config.yaml").write_text(to_yaml(cfg))
    policy = Policy(cfg, CPU)
    model_bytes = sum(p.numel() * 4 for p in policy.model.parameters())
    folder = protocol.step_dir(run, 1)
    parts = [write_trainer_part(folder, trainer_states(policy), 0)]
    protocol.commit(folder, parts, {"step": 1, "param_version": 0, "train_ranks": 1})
    del policy
    assert set(protocol.read_full(folder, "value_head")) == {"weight", "bias"}
    cmd = [sys.executable, "-c", PEAK_PROBE, str(run), str(tmp_path / "hf"), "--max-shard-mb", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    base, peak = map(int, proc.stdout.split()[-2:])
    growth = peak - base
    exported = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    assert exported >= model_bytes
    message = (
        f"model {model_bytes / 2**20:.1f} MiB; RSS {base / 2**20:.1f} -> {peak / 2**20:.1f} "
        f"MiB, growth {growth / 2**20:.1f} MiB = {growth / model_bytes:.2f} x the model"
    )
    print(message)
    assert growth < 0.5 * model_bytes, message
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert np.isclose(sum(p.numel() for p in loaded.parameters()) * 4, model_bytes)
    index = json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"]
    assert not [name for name in index if "value" in name]
