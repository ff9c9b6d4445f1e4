"""The vLLM engine on this machine's CPU, for real, at tensor_parallel_size=2 (two vLLM
workers, each loading the full tensors through vLLM's loader, which shards them): log-probs
against the trainer's, weight updates through the weight group's worker code (this process
is the group's sender, as the trainer leader is in a job), worker-side digests, the memory
a sync costs the process that drives the engine, a LoRA sync (adapters merged by each
worker), partial rollout across an update, and a dead engine process.

vLLM's CPU attention has no kernel for the default tiny model's head size (64 / 4 heads =
16), so these tests build a wider Llama with head size 32 (256 wide, 8 heads: ~5 MB of
fp32 weights, so that a copy of the model would show in the memory check). One engine
serves the whole module (starting one takes ~30-60 s here); each test loads the weights
it needs. The job-level run (2 rollout ranks x TP 2, 2 trainer ranks, mpirun):
tests/integration/test_vllm_runs.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh --with-vllm)")

from hpc_asyncppo.config import Config, DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.rollout.generation import Generation
from hpc_asyncppo.runlog import weights_digest
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.trainer.policy import Policy
from tests.conftest import peak_rss, reset_peak_rss, vllm_environment

CPU = torch.device("cpu")
HANG_S = 60  # a bound for a hang, never a speed
# fp32, vLLM's oneDNN kernels with sums split over two TP workers, against transformers'
# eager ones, on the 256-wide model: most sampled tokens differ by < 3e-5, low-probability
# ones by up to about 1e-4. A wrong or stale weight is
# off by 0.1 and more (KV of old weights reused: over 1.0).
TOLERANCE = 3e-4
RESPONSE_LENGTH = 24
MAX_PROMPT = 160  # room for a prompt longer than one KV block (128 tokens on CPU)
N = 4
MAX_NUM_SEQS = 8
TP = 2
BUCKET_MB = 1 / 16  # 64 KiB buckets: the model takes about 80 of them


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory, vllm_cache: Path):
    """Offline, no torch.compile, the temp files under a test folder."""
    root = tmp_path_factory.mktemp("vllm")
    values = vllm_environment(root, vllm_cache)
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_model_2heads")
    words = load_task(DataConfig()).vocabulary()
    size = TinyModelConfig(hidden_size=256, num_heads=8, intermediate_size=512)
    return build_tiny_model(out, words, size, seed=3)


def make_cfg(model_dir: Path, temperature: float) -> Config:
    return dataclasses.replace(
        Config(),
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(
            engine="vllm",
            temperature=temperature,
            response_length=RESPONSE_LENGTH,
            n=N,
            # capacity knobs set, so the tests run through them: 12 sequences queue for 8 slots
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=256,
            tensor_parallel_size=TP,
        ),
    )


@pytest.fixture(scope="module")
def engine(vllm_env, model_dir):
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine

    cfg = make_cfg(model_dir, temperature=0.7)
    eng = VLLMEngine(cfg.model, cfg.rollout, CPU, max_prompt_length=MAX_PROMPT, seed=5)
    eng.standalone_bucket_mb = BUCKET_MB
    yield eng
    eng.close()


def perturbed(policy: Policy, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Change the policy's weights in place (a stand-in for a trainer step); return them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():  # the policy's own (one-rank) shards
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(scale * torch.randn(local.shape, generator=gen))
    return {n: t.clone() for n, t in policy.named_weights()}


def prompts_for(engine) -> list[list[int]]:
    long = engine.encode(" ".join(str(i * 7 % 10) for i in range(140)) + " =")
    assert len(long) <= MAX_PROMPT
    return [engine.encode("1 2 3 4 ="), engine.encode("9 ="), long]


def test_capacity_knobs_reach_vllm(engine):
    scheduler = engine.llm.vllm_config.scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (MAX_NUM_SEQS, 256)
    assert engine.llm.vllm_config.cache_config.enable_prefix_caching


def test_engine_kwargs_leave_zero_knobs_to_vllm(model_dir):
    from hpc_asyncppo.rollout.vllm_engine import engine_kwargs

    rollout = RolloutConfig(engine="vllm", enable_prefix_caching=False, enforce_eager=False)
    kwargs = engine_kwargs(ModelConfig(path=str(model_dir)), rollout, CPU, 16)
    assert "max_num_seqs" not in kwargs and "max_num_batched_tokens" not in kwargs
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["enforce_eager"] is True  # always eager on CPU
    gpu = engine_kwargs(ModelConfig(path="m"), rollout, torch.device("cuda", 0), 16)
    assert gpu["enforce_eager"] is False and gpu["max_model_len"] == 16 + rollout.response_length


def test_kv_block_is_shorter_than_the_long_prompt(engine):
    """Prefix caching reuses whole blocks only: the long prompt must fill one."""
    assert len(prompts_for(engine)[-1]) > engine.llm.vllm_config.cache_config.block_size


def test_generation_layout_matches_the_hf_engine(engine, model_dir):
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
    gens = engine.generate(prompts_for(engine), N)
    saw_eos = False
    for gen in gens:
        assert gen.response_ids.shape == gen.log_probs.shape == (N, RESPONSE_LENGTH)
        for ids, length, lp, versions in zip(
            gen.response_ids, gen.response_lengths, gen.log_probs, gen.versions, strict=True
        ):
            assert 1 <= length <= RESPONSE_LENGTH
            assert (ids[length:] == engine.pad_id).all() and (lp[length:] == 0).all()
            assert (lp[:length] < 0).all() and (versions[:length] == 0).all()
            assert (versions[length:] == -1).all()
            eos = np.flatnonzero(ids[:length] == engine.eos_id)
            assert eos.size == 0 or eos.tolist() == [length - 1]
            saw_eos |= eos.size == 1
    assert saw_eos, "no response ended with EOS: the layout past EOS went untested"


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_log_probs_match_the_trainers(engine, model_dir, log_probs_of, temperature):
    """Same weights, same tokens: vLLM's sampled-token log-probs equal the trainer's
    log_softmax(logits / temperature) within TOLERANCE (prompts shorter and longer than a
    KV block)."""
    policy = Policy(make_cfg(model_dir, temperature), CPU)
    engine.sampling.temperature = temperature
    try:
        engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
        prompts = prompts_for(engine)
        gens = engine.generate(prompts, N)
    finally:
        engine.sampling.temperature = 0.7
    lp, rollout_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
    diff = (lp - rollout_lp).abs()[mask]
    assert diff.max().item() < TOLERANCE, f"max diff {diff.max().item()}"


def test_after_a_weight_update_log_probs_match_the_new_weights(engine, model_dir, log_probs_of):
    """After each sync into both TP workers: sampled log-probs equal the trainer's forward,
    and greedy responses to fixed prompts are transformers' greedy continuation of the
    same weights, token for token, with log-probs equal to its log_softmax within
    TOLERANCE."""

    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    # 1 MiB buckets: a few per sync (many small ones: the no-copy test below)
    engine.standalone_bucket_mb = 1.0
    try:
        engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
        check_updates(engine, policy, model_dir, log_probs_of)
    finally:
        engine.standalone_bucket_mb = BUCKET_MB


def check_updates(engine, policy, model_dir, log_probs_of) -> None:
    """Two syncs, each checked as the GPU check checks one (``gpu_check.check_vllm_update``:
    worker digests, greedy tokens and log-probs against transformers), and the sampled
    log-probs against the trainer's forward."""
    from transformers import AutoModelForCausalLM

    from hpc_asyncppo.gpu_check import check_vllm_update

    prompts = prompts_for(engine)
    engine.generate(prompts, N)  # fills the prefix cache with KV of the old weights
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for version, seed in ((1, 11), (2, 12)):
        weights = perturbed(policy, seed)
        update = engine.load_weights(weights, version=version, digest=True)
        gens = engine.generate(prompts, N)
        assert all((g.versions[:, 0] == version).all() for g in gens)
        lp, rollout_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
        diff = (lp - rollout_lp).abs()[mask]
        assert diff.max().item() < TOLERANCE, f"v{version}: max diff {diff.max().item()}"
        said = check_vllm_update(engine, update, weights, hf, prompts, TOLERANCE)
        assert said.startswith(f"v{version}: {TP} workers' digests equal the sender's"), said


