r"""Fixtures shared by every test folder: the tiny model, built once per session (and the
cache that runs copy it from), and the rollout-vs-trainer log-prob comparison every engine
test makes, and the environment every vLLM test runs vLLM in. Also the helpers several test
files share: the repository root, a free local port, a process's peak memory and small
sample groups. Runs are
started, waited for and audited by tests/harness.py; every job a test left running is
ended as it ends.

The suite's rule on time: a test asserts behaviour and invariants, never the machine's
pace (this machine is shared; the same suite has taken 15 and 30 minutes).
- No wall-clock duration is compared with an upper bound other than a hang limit of at
  least 60 s: a deadline ``time.monotonic() + HANG_S``, a wait's ``timeout=``. Lower
  bounds ("not before its timeout") are behaviour. ``tests/test_suite_rules.py`` checks
  every test file; to look by hand: ``grep -rnE "(monotonic|time)\(\) *[-+]" tests``.
- Learning is judged where timing does not move it: a rise over the run's own first
  steps (e.g. the last 20 steps at 4x the first 20), a sync-mode run, or a margin
  measured over seeds and written next to the bar; never where a run is at a fixed step.
- Timing bookkeeping (idle ratios, goodput, heartbeats) is checked exactly on an injected
  clock in unit tests; real runs assert only invariants (ratios in [0, 1], counters that
  only grow, spans in order).
- A fault is injected at a named moment (a step, a log line, a file), not raced against.
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest
import torch

# as a rank does (rank.py): the openai client's types built at import, not raced on by
# the agent threads of the tests that serve a gateway in this process
os.environ.setdefault("DEFER_PYDANTIC_BUILD", "false")
import torch.distributed as dist

from hpc_asyncppo.config import DataConfig, TinyModelConfig
from hpc_asyncppo.models.tiny import CACHE_VARIABLE, build_tiny_model
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.trainer.batch import collate, to_tensors
from hpc_asyncppo.trainer.policy import Policy
from hpc_asyncppo.transport.samples import SampleGroup
from tests.harness import end_leftover_runs


def vllm_environment(root: Path, cache: Path) -> dict[str, str]:
    """The environment a vLLM test sets: offline, no torch.compile (20 s for vLLM's log-prob
    helper), a 1 GiB KV cache, its temp files in a new folder of /tmp (vLLM's IPC sockets
    live in TMPDIR, and a socket's path has at most 107 characters: pytest's tmp_path under
    a pytest-xdist worker is already 80), inductor's cache under ``root`` and vLLM's in
    ``cache`` (the ``vllm_cache`` fixture's, shared by the suite's engines: there vLLM keeps
    what it learned of a model class in a subprocess, about 10 s of CPU per cold start)."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "VLLM_CACHE_ROOT": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TMPDIR": tempfile.mkdtemp(prefix="vllm-", dir="/tmp"),
    }


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM's cache folder (VLLM_CACHE_ROOT) for the whole pytest run, both workers'
    engines included: its files are written atomically and checked against the source they
    describe, as in a user's ~/.cache/vllm."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "vllm_cache"


# Qwen2.5-7B-Instruct's config.json, the sizes that decide memory (no weights needed)
QWEN2_5_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064,
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}


def reset_peak_rss() -> int:
    """Start this process's peak resident memory afresh (the kernel's VmHWM, reset through
    /proc/self/clear_refs); returns the resident bytes now. The kernel then keeps the exact
    peak, which no sampling thread would catch for sure."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """This process's peak resident bytes since ``reset_peak_rss``."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    line = next(
        x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field)
    )
    return int(line.split()[1])


