"""Rollout engine on vLLM: continuous batching, sampled-token log-probs, in-place weight
updates, and interruption for partial rollout.

vLLM's engine core and worker run in a child process (``LLMEngine`` in multiprocess
mode): the rollout rank's own process already belongs to the job's torch.distributed
world, which vLLM's in-process worker would try to reuse as its own. The rollout rank
drives the engine step by step (``submit`` prompt groups, ``step`` until they finish), so
its loop can read control messages between two decoding steps.

Log-probs: ``logprobs_mode="processed_logprobs"`` returns log_softmax(logits / temperature)
of each sampled token, over the full vocabulary when top_k and top_p are off: the same
quantity the trainer recomputes. (vLLM's default, ``raw_logprobs``, ignores the
temperature.) With top_k or top_p on, vLLM reports the log-prob under the truncated
distribution it sampled from, which the transformers engine and the trainer do not.

Weights: the engine's workers are members of the weight group (``vllm_worker.py``,
``transport/weight_group.py``): ``join_weights`` has each of them join it, and
``update_weights`` pauses generation between two steps while the trainer leader's
broadcast streams into them (``start_weight_update``, ``update_weights``,
``finish_weight_update`` through ``collective_rpc``; the workers check the version and
load through vLLM's loader). This process holds no copy of the weights: the same code on
GPUs (NCCL) and CPUs (gloo). With prefix caching on (``rollout.enable_prefix_caching``)
the cache is reset after every update, and a reset vLLM refuses is an error: cached KV
blocks hold keys and values of the old weights. A standalone engine (tests, benchmarks,
``scripts/gpu_check.py``) takes weights from its own process through ``load_weights``:
the same worker code, with this process as the group's sender.

Capacity (``rollout.*``, verl's names): ``max_num_seqs`` and ``max_num_batched_tokens``
per engine step (0: vLLM's defaults; chunked prefill stays on, so the token budget may be
below the longest sequence), ``enable_prefix_caching``, ``enforce_eager`` (no CUDA graphs).

Faults: a watch thread fails the waiting call when vLLM's engine process dies (vLLM's own
client would wait on), and kills it when a call on it (a decoding step, a weight update)
has not returned for ``rollout.engine_stall_s`` (the process stopped or hung: the rank's
heartbeat goes on, so only this names it; joining the weight group is not watched, as it
waits for other ranks' engines). A weight update waits on the broadcast, so on the leader
and every member: a member that stops or dies mid-broadcast stalls it for the others
too, and they restart their engines as well, after ``engine_stall_s``. Every call on the engine then raises ``EngineDied`` with the reason;
the groups in flight keep their tokens so far in this process (``unfinished``), and the
rollout rank restarts the engine in place and continues them (``rollouter.py``,
``rollout.max_engine_restarts``).

Partial rollout: ``interrupt()`` aborts every running request and keeps its tokens and
log-probs; the next ``step()`` after the weight update resubmits each one with its
partial response appended to the prompt, so the rest is sampled under the new weights
(its prefix recomputed with them). ``Generation.versions`` records, per token, the
weights version that sampled it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from transformers import AutoTokenizer

from hpc_asyncppo.config import ModelConfig, RolloutConfig
from hpc_asyncppo.rollout import vllm_rpc
from hpc_asyncppo.rollout.engine import EngineDied
from hpc_asyncppo.rollout.generation import Generation, PartialGroup, Response, ResponseGroup
from hpc_asyncppo.runtime.signals import children_ignore_stop_signals
from hpc_asyncppo.transport.weight_group import WeightGroupSpec, open_weight_group
from hpc_asyncppo.transport.weights import WeightBroadcaster, WeightUpdate

log = logging.getLogger(__name__)

WORKER_EXTENSION = "hpc_asyncppo.rollout.vllm_worker.WorkerExtension"


def set_vllm_environment(
    device: torch.device, cpu_kv_cache_gb: float, tensor_parallel_size: int = 1
) -> None:
    """Environment vLLM reads at engine start; values already set by the user win."""
    # The worker must live in a child process (see the module docstring), and a forked
    # child would inherit the MPI library's state and threads mid-flight: spawn it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cpu_kv_cache_gb:g}")
        if tensor_parallel_size > 1:
            # vLLM's CPU workers each bind to a NUMA node of their own and refuse to start
            # with fewer nodes than workers (one on most machines): let the OS place them
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def engine_kwargs(
    model: ModelConfig,
    rollout: RolloutConfig,
    device: torch.device,
    max_prompt_length: int,
    seed: int = 0,
) -> dict:
    """vLLM ``EngineArgs`` from the config (without the weight-transfer ones); a 0 capacity
    knob is left out, so vLLM picks its default for the device."""
    kwargs = dict(
        model=model.path,
        dtype=model.dtype,
        seed=seed,
        # a resumed response is prompt + partial response: at most this long
        max_model_len=max_prompt_length + rollout.response_length,
        enforce_eager=rollout.enforce_eager or device.type != "cuda",
        tensor_parallel_size=rollout.tensor_parallel_size,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enable_prefix_caching=rollout.enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
    )
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(rollout, key):
            kwargs[key] = getattr(rollout, key)
    return kwargs


def reaped_by(proc, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for a dead engine process's exit status. vLLM's own monitor
    thread may reap it: between its ``waitpid`` and its recording the status on the same
    process object, a ``join`` here finds no child and leaves ``exitcode`` None. Seen under
    load: a SIGKILLed engine named as "exit code unknown"."""
    deadline = time.monotonic() + timeout_s
    proc.join(timeout=timeout_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)