def lora_policy(model_dir: Path, targets: str, seed: int) -> Policy:
    """A trainer policy with LoRA adapters on ``targets``, their B random (it starts at
    zero): adapters with an effect."""
    cfg = make_cfg(model_dir, 0.7)
    actor = dataclasses.replace(cfg.actor, lora_rank=4, target_modules=targets)
    policy = Policy(dataclasses.replace(cfg, actor=actor), CPU)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if isinstance(p, DTensor) else p
                local.add_(0.5 * torch.randn(local.shape, generator=gen))
    return policy


def test_lora_syncs_carry_adapters_and_reload_only_the_layers_they_change(
    engine, model_dir, log_probs_of
):
    """LoRA syncs (``models/lora.py``) into both TP workers: only the adapters cross (the
    workers' digests are the adapters'); each worker merges them into the base, read from
    the model's files at the first LoRA sync and held, and reloads the layers they change;
    the sampled log-probs then equal the trainer's forward with the adapters applied (and
    not the base's). Then adapters on q_proj alone, twice, the model's files gone: the
    first gives the layers that only the earlier adapters changed their base back, the
    second reloads the fused q/k/v layers alone, and vLLM keeps every other layer's
    weights (its CPU build repacks them: put back, not reloaded). A full sync before the
    first (the module's other tests) has every layer reloaded with its base."""
    from hpc_asyncppo.models import lora

    def check(policy: Policy, version: int) -> list[dict]:
        adapters = {n: t.clone() for n, t in policy.named_weights()}
        assert adapters and all(lora.is_wire_adapter(n) for n in adapters)
        update = engine.load_weights(adapters, version=version, digest=True)
        assert update.digests == [weights_digest(list(adapters.items()))] * TP
        prompts = prompts_for(engine)
        gens = engine.generate(prompts, N)
        lp, rollout_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
        diff = (lp - rollout_lp).abs()[mask]
        assert diff.max().item() < TOLERANCE, f"v{version}: max diff {diff.max().item()}"
        with lora.adapters_disabled(policy.model):
            base_lp, _, _ = log_probs_of(policy, prompts, gens, engine.pad_id)
        assert (base_lp - rollout_lp).abs()[mask].max().item() > 0.1  # the adapters count
        return engine.last_sync()

    # (after this module's full syncs every layer is reloaded: each gets its base back)
    every = check(lora_policy(model_dir, "all-linear", seed=41), version=7)
    layers = TinyModelConfig().num_layers
    narrow = lora_policy(model_dir, "q_proj", seed=42)
    files = {path: path.read_bytes() for path in model_dir.glob("*.safetensors")}
    for path in files:
        path.unlink()
    try:
        # q k v o gate up down: the layers the adapters of version 7 changed
        assert {w["tensors_loaded"] for w in check(narrow, version=8)} == {7 * layers}
        workers = check(narrow, version=9)
        assert {w["tensors_loaded"] for w in workers} == {3 * layers}  # q k v
        assert all(w["base_bytes"] == every[0]["base_bytes"] > 0 for w in workers)
    finally:
        for path, data in files.items():
            path.write_bytes(data)