def free_port() -> int:
    """A loopback port free now, for a process started later to bind (a spawned rank's
    store, seconds away behind its imports). Drawn below the kernel's ephemeral range: a
    port picked by binding port 0 is an ephemeral one, which any connection made meanwhile
    (the other test worker's runs make many) can be given first, and the rank then fails
    with EADDRINUSE (seen in a full suite run)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    draw = random.Random()  # not the tests' seeded generators
    for _ in range(200):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low} in 200 draws")


def end_spawned_rank(*queues: object) -> NoReturn:
    """End a spawned test rank once its work is done and its results are out.

    Leaves through ``os._exit``: in the interpreter's teardown a gloo worker thread can
    still be freeing a finished collective's tensors; it then needs the GIL that the
    teardown holds and the process aborts (SIGABRT, "terminate called without an active
    exception"; a CI run lost a passing test to it). A ``multiprocessing.Queue`` is
    flushed first (a ``SimpleQueue`` writes at once).
    """
    dist.destroy_process_group()
    for queue in queues:
        if hasattr(queue, "join_thread"):
            queue.close()
            queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


CPU_LOG_VARIABLE = "HPC_ASYNCPPO_TEST_CPU"


def cpu_seconds() -> float:
    """CPU time of this process and of every child it has waited for (theirs too, down the
    tree: a run's launcher, mpirun, its ranks), user and system."""
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``HPC_ASYNCPPO_TEST_CPU=FILE``: each test's CPU seconds (setup, call and
    teardown; its runs' processes included, the Slurm cluster's not) and wall seconds, a
    JSON line each, appended to FILE. On two cores the suite's time is bound by its CPU
    (BENCHMARKS.md "The test suite's time"): this says where it goes."""
    path = os.environ.get(CPU_LOG_VARIABLE)
    cpu, wall = cpu_seconds(), time.monotonic()
    yield
    if path:
        row = {"test": item.nodeid, "cpu_s": round(cpu_seconds() - cpu, 2),
               "wall_s": round(time.monotonic() - wall, 2)}  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session", autouse=True)
def single_process_group() -> None:
    """A one-rank gloo world: the sharded Policy (FSDP2) needs a process group even alone."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )


@pytest.fixture(autouse=True)
def no_job_left_running() -> Iterator[None]:
    """A test that fails while its run goes on leaves no launcher, mpirun or rank behind."""
    yield
    end_leftover_runs()


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The runs the tests make (and the processes they start) take the tiny model from a
    cache of this session's, not the user's: no test depends on what an earlier one left."""
    os.environ[CACHE_VARIABLE] = str(tmp_path_factory.mktemp("tiny_model_cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default task's tiny Llama and tokenizer, saved in HF format."""
    out = tmp_path_factory.mktemp("tiny_model")
    return build_tiny_model(out, load_task(DataConfig()).vocabulary(), TinyModelConfig(), seed=3)


def trainer_log_probs(
    policy: Policy, prompts: list[list[int]], gens: list, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of an engine's generations, as a training batch computes them:
    (trainer log-probs, rollout log-probs, response mask), each (B, L), on the policy's device."""
    groups = [
        SampleGroup(
            seed=0,
            epoch=0,
            prompt_index=i,
            rollout_rank=0,
            param_version_start=0,
            param_version_end=0,
            prompt_ids=np.asarray(p, dtype=np.int32),
            response_ids=g.response_ids,
            response_lengths=g.response_lengths,
            rollout_log_probs=g.log_probs,
            rewards=np.zeros(g.response_ids.shape[0], np.float32),
            loss_mask=g.loss_mask,  # multi-turn: observation tokens are holes in the mask
        )  # fmt: skip
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    advantages = np.zeros((len(groups), groups[0].n), dtype=np.float32)
    batch = to_tensors(collate(groups, advantages, pad_id), policy.device)
    with torch.no_grad():
        lp, _, _ = policy.forward(batch)
    return lp, batch["rollout_log_probs"], batch["response_mask"].bool()


def check_alternatives(model_dir: Path, prompt: list[int], response: Any, temperature: float,
                       top: int, tolerance: float) -> None:  # fmt: skip
    """An engine's ``top`` most likely tokens at each place of ``response`` (a gateway
    call's ``top_logprobs``: ``Response.alternatives``) are the model's: transformers' fp32
    log_softmax(logits / temperature) after ``prompt`` and the tokens before, its ``top``
    largest values, and each rival's own log-prob, within ``tolerance``; the sampled
    token's, where it is among them, is its log-prob exactly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = response.tokens
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    every = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    values = torch.topk(every, top, dim=-1).values
    assert sorted(response.alternatives) == list(range(len(tokens)))
    for i, rivals in response.alternatives.items():
        ids, lps = [t for t, _ in rivals], torch.tensor([x for _, x in rivals])
        assert (lps - values[i]).abs().max() < tolerance
        assert (lps - every[i, ids]).abs().max() < tolerance
        if tokens[i] in ids:
            assert abs(lps[ids.index(tokens[i])] - response.log_probs[i]) < 1e-6


@pytest.fixture(scope="session")
def alternatives_match() -> Callable[..., None]:
    """``check_alternatives`` above, for test modules."""
    return check_alternatives


@pytest.fixture(scope="session")
def log_probs_of() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``trainer_log_probs`` above, for test modules (which cannot import each other)."""
    return trainer_log_probs


def xdist_group(item: pytest.Item) -> str | None:
    """The worker group of a test under pytest-xdist: the Slurm tests share one cluster, the
    vLLM tests (an engine of a few GB each) run one at a time, the tests that run the
    sandbox one at a time (each checks that no sandbox process outlives its call, and
    would see another test's), a module with module fixtures (a trained run, an engine)
    runs whole on one worker so they are built once; any other test goes wherever a worker
    is free (None)."""
    if item.get_closest_marker("slurm"):
        return "slurm"
    if "vllm" in item.module.__name__:
        return "vllm"
    if item.module.__name__.startswith("tests.tools."):
        return "sandbox"
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is not None and any(
        d.scope in ("module", "class") for defs in fixtures.name2fixturedefs.values() for d in defs
    ):
        return item.module.__name__
    return None


# The two longest groups (about 8 minutes each on two cores), started first, one per worker,
# while the short tests fill in around them
LONG_GROUPS = ("vllm", "slurm")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``scripts/test.sh`` runs two pytest-xdist workers with ``--dist loadgroup``: the runs
    leave a core idle while ranks start, wait on timeouts or poll Slurm."""
    groups = {}
    for item in items:
        groups[item.nodeid] = group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    order = {name: i for i, name in enumerate(LONG_GROUPS)}
    items.sort(key=lambda item: order.get(groups[item.nodeid], len(order)))


def make_group(n=3, length=5, prompt=4) -> SampleGroup:
    """A group of n responses of random tokens (always the same), one sequence each."""
    rng = np.random.default_rng(0)
    return SampleGroup(
        seed=7,
        epoch=2,
        prompt_index=1234,
        rollout_rank=1,
        param_version_start=5,
        param_version_end=6,
        prompt_ids=rng.integers(0, 100, prompt).astype(np.int32),
        response_ids=rng.integers(0, 100, (n, length)).astype(np.int32),
        response_lengths=np.array([5, 2, 1][:n], dtype=np.int32),
        rollout_log_probs=rng.normal(size=(n, length)).astype(np.float32),
        rewards=np.array([0.0, 0.25, 1.0][:n], dtype=np.float32),
        rollout_idle_s=1.5,
        rollout_elapsed_s=10.25,
    )


def branched_group() -> SampleGroup:
    """make_group's 3 responses, where session 0 went on in two more sequences (rows 3, 4:
    their own prompts of 2 and 6 tokens) and session 2 in one (row 5)."""
    import dataclasses

    group = make_group(n=3)
    rng = np.random.default_rng(1)
    prompts = np.full((6, 6), -1, dtype=np.int32)
    for row, size in enumerate([4, 4, 4, 2, 6, 3]):
        prompts[row, :size] = group.prompt_ids if row < 3 else rng.integers(0, 100, size)
    return dataclasses.replace(
        group,
        response_ids=rng.integers(0, 100, (6, 5)).astype(np.int32),
        response_lengths=np.array([5, 2, 1, 3, 4, 5], dtype=np.int32),
        rollout_log_probs=rng.normal(size=(6, 5)).astype(np.float32),
        row_sessions=np.array([0, 1, 2, 0, 0, 2], dtype=np.int32),
        row_prompts=prompts,
    )