def death_reason(proc) -> str:
    """Why a ``multiprocessing`` process of the engine ended, for the rank's error."""
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"signal {signal.Signals(-code).name}"
    else:
        how = "exit code unknown" if code is None else f"exit code {code}"
    return f"vLLM's engine process {proc.name} (pid {proc.pid}) died ({how})"


class VLLMEngine:
    def __init__(
        self,
        model: ModelConfig,
        rollout: RolloutConfig,
        device: torch.device,
        max_prompt_length: int,
        seed: int = 0,
        weight_sync_s: float = 300.0,
    ):
        set_vllm_environment(device, rollout.cpu_kv_cache_gb, rollout.tensor_parallel_size)
        from vllm import EngineArgs, SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.llm_engine import LLMEngine

        from hpc_asyncppo.rollout.vllm_worker import BACKEND, RANK_PID_ENV

        self.cfg, self.device = rollout, device
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        kwargs = engine_kwargs(model, rollout, device, max_prompt_length, seed)
        args = EngineArgs(
            **kwargs,
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config={"backend": BACKEND},
        )
        # vLLM's processes must outlive a stop signal sent to every process of the job (Slurm
        # does): they inherit "ignore" for it while they start, and our vLLM plugin
        # (vllm_worker.ignore_stop_signals) replaces vLLM's own SIGTERM handlers once they
        # are installed; this rank shuts them down itself (close), after its checkpoint.
        os.environ[RANK_PID_ENV] = str(os.getpid())
        with children_ignore_stop_signals():
            self.llm = LLMEngine.from_engine_args(args)
        self._sampling_args = dict(
            n=1,  # each response is its own request: partial rollout resumes them one by one
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k if rollout.top_k > 0 else -1,
            max_tokens=rollout.response_length,
            logprobs=0,  # the sampled token's only
            stop_token_ids=[] if rollout.ignore_eos else [self.eos_id],
            ignore_eos=rollout.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        self.sampling = SamplingParams(**self._sampling_args)
        self.version = -1
        self.should_stop = None  # unused: a step is one decoding step, the loop checks between
        self._turn_ends: frozenset[int] = frozenset()  # multi-turn: see ``turn_ends``
        self.groups: dict[Hashable, ResponseGroup] = {}
        self.running: dict[str, tuple[Hashable, int]] = {}  # request id -> (group key, response)
        self._ids = itertools.count()
        self.weight_sync_s = weight_sync_s
        self.joined = False  # the workers are members of a weight group
        self._sender: WeightBroadcaster | None = None  # standalone: this process sends
        self.standalone_bucket_mb = 64.0  # standalone: the sender's bucket size
        self.died: str | None = None  # why vLLM's engine process ended under us, if it did
        self.stall_s = rollout.engine_stall_s  # a step waiting this long: the engine is stuck
        # the call on the engine now waiting: since when, and what it is (for the stall)
        self._waiting: tuple[float, str] | None = None
        self._watched = threading.Event()  # set once ``died`` says why
        self._closing = False
        threading.Thread(target=self._watch, daemon=True, name="vllm-engine-watch").start()

    # --- tokens -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def _decode_list(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- generation ---------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Prompt groups submitted and not yet returned by ``step``."""
        return len(self.groups)

    def submit(
        self, key: Hashable, prompt: list[int], n: int, temperature: float | None = None
    ) -> None:
        """n responses to ``prompt`` at ``temperature`` (None: rollout.temperature; 0:
        greedy), started by the next ``step`` (until then a caller may make some wait, or
        set a turn's limits: the gateway's sessions that have not called yet); ``step``
        returns them under ``key``."""
        if key in self.groups:
            raise ValueError(f"a prompt group with key {key!r} is already in flight")
        self.groups[key] = ResponseGroup(list(prompt), [Response() for _ in range(n)], temperature)

    def resume(self, key: Hashable, partial: PartialGroup) -> None:
        """Continue a group cut earlier (e.g. by a checkpoint before a stop) from its tokens:
        its unfinished responses start at the next ``step``, their tokens so far appended
        to the prompt."""
        if key in self.groups:
            raise ValueError(f"a prompt group with key {key!r} is already in flight")
        self.groups[key] = ResponseGroup.of(partial, self.turn_ends)

    def unfinished(self) -> list[tuple[Hashable, PartialGroup]]:
        """Every group in flight with its tokens so far (after ``interrupt``: a checkpoint)."""
        width, pad = self.cfg.response_length, self.pad_id
        return [(key, group.partial(width, pad)) for key, group in self.groups.items()]

    def step(self) -> list[tuple[Hashable, Generation]]:
        """One decoding step of every running request (starting first the responses that
        may run and do not: interrupted ones, and multi-turn ones whose observation came);
        returns the groups whose n responses are all finished."""
        for key, group in self.groups.items():
            for j, response in enumerate(group.responses):
                if response.runnable and response.request_id is None:
                    self._start(key, j)
        outputs = self._engine_call(self.llm.step) if self.running else []
        done: list[Hashable] = []
        for out in outputs:
            if out.request_id not in self.running:
                continue  # a straggler output of an aborted request
            key, j = self.running[out.request_id]
            response = self.groups[key].responses[j]
            completion = out.outputs[0]
            if response.top:
                for i, lp in enumerate(completion.logprobs):
                    best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[: response.top]
                    response.alternatives[len(response.tokens) + i] = [
                        (tok, x.logprob) for tok, x in best
                    ]
            response.tokens += completion.token_ids
            response.log_probs += [
                lp[tok].logprob
                for tok, lp in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
            response.versions += [self.version] * len(completion.token_ids)
            finished = out.finished
            if response.stop_texts and response.stop_at_text(self._decode_list):
                if not finished:  # a gateway call's stop string ended the turn
                    self._engine_call(self.llm.abort_request, [out.request_id])
                finished = True
            if finished:
                response.request_id = None
                del self.running[out.request_id]
                response.end_turn(self.cfg.response_length, bool(self.turn_ends))
                if self.groups[key].complete and key not in done:
                    done.append(key)  # in the order vLLM finished them, as before multi-turn
        # and those the rank completed (a multi-turn response it ended between two steps)
        done += [key for key, group in self.groups.items() if group.complete and key not in done]
        return [(key, self._generation(self.groups.pop(key))) for key in done]

    @property
    def turn_ends(self) -> frozenset[int]:
        """Multi-turn (rollout/turns.py): the tokens that end the model's turn (EOS and the
        end of a tool call); empty: single-turn. vLLM stops a request at any of them."""
        return self._turn_ends

    @turn_ends.setter
    def turn_ends(self, tokens: frozenset[int]) -> None:
        from vllm import SamplingParams

        self._turn_ends = frozenset(tokens)
        eos = [] if self.cfg.ignore_eos else [self.eos_id]
        stops = sorted(set(eos) | self._turn_ends)
        self.sampling = SamplingParams(**{**self._sampling_args, "stop_token_ids": stops})

    def interrupt(self) -> None:
        """Abort every running request; each keeps its tokens and resumes at the next step."""
        if not self.running:
            return
        self._engine_call(self.llm.abort_request, list(self.running))
        for key, j in self.running.values():
            self.groups[key].responses[j].request_id = None
        self.running.clear()

    def generate(self, prompts: list[list[int]], n: int) -> list[Generation]:
        """Sample n responses for every prompt (token ids), to completion."""
        keys = [("generate", next(self._ids)) for _ in prompts]
        for key, prompt in zip(keys, prompts, strict=True):
            self.submit(key, prompt, n)
        results: dict[Hashable, Generation] = {}
        while len(results) < len(keys):
            results.update(self.step())
        return [results[key] for key in keys]

    def _start(self, key: Hashable, j: int) -> None:
        from vllm.inputs import TokensPrompt

        group = self.groups[key]
        response = group.responses[j]
        params = self.sampling.clone()
        width = self.cfg.response_length
        params.max_tokens = min(width, response.limit or width) - len(response.tokens)
        if response.stop_ids is not None:  # a gateway call's own (parallel tool calls)
            params.stop_token_ids = sorted(response.stop_ids)
        if response.top:  # a gateway call's top_logprobs: the sampled token's and its rivals'
            params.logprobs = response.top
        if group.temperature is not None:
            params.temperature = group.temperature
        request_id = f"r{next(self._ids)}"
        self._engine_call(
            self.llm.add_request,
            request_id,
            TokensPrompt(prompt_token_ids=group.context(response)),
            params,
        )
        response.request_id = request_id
        self.running[request_id] = (key, j)

    def _generation(self, group: ResponseGroup) -> Generation:
        return group.generation(self.cfg.response_length, self.pad_id)

    # --- weights ------------------------------------------------------------------------
    stages_weights = False  # the workers receive a sync themselves, with generation paused

    def join_weights(self, spec: WeightGroupSpec, first_rank: int) -> None:
        """Every worker joins the weight group (TP worker w as ``first_rank + w``); blocks
        until the whole group has met (bounded by ``spec.timeout_s``)."""
        info = {**spec.as_dict(), "rank_offset": first_rank}
        # not watched for a stall: it waits for every member, other ranks' new engines too
        self._engine_call(self._rpc, vllm_rpc.JOIN, info, watched=False)
        self.joined = True

    def update_weights(self, expected: int, digest: bool = False) -> WeightUpdate:
        """Generation pauses while the next sync streams into the workers, announced as
        version ``expected``; then cached KV blocks are dropped. No request may be running
        (``interrupt`` or finish them first): their KV would mix two weight versions."""
        self._check_idle()
        start = time.monotonic()
        self._engine_call(self._rpc, vllm_rpc.START_UPDATE)
        self._engine_call(self._rpc, vllm_rpc.UPDATE, {"version": expected, "digest": digest})
        self._engine_call(self._rpc, vllm_rpc.FINISH_UPDATE)
        if self.cfg.enable_prefix_caching:
            self._reset_prefix_cache()
        digests = [w["digest"] for w in self.last_sync()]
        self.version = expected
        return WeightUpdate(expected, digests, time.monotonic() - start)

    def _check_idle(self) -> None:
        if self.running:
            raise RuntimeError(
                "load_weights with requests running: interrupt() or finish them first"
            )

    def last_sync(self) -> list[dict]:
        """Each worker's account of the last sync (``WorkerExtension.hpc_asyncppo_last_sync``)."""
        return self._engine_call(self._rpc, vllm_rpc.LAST_SYNC)

    def _rpc(self, method: str, *args):
        """``method`` (a ``vllm_rpc`` name) in every worker, their answers in order."""
        return self.llm.collective_rpc(method, timeout=self.weight_sync_s, args=args)

    def _reset_prefix_cache(self) -> None:
        """vLLM resets nothing while a KV block is still referenced (an aborted request's,
        until the scheduler has freed it): step the engine and try again, then give up."""
        for _ in range(10):
            if self._engine_call(self.llm.reset_prefix_cache):
                return
            self._engine_call(self.llm.step)
        raise RuntimeError(
            "vLLM kept cached KV blocks of the old weights after a weight update "
            "(reset_prefix_cache refused 10 times)"
        )

    @torch.no_grad()
    def load_weights(
        self, tensors: dict[str, torch.Tensor], version: int, digest: bool = False
    ) -> WeightUpdate:
        """Standalone engine: send ``tensors`` from this process into the workers, through
        the same worker code as a job's sync (a private gloo group: this process is its
        rank 0). Not for an engine that joined a job's weight group. Memory here: the
        sender's two bucket buffers (``standalone_bucket_mb``), nothing per worker."""
        if self.joined and self._sender is None:
            raise RuntimeError("this engine takes its weights from the job's weight group")
        self._check_idle()  # before anything goes on the wire
        if self._sender is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            workers = self.cfg.tensor_parallel_size
            spec = WeightGroupSpec("127.0.0.1", port, 1 + workers, "gloo", self.weight_sync_s)
            with ThreadPoolExecutor(max_workers=1) as pool:  # both sides block to meet
                joined = pool.submit(self.join_weights, spec, 1)
                group = open_weight_group(spec, 0)
                joined.result()
            bucket_mb = self.standalone_bucket_mb
            self._sender = WeightBroadcaster(group, 0, bucket_mb, torch.device("cpu"))
        named = [(n, t.detach().cpu()) for n, t in tensors.items()]
        sending = self._sender.broadcast_in_background(version, named)
        update = self.update_weights(version, digest)
        sending.result(self.weight_sync_s)
        return update

    def _watch(self) -> None:
        """Wake this rank if vLLM's engine core dies. vLLM's client notices (it marks the
        engine dead and shuts itself down) but a call already waiting for the engine's
        output or for a utility result waits on, without a timeout: the rank would hang.
        The watch fails those waits, so the call raises and the rank ends the job with
        the reason (``died``)."""
        procs = self.engine_processes()
        if not procs:
            return
        by_sentinel = {p.sentinel: p for p in procs}
        while not (ready := multiprocessing.connection.wait(list(by_sentinel), timeout=1.0)):
            if self._closing:
                return
            self._kill_if_stalled(procs)
        if self._closing:
            return
        gone = by_sentinel[ready[0]]
        reaped_by(gone, timeout_s=5.0)
        if self.died is None:  # else: killed for a stall, which ``died`` already says
            self.died = death_reason(gone)
        self._watched.set()
        client = self.llm.engine_core
        error = RuntimeError(self.died)
        for future in list(getattr(client, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(error)
        queue = getattr(client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(error)

    def _kill_if_stalled(self, procs: list) -> None:
        """A call on the engine (a decoding step, a weight update) waiting longer than
        ``rollout.engine_stall_s`` (the engine process stopped, or hung in a kernel or a
        collective): kill the engine core, whose death then fails the waiting call as any
        death does, with this reason."""
        waiting = self._waiting
        if self.stall_s <= 0 or waiting is None or time.monotonic() - waiting[0] <= self.stall_s:
            return
        core = next((p for p in procs if p.name.startswith("EngineCore")), procs[0])
        self.died = (
            f"vLLM's engine process {core.name} (pid {core.pid}) {waiting[1]} for "
            f"rollout.engine_stall_s={self.stall_s:g} s with {len(self.running)} requests "
            "running (stopped, or hung): killed it"
        )
        log.error("%s", self.died)
        with contextlib.suppress(ProcessLookupError):
            os.kill(core.pid, signal.SIGKILL)  # a stopped process too

    def _engine_call(self, call, *args, watched: bool = True):
        """``call(*args)`` on vLLM's engine; its death is raised as ``died`` says it.
        ``watched``: the engine is killed if the call waits past ``engine_stall_s``."""
        if self.died:
            raise EngineDied(self.died)
        if call == self.llm.step:
            what = "returned no decoding step"
        elif call == self._rpc and args[0] == vllm_rpc.UPDATE:
            # a broadcast waits on the leader and every member: one stopped or dead member
            # stalls it for all, and each waiting rank restarts its engine
            what = "received no whole weight update (its broadcast stalled: a member stopped?)"
        else:
            what = f"did not answer {args[0] if call == self._rpc else call.__name__}"
        self._waiting = (time.monotonic(), what) if watched else None
        try:
            return call(*args)
        except Exception:
            # vLLM's client may fail a call on the dead engine before the watch has its
            # exit status: wait for it (it reaps the process within seconds)
            if not self.died and any(not p.is_alive() for p in self.engine_processes()):
                self._watched.wait(timeout=10)
            if self.died:
                raise EngineDied(self.died) from None
            raise
        finally:
            self._waiting = None

    def engine_processes(self) -> list:
        """vLLM's engine-core processes (``multiprocessing`` handles) this engine started."""
        manager = self.llm.engine_core.resources.engine_manager
        return list(getattr(manager, "processes", []))

    def close(self) -> None:
        """Shut vLLM down. Its engine core ignores SIGTERM (the stop signals are the rank's),
        which vLLM's shutdown sends: SIGINT asks it to stop the same way first, and its
        workers follow it out (they watch the engine core's pipe)."""
        self._closing = True
        for proc in self.engine_processes():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)
        self.llm.engine_core.shutdown()