def test_every_worker_loads_the_senders_weights_and_this_process_keeps_no_copy(engine, model_dir):
    """Both TP workers are members of the weight group (ranks 1 and 2 after the sender),
    each digests what it handed to vLLM's loader: the sender's digest, at every version.
    The process driving the engine holds no copy of the weights: its resident memory
    during a sync stays within two buckets (the sender's buffers) of where it was."""
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    model_bytes = sum(p.numel() * 4 for p in policy.model.parameters())
    bucket_bytes = int(BUCKET_MB * 2**20)
    assert model_bytes > 40 * bucket_bytes
    for version, seed in ((0, None), (1, 31)):
        weights = perturbed(policy, seed) if seed else dict(policy.named_weights())
        weights = {n: t.clone() for n, t in weights.items()}
        before = reset_peak_rss()
        update = engine.load_weights(weights, version=version, digest=True)
        assert update.digests == [weights_digest(list(weights.items()))] * TP, version
        assert sorted(w["rank"] for w in engine.last_sync()) == [1, 2]
        grown = peak_rss() - before
        assert grown <= 2 * bucket_bytes + 2**20, f"v{version}: +{grown / 2**20:.2f} MiB"


def test_weights_cannot_change_under_running_requests(engine, model_dir):
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    weights = {n: t.clone() for n, t in policy.named_weights()}
    engine.load_weights(weights, version=0)
    engine.submit("busy", engine.encode("5 ="), N)
    engine.step()  # the group's requests start
    assert engine.running
    with pytest.raises(RuntimeError, match="running"):
        engine.load_weights(weights, version=1)
    while engine.in_flight:
        engine.step()


def test_partial_rollout_resumes_cut_generations_under_the_new_weights(
    engine, model_dir, log_probs_of
):
    """Cut long generations after a few tokens, update the weights, finish them. Tokens
    before the cut carry version 0 and the old policy's log-probs; tokens after it version 1
    and the new policy's, each checked against the trainer's recomputation."""
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    old_policy = Policy(make_cfg(model_dir, 0.7), CPU)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
    prompts = prompts_for(engine)
    for i, prompt in enumerate(prompts):
        engine.submit(i, prompt, N)
    done: dict[int, Generation] = {}
    for _ in range(4):
        done.update(engine.step())
    engine.interrupt()
    engine.load_weights(perturbed(policy, seed=21), version=1)
    while engine.in_flight:
        done.update(engine.step())
    gens = [done[i] for i in range(len(prompts))]

    old_lp, rollout_lp, mask = log_probs_of(old_policy, prompts, gens, engine.pad_id)
    new_lp, _, _ = log_probs_of(policy, prompts, gens, engine.pad_id)
    versions = torch.from_numpy(np.concatenate([g.versions for g in gens]))
    spans = versions.masked_fill(~mask, 0)
    cut = ((spans == 0) & mask).any(dim=1) & (spans == 1).any(dim=1)
    assert cut.sum() >= 3, f"only {int(cut.sum())} responses span the update"
    for row in torch.nonzero(cut).flatten().tolist():
        v = versions[row, mask[row]]
        assert (v[:-1] <= v[1:]).all(), "old-version tokens after new-version ones"
    old_part, new_part = mask & (versions == 0), mask & (versions == 1)
    assert (rollout_lp - old_lp).abs()[old_part].max().item() < TOLERANCE
    assert (rollout_lp - new_lp).abs()[new_part].max().item() < TOLERANCE
    # and the two policies really differ on those tokens, so the check has teeth
    assert (old_lp - new_lp).abs()[new_part].mean().item() > 10 * TOLERANCE
    for gen in gens:
        lengths = gen.response_lengths
        assert gen.versions[np.arange(N), lengths - 1].min() >= gen.versions[:, 0].min()


def test_multi_turn_responses_wait_then_continue_from_their_observations(
    engine, model_dir, log_probs_of
):
    """Multi-turn on vLLM (``rollout/turns.py`` drives both engines alike): a turn ends at a
    turn-end token ("=" here stands for a tool call's end), the response waits (nothing is
    generated for it) until an observation is appended, then vLLM continues from the full
    context: every token sampled after an observation has the trainer's log-prob for that
    context (the observation tokens holes in the mask: log-prob 0, version -1)."""
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
    equals = engine.encode("=")[0]
    observation = engine.encode("4 2 =")
    engine.turn_ends = frozenset({engine.eos_id, equals})
    try:
        prompts = prompts_for(engine)[:2]
        for i, prompt in enumerate(prompts):
            engine.submit(i, prompt, N)
        done: dict[int, Generation] = {}
        held: dict = {}  # response -> its length when it began to wait
        observed = 0
        while engine.in_flight:
            done.update(engine.step())
            for group in engine.groups.values():
                for r in group.responses:
                    if not r.waiting:
                        continue
                    if id(r) not in held:  # wait one step: nothing may be generated for it
                        held[id(r)] = len(r.tokens)
                        continue
                    assert len(r.tokens) == held.pop(id(r)), "generated while waiting"
                    r.observe(observation[: RESPONSE_LENGTH - len(r.tokens)])
                    r.waiting = False
                    r.finished = len(r.tokens) >= RESPONSE_LENGTH
                    observed += 1
    finally:
        engine.turn_ends = frozenset()
    gens = [done[i] for i in range(len(prompts))]
    assert observed >= 3 and all(g.loss_mask is not None for g in gens), observed
    trainer_lp, rollout_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
    holes = torch.from_numpy(np.concatenate([g.loss_mask for g in gens]) == 0)
    versions = torch.from_numpy(np.concatenate([g.versions for g in gens]))
    assert not (mask & holes).any() and (versions[holes] == -1).all()
    after = torch.zeros_like(mask)  # model tokens that follow an observation
    after[:, 1:] = holes.cumsum(dim=1)[:, :-1] > 0
    after &= mask
    assert after.sum() >= 3
    assert (rollout_lp - trainer_lp).abs()[mask].max().item() < TOLERANCE


def test_greedy_groups_beside_sampled_ones_match_the_hf_engines_greedy(engine, model_dir):
    """Validation's greedy groups (temperature 0) run in the same steps as sampled ones;
    all their responses are the one greedy continuation, the hf engine's too."""
    from hpc_asyncppo.rollout.hf_engine import HFEngine

    cfg = make_cfg(model_dir, temperature=0.7)
    policy = Policy(cfg, CPU)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
    prompts = prompts_for(engine)[:2]
    for i, prompt in enumerate(prompts):
        engine.submit(("sampled", i), prompt, N)
        engine.submit(("greedy", i), prompt, N, temperature=0.0)
    done: dict = {}
    while engine.in_flight:
        done.update(engine.step())
    hf = HFEngine(cfg.model, cfg.rollout, CPU)
    expected = hf.generate(prompts, 1, temperature=0.0)
    for i in range(len(prompts)):
        greedy = done[("greedy", i)]
        assert (greedy.response_ids == greedy.response_ids[0]).all()
        assert greedy.response_ids[0].tolist() == expected[i].response_ids[0].tolist()
        assert done[("sampled", i)].response_ids.shape == (N, RESPONSE_LENGTH)


def test_a_calls_top_log_probs_are_the_models_most_likely_tokens_at_each_place(
    engine, model_dir, alternatives_match
):
    """A gateway call's ``top_logprobs`` (``Response.top``) on vLLM: each sampled token's
    rivals are the model's most likely tokens at its place (transformers' fp32, within
    TOLERANCE), at the sampled token's log-prob quantity; rows that did not ask keep none.
    A submitted group starts at the next step, so a response made to wait before it (a
    session that has not called) gets no token until it may run."""
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
    prompt = prompts_for(engine)[0]
    engine.submit("top", prompt, N)
    responses = engine.groups["top"].responses
    for r in responses[:2]:
        r.top = 3
    responses[3].waiting = True  # a session that has not called: nothing runs for it
    while not all(r.finished for r in responses[:3]):
        engine.step()
    assert responses[3].tokens == []
    responses[3].waiting = False
    while engine.in_flight:
        engine.step()
    assert all(r.alternatives == {} for r in responses[2:])
    for r in responses[:2]:
        alternatives_match(model_dir, prompt, r, 0.7, 3, TOLERANCE)


def test_every_rpc_the_rank_calls_is_a_method_of_the_worker():
    """The names the rank calls through ``collective_rpc`` (``rollout/vllm_rpc.py``): vLLM's
    weight-transfer methods on its CPU worker, the project's on its worker extension."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from hpc_asyncppo.rollout import vllm_rpc
    from hpc_asyncppo.rollout.vllm_worker import WorkerExtension

    assert [n for n in vllm_rpc.VLLMS if not callable(getattr(CPUWorker, n, None))] == []
    assert [n for n in vllm_rpc.OURS if not callable(getattr(WorkerExtension, n, None))] == []


def test_a_stopped_engine_process_is_killed_and_fails_the_waiting_step(engine, model_dir):
    """LAST in the module: it ends the module's engine. vLLM's engine core stopped
    (SIGSTOP) while the engine generates: after ``rollout.engine_stall_s`` without a
    decoding step the engine kills it, and the step waiting for its output raises, naming
    the process and the stall (vLLM's own client would wait on forever, and the rank's
    heartbeat goes on: only this names it); every later call raises the same; closing the
    dead engine still returns. A death's own reason: the test below."""
    policy = Policy(make_cfg(model_dir, 0.7), CPU)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=0)
    (core,) = [p for p in engine.engine_processes() if p.name.startswith("EngineCore")]
    prompt = engine.encode("3 1 4 =")
    engine.stall_s = 3.0
    threading.Timer(0.5, os.kill, (core.pid, signal.SIGSTOP)).start()
    deadline = time.monotonic() + 60
    stalled = (
        rf"EngineCore\w* \(pid {core.pid}\) returned no decoding step for "
        r"rollout.engine_stall_s=3 s with \d+ requests running \(stopped, or hung\): killed it"
    )
    with pytest.raises(RuntimeError, match=stalled):
        for i in itertools.count():  # keep it generating until the stop lands
            assert time.monotonic() < deadline, "no error 60 s after the engine core stopped"
            if not engine.in_flight:
                engine.submit(i, prompt, N)
            engine.step()
    core.join(timeout=HANG_S)
    assert core.exitcode == -signal.SIGKILL
    with pytest.raises(RuntimeError, match=stalled):
        engine.interrupt()  # the checkpoint's first call on a stop


def test_a_dead_engine_process_is_named_with_its_signal_or_exit_code():
    from hpc_asyncppo.rollout.vllm_engine import death_reason

    proc = multiprocessing.get_context("spawn").Process(
        target=time.sleep, args=(60,), name="EngineCore_0"
    )
    proc.start()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=HANG_S)
    assert (
        death_reason(proc)
        == f"vLLM's engine process EngineCore_0 (pid {proc.pid}) died (signal SIGKILL)"
    )
    quits = multiprocessing.get_context("spawn").Process(
        target=sys.exit, args=(3,), name="EngineCore_0"
    )
    quits.start()
    quits.join(timeout=HANG_S)
    assert death_reason(quits).endswith("died (exit code 3)")


def test_a_dead_engine_reaped_by_vllms_monitor_is_still_named_with_its_signal():
    """vLLM's monitor thread reads ``exitcode`` of the same process object: its waitpid can
    reap the process just before the rank's join, which then finds no child. The status
    the monitor records a moment later is the one named."""
    from hpc_asyncppo.rollout.vllm_engine import death_reason, reaped_by

    proc = multiprocessing.get_context("spawn").Process(
        target=time.sleep, args=(60,), name="EngineCore_0"
    )
    proc.start()
    os.kill(proc.pid, signal.SIGKILL)
    _, status = os.waitpid(proc.pid, 0)  # the monitor's waitpid, before the rank's join

    def monitor_records() -> None:
        time.sleep(0.5)
        proc._popen.returncode = os.waitstatus_to_exitcode(status)

    threading.Thread(target=monitor_records).start()
    reaped_by(proc, timeout_s=HANG_S)
    assert death_reason(proc).endswith("died (signal SIGKILL)")
