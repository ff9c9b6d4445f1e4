"""The trained policy of one trainer rank and one PPO update on its rows of the batch.

``Policy`` holds the sharded model (``model.py``), its optimizer, the LR schedule and the
frozen reference; ``ppo_update`` runs one trainer step. Collective over the trainer ranks.

What a trainer rank holds, for N parameters:
- its 1/T of the master weights (fp32), of their gradients (fp32) and of AdamW's two
  moments (fp32): 16 N / T bytes, ``Policy.state_bytes()``;
- during a forward or backward, the full weights of one decoder layer in ``model.dtype``
  (the next one prefetched) and of the root unit; the activations of one micro-batch (with
  ``actor.gradient_checkpointing``, each layer's input only); and the full-vocabulary logits
  of ``actor.log_prob_chunk_tokens`` tokens in fp32, recomputed chunk by chunk in the
  backward;
- with ``actor.use_kl_loss``, a frozen reference model sharded the same way in
  ``model.dtype`` (2 N / T bytes for bf16), without gradients or optimizer state;
- during the optimizer's step, AdamW's temporaries (``actor.optimizer_impl``): with
  foreach (torch's choice on GPUs) one fp32 copy of the rank's shard (4 N / T), with a
  loop one tensor's, fused none.

With LoRA (``actor.lora_rank`` > 0, ``models/lora.py``) the N base parameters are frozen
in ``model.dtype`` (2 N / T bytes for bf16, no gradients, no optimizer state, no
reference copy: the reference is the base with the adapters off), and only the M adapter
parameters have fp32 masters, gradients and AdamW moments (16 M / T). Syncs and
checkpoints carry the adapters only; a checkpoint names its base (``lora_base``).

Mixed precision: forward and backward run in ``model.dtype``; gradients are reduce-scattered
in fp32 and summed: the loss of each micro-batch is already its share of the mini-batch's
loss over every rank (``algos.agg_loss_share``), so an update does not depend on how rows
are split over ranks and micro-batches.

Weights leave the trainer one tensor at a time (``named_weights``: every trainer rank takes
part in gathering each tensor, the leader sends it, and it is freed); a checkpoint takes
each rank's own shards (``state_dict``, the ``policy`` state of ``checkpoint/state.py``)
and a restore reads back each rank's rows (``load_state_dict``).

Why one long file: the update's passes (old log-probs, losses, backward, the collectives
that keep it split-invariant) share the sharded model's state and are read as one step.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterator
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hpc_asyncppo.checkpoint.state import RngState, ShardedStateful, Stateful
from hpc_asyncppo.checkpoint.store import CheckpointError, StateReader
from hpc_asyncppo.config import Config
from hpc_asyncppo.models import lora as lora_lib
from hpc_asyncppo.models.dtypes import DTYPES
from hpc_asyncppo.runtime.signals import stop_requested
from hpc_asyncppo.trainer import advantages, algos
from hpc_asyncppo.trainer.batch import plan_micro_batches, row_tokens, split_to_count, trim
from hpc_asyncppo.trainer.model import (
    PolicyModule,
    build_sharded,
    gather_full,
    shard_rows_of,
)
from hpc_asyncppo.trainer.schedule import LRSchedule


class Policy:
    """The sharded policy of one trainer rank: model, optimizer, LR schedule, reference."""

    def __init__(self, cfg: Config, device: torch.device, group: dist.ProcessGroup | None = None):
        self.cfg, self.device = cfg, device
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        mesh = DeviceMesh.from_group(self.group, device.type)
        dtype = DTYPES[cfg.model.dtype]
        self.compute_dtype = dtype
        compute = None if dtype == torch.float32 else dtype
        self.module = build_sharded(
            cfg, mesh, device, torch.float32, compute, cfg.algorithm.adv_estimator == "gae"
        )
        self.module.train()
        self.model = self.module.lm
        self.value_head = self.module.value_head
        self.lora = cfg.actor.lora_rank > 0
        self.reference: PolicyModule | None = None
        if cfg.actor.use_kl_loss and not self.lora:  # the initial weights, frozen
            self.reference = build_sharded(cfg, mesh, device, dtype, None, False).eval()
            self.reference.requires_grad_(False)
        # what the optimizer steps (and a checkpoint's optimizer state indexes): every
        # parameter, or with LoRA the adapters (and value head)
        self.trained = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trained, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay,
            **OPTIMIZER_IMPL[cfg.actor.optimizer_impl],
        )  # fmt: skip
        total_updates = (
            cfg.trainer.total_steps * cfg.actor.ppo_epochs * cfg.async_training.require_batches
        )
        self.schedule = LRSchedule(self.optimizer, cfg.actor, total_updates)
        self.phase_seconds: dict[str, float] = {}  # the last update's by phase (``PhaseClock``)

    # --- running the model ----------------------------------------------------------------
    def forward(
        self,
        batch: dict[str, torch.Tensor],
        with_entropy: bool = False,
        with_values: bool = False,
        reference: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(log-probs, entropy or None, values or None), each (B, L); see PolicyModule.
        ``reference``: the frozen reference model's (with LoRA: the base's, adapters off)."""
        module = self.reference if reference and not self.lora else self.module
        off = lora_lib.adapters_disabled(self.model) if reference and self.lora else nullcontext()
        with off:
            return module(
                batch,
                self.cfg.rollout.temperature,
                self.cfg.actor.log_prob_chunk_tokens,
                with_entropy=with_entropy,
                with_values=with_values,
                packed=self.cfg.model.use_remove_padding,
            )

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or (self.lora and self.cfg.actor.use_kl_loss)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Sum (or ``op``) ``tensor`` over the trainer ranks (in place; float64 on the CPU
        travels as is)."""
        if self.world > 1:
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=op, group=self.group)
            tensor.copy_(on_device)
        return tensor

    # --- weights out, one tensor at a time -----------------------------------------------
    def resharded(self) -> PolicyModule:
        """The module with every parameter back in its sharded form: the root unit stays
        gathered after a forward without backward, when parameters are plain tensors."""
        self.module.reshard()
        return self.module

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, full shape, dtype) of each tensor ``named_weights`` yields; no communication."""
        if self.lora:
            return [
                (lora_lib.wire_name(n), tuple(p.shape), torch.float32)
                for n, p in self.model.named_parameters()
                if lora_lib.is_adapter(n)
            ]
        return [(n, tuple(p.shape), self.compute_dtype) for n, p in self.model.named_parameters()]

    def named_weights(self, owned: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The LM's full weights in ``model.dtype``, one at a time (the rollout ranks' copy).
        Collective: every trainer rank must iterate it to the end, in step. ``owned``: each
        tensor is memory of its own (copied where it would be the parameter itself, one
        rank in the master dtype), so it may be read after the next update. Each shard is
        cast to ``model.dtype`` before the gather: half the traffic of gathering fp32.

        With LoRA: the adapters only, in fp32 under their wire names, B multiplied by its
        layer's alpha / rank (``models/lora.py``: the rollout merges them into its base)."""
        if self.lora:
            yield from self._adapter_weights()
            return
        for name, param in self.resharded().lm.named_parameters():
            full = gather_full(param.detach().to(self.compute_dtype))
            if owned:
                local = param.to_local() if isinstance(param, DTensor) else param
                if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                    full = full.clone()
            yield name, full

    def _adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        scale = lora_lib.scaling(self.model)
        for name, param in self.resharded().lm.named_parameters():
            if not lora_lib.is_adapter(name):
                continue
            full = gather_full(param.detach()).to(torch.float32, copy=True)
            if ".lora_B." in name:
                full *= scale[name.split(".lora_B.")[0]]
            yield lora_lib.wire_name(name), full

    def state_dict(self) -> dict:
        """This rank's state in a checkpoint (a ``ShardedStateful``), without
        communication: its rows of every trained parameter and optimizer state tensor
        (``layout``: each tensor's first row and whole shape), the optimizer's
        hyperparameters, the LR schedule and, with LoRA, the base model's identity
        (``lora_base``) in place of the frozen base. Its tensors are views of those this
        rank holds (no copy; the writer takes each to the CPU in its turn)."""
        layout: dict[str, list[int]] = {}
        self.resharded()

        def local(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim():
                rows = shard_rows_of(tensor, tensor.shape[0])
                layout["/".join(map(str, path))] = [rows.start, *tensor.shape]
            return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()

        tree: dict = {"model": {}}
        for name, param in self.model.named_parameters():
            if param.requires_grad:  # with LoRA the base is not saved: lora_base names it
                tree["model"][name] = local(("model", name), param)
        if self.lora:
            tree["lora_base"] = self.lora_base
        if self.value_head is not None:
            tree["value_head"] = {
                name: local(("value_head", name), param)
                for name, param in self.value_head.named_parameters()
            }
        state: dict = {}
        for index, param in enumerate(self.trained):
            entries = self.optimizer.state.get(param, {})
            if entries:
                state[index] = {
                    key: local(("optimizer", "state", index, key), value)
                    for key, value in entries.items()
                }
        groups = self.optimizer.state_dict()["param_groups"]
        tree["optimizer"] = {"state": state, "param_groups": groups}
        tree["lr_schedule"] = self.schedule.state_dict()
        tree["layout"] = json.dumps(layout)  # one small dataset, not one per tensor
        return tree

    def state_bytes(self) -> int:
        """Bytes of master weights, gradients and optimizer state this rank holds (its shard)."""

        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        self.resharded()
        total = 0
        for p in self.module.parameters():
            total += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    total += local_bytes(value)
        return total

    # --- state back in -------------------------------------------------------------------
    @torch.no_grad()
    def load_state_dict(self, reader: StateReader) -> None:
        """Restore from a checkpoint: each tensor's rows this rank holds, one tensor at a
        time (``reader``: the trainer parts' ``ShardedReader``, or a ``TreeReader`` of an
        in-memory tree of whole tensors); a LoRA checkpoint only onto the base it names."""
        source = reader.source
        self.resharded()
        parts = [("model", self.model)] + (
            [("value_head", self.value_head)] if self.value_head else []
        )
        for key, module in parts:
            names = reader.keys(key)
            if names is None:
                raise CheckpointError(
                    f"checkpoint {source} has no {key!r} (was it written with another algorithm?)"
                )
            mine = {n: p for n, p in module.named_parameters() if p.requires_grad}
            for name in mine:
                if name not in names:
                    raise CheckpointError(
                        f"checkpoint {source} has no tensor {name!r}, which the model has"
                    )
            for name in names:
                if name not in mine:
                    raise CheckpointError(
                        f"checkpoint {source} has tensor {name!r}, which the model does not have"
                    )
            for name, param in mine.items():
                shape = reader.shape((key, name))
                if tuple(shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"checkpoint {source}: tensor {name!r} has shape {tuple(shape)}, "
                        f"the model has {tuple(param.shape)}"
                    )
                set_rows(param, reader, (key, name))
        if self.lora:
            self.check_lora_base(reader)
        self.load_optimizer(reader)
        if reader.keys("lr_schedule") is not None:
            self.schedule.load_state_dict(reader.get("lr_schedule"))

    @property
    def lora_base(self) -> str:
        """The base model's identity (JSON: path and checksum), computed once."""
        if not hasattr(self, "_lora_base"):
            self._lora_base = lora_lib.base_identity(self.cfg.model.path)
        return self._lora_base

    def check_lora_base(self, reader: StateReader) -> None:
        """A LoRA checkpoint's adapters belong to one base model: the one it names."""
        source = reader.source
        saved = reader.get("lora_base")
        if saved is None:
            raise CheckpointError(
                f"checkpoint {source} has no lora_base: it was not written with LoRA"
            )
        saved_id, mine = json.loads(str(saved)), json.loads(self.lora_base)
        if saved_id["sha256"] != mine["sha256"]:
            raise CheckpointError(
                f"checkpoint {source} holds LoRA adapters of the base model at {saved_id['path']} "
                f"(sha256 {saved_id['sha256'][:12]}), but model.path={mine['path']} has other "
                f"files (sha256 {mine['sha256'][:12]}): resume with that model.path"
            )

    def load_optimizer(self, reader: StateReader) -> None:
        params = self.trained
        state: dict[int, dict] = {}
        for index in reader.keys("optimizer", "state") or []:
            param = params[int(index)]
            entry = {}
            for key in reader.keys("optimizer", "state", index):
                path = ("optimizer", "state", index, key)
                if reader.shape(path) is None:  # a scalar ("step"): the same on every rank
                    entry[key] = reader.get(*path).clone()
                else:
                    entry[key] = torch.zeros_like(param)
                    set_rows(entry[key], reader, path)
            state[int(index)] = entry
        groups = reader.get("optimizer", "param_groups")
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def trainer_states(policy: Policy) -> dict[str, Stateful | ShardedStateful]:
    """A trainer rank's states in its checkpoint part, by name: its shards of the policy
    and its RNGs."""
    return {"policy": policy, "rng": RngState()}


@torch.no_grad()
def set_rows(tensor: torch.Tensor, reader: StateReader, path: tuple) -> None:
    """Copy this rank's rows of the tensor at ``path`` into ``tensor`` (sharded or not)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    part = reader.rows(path, shard_rows_of(tensor, tensor.shape[0]))
    if not part.is_floating_point():
        raise CheckpointError(f"checkpoint tensor {'/'.join(map(str, path))} is not floating point")
    local.copy_(part.reshape(local.shape).to(local.dtype))


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated on the GPU, or resident (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --- the update ---------------------------------------------------------------------------


# --- the PPO update, read top down: ppo_update -> its mini-batches (mini_batch_plans,
# reference_quantities) -> each one's micro-batches (accumulate_gradients) -> the loss
# (micro_batch_loss); the small helpers last
# actor.optimizer_impl as torch.optim.AdamW's arguments (auto: torch decides)
OPTIMIZER_IMPL: dict[str, dict[str, bool]] = {
    "auto": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}
MAX_STATS = frozenset({"rollout_corr/is_weight_max"})  # reduced by max, not summed


class StepAbandoned(Exception):
    """A stop signal came before the step's first optimizer step: nothing of it is kept."""


def ppo_update(policy: Policy, batch: dict[str, torch.Tensor]) -> dict[str, float] | None:
    """One trainer step on this rank's rows: require_batches mini-batches x ppo_epochs
    optimizer steps. Collective over the trainer ranks; every rank returns the same
    statistics (each a mean over the whole batch of every rank, averaged over the steps).

    A stop signal (any trainer rank's, agreed on before each micro-batch) abandons the step
    while no optimizer step has been taken: its gradients are dropped, the weights, the
    optimizer and the LR schedule are as before it, and it returns None (the leader puts
    the batch back). The wait from a signal to the step's end is then the micro-batch in
    progress: with ``actor.use_dynamic_bsz`` at most ``ppo_max_token_len_per_gpu`` tokens,
    whatever the response length (``scripts/bench_stop_latency.py --token-budgets``);
    without it, the rank's whole shard (``ppo_micro_batch_size_per_gpu=0``) or that many
    rows. Once an optimizer step is taken (several mini-batches or epochs) the step
    finishes: the budget is the rest of the step."""
    actor = policy.cfg.actor
    clock = PhaseClock(policy.device)
    plans = mini_batch_plans(policy, batch)
    try:
        merged = {**batch, **reference_quantities(policy, batch, plans, abandon=True)}
        clock.lap("log_probs")
        stats = accumulate_gradients(policy, merged, plans[0], abandon=True, clock=clock)
    except StepAbandoned:
        policy.optimizer.zero_grad(set_to_none=True)
        return None
    totals: dict[str, torch.Tensor] = {}
    grad_norm, updates = 0.0, 0
    for epoch in range(actor.ppo_epochs):
        for i, plan in enumerate(plans):
            if epoch or i:  # the first mini-batch's gradients are in already
                stats = accumulate_gradients(policy, merged, plan, clock=clock)
            _combine(totals, stats)
            if actor.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(
                    list(policy.module.parameters()), actor.grad_clip
                )
                grad_norm += float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            policy.schedule.before_step()
            policy.optimizer.step()
            policy.schedule.after_step()
            clock.lap("optimizer")
            updates += 1
    keys = sorted(k for k in totals if k not in MAX_STATS)
    summed = policy.all_reduce(torch.stack([totals[k] for k in keys]).cpu()) if keys else []
    stats = {k: float(v) / updates for k, v in zip(keys, summed, strict=True)}
    for k in sorted(MAX_STATS & totals.keys()):
        top = totals[k].reshape(1).cpu()
        stats[k] = float(policy.all_reduce(top, op=dist.ReduceOp.MAX))
    if actor.grad_clip > 0:
        stats["actor/grad_norm"] = grad_norm / updates
    stats["actor/lr"] = policy.schedule.current_lr()
    if "rs_keep" in merged:
        counts = algos.rejection_counts(merged["rs_keep"], batch["response_mask"])
        tokens, total, seqs, responses = policy.all_reduce(counts.cpu()).tolist()
        stats["rollout_rs/masked_fraction"] = tokens / max(total, 1.0)
        stats["rollout_rs/seq_masked_fraction"] = seqs / max(responses, 1.0)
    if "m2po_keep" in merged:
        counts = algos.rejection_counts(merged["m2po_keep"], batch["response_mask"])
        tokens, total, seqs, responses = policy.all_reduce(counts.cpu()).tolist()
        stats["m2po/masked_fraction"] = tokens / max(total, 1.0)
        stats["m2po/seq_masked_fraction"] = seqs / max(responses, 1.0)
    policy.phase_seconds = clock.seconds()
    return stats


class PhaseClock:
    """This rank's wall seconds in each phase of one update, kept in ``Policy.phase_seconds``
    after it (every trainer rank's train span carries them as ``phases``, and the leader
    logs its own as ``time/<phase>_s``): ``log_probs`` (the pass
    before the update: old and reference log-probs, values), ``forward`` and ``backward``
    (every micro-batch's, FSDP's collectives included), ``optimizer`` (clipping and the
    step). On a GPU each lap waits for the device first, so the phases are the device's
    time: a host sync per micro-batch and phase."""

    def __init__(self, device: torch.device):
        self.device, self.laps = device, {}
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self.last
        self.last = now

    def seconds(self) -> dict[str, float]:
        return dict(self.laps)


def mini_batch_plans(policy: Policy, batch: dict[str, torch.Tensor]) -> list[list[np.ndarray]]:
    """Per mini-batch, the row indices of each micro-batch (the same count on every rank)."""
    actor = policy.cfg.actor
    rows = np.arange(batch["response_mask"].shape[0])
    tokens = row_tokens(batch)
    budget = actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None
    plans = []
    for mini in np.array_split(rows, policy.cfg.async_training.require_batches):
        plan = [
            mini[mb]
            for mb in plan_micro_batches(tokens[mini], actor.ppo_micro_batch_size_per_gpu, budget)
        ]
        plans.append(plan)
    if budget is not None and policy.world > 1:
        counts = policy.all_reduce(torch.tensor([len(p) for p in plans], dtype=torch.float64))
        plans = [
            split_to_count(p, tokens, int(c)) for p, c in zip(plans, counts.tolist(), strict=True)
        ]
    return plans


@torch.no_grad()
def reference_quantities(
    policy: Policy,
    batch: dict[str, torch.Tensor],
    plans: list[list[np.ndarray]],
    abandon: bool = False,
) -> dict[str, torch.Tensor]:
    """Before any update of the step: old log-probs, ref log-probs, values, advantages,
    returns, importance weights and the rejection-sampling mask (``rs_keep``), each (B, L),
    computed micro-batch by micro-batch.

    Old log-probs (and the importance weights made from them) are left out when the
    training forward's own log-probs equal them (``old_log_probs_from_training``): then
    only the reference model, if any, runs here. ``abandon``: raise ``StepAbandoned`` before
    a micro-batch once a stop signal is agreed on."""
    cfg = policy.cfg
    mask = batch["response_mask"]
    own_pass = not old_log_probs_from_training(cfg)
    out: dict[str, torch.Tensor] = {}
    if own_pass:
        out["old_log_probs"] = torch.zeros_like(mask)
    if policy.value_head is not None:
        out["values"] = torch.zeros_like(mask)
    if policy.has_reference:
        out["ref_log_probs"] = torch.zeros_like(mask)
    if not out:
        plans = []
    for rows in _pieces(plans):
        if abandon and stop_agreed(policy):
            raise StepAbandoned
        if rows.size == 0:
            rows = np.zeros(1, dtype=np.int64)  # an empty micro-batch still joins the collectives
        mb = trim(batch, rows)
        width = mb["response_ids"].shape[1]
        index = torch.as_tensor(rows, device=mask.device)
        if own_pass:
            log_probs, _, values = policy.forward(mb, with_values=policy.value_head is not None)
            out["old_log_probs"][index, :width] = log_probs
        if own_pass and values is not None:
            out["values"][index, :width] = values
        if policy.has_reference:
            out["ref_log_probs"][index, :width] = policy.forward(mb, reference=True)[0].float()
    if cfg.async_training.use_rollout_log_probs:
        out["old_log_probs"] = batch["rollout_log_probs"]
    algo = cfg.algorithm
    out.update(advantages.token_advantages(algo, batch, out.get("values"), policy.all_reduce))
    if algo.rollout_is != "none" and "old_log_probs" in out:
        out["is_weights"] = importance_weights(cfg, out["old_log_probs"], batch, mask)
    if algo.rollout_rs != "none":  # old_log_probs_from_training() is then False
        out["rs_keep"] = algos.rollout_rejection_mask(
            out["old_log_probs"], batch["rollout_log_probs"], mask,
            algo.rollout_rs, algo.rollout_rs_threshold, algo.rollout_rs_threshold_lower,
        )  # fmt: skip
    if algo.m2po_threshold is not None:  # here too old_log_probs_from_training() is False
        squared = (batch["rollout_log_probs"] - out["old_log_probs"]).double() ** 2
        cutoff = algos.m2po_cutoff(gathered(policy, squared[mask > 0]), algo.m2po_threshold)
        out["m2po_keep"] = algos.m2po_keep(
            out["old_log_probs"], batch["rollout_log_probs"], mask, cutoff
        )
    return out


def importance_weights(
    cfg: Config, old_log_probs: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """(B, L) ``algorithm.rollout_is``'s weights of old over rollout log-probs."""
    algo = cfg.algorithm
    return algos.rollout_importance_weights(
        old_log_probs, batch["rollout_log_probs"], mask, algo.rollout_is,
        algo.rollout_is_threshold, algo.rollout_is_mode, algo.rollout_is_threshold_lower,
    )  # fmt: skip


def gathered(policy: Policy, values: torch.Tensor) -> torch.Tensor:
    """The 1-D float64 ``values`` of every trainer rank, concatenated in rank order (two
    all-reduces: the counts, then the values in their places). Each rank holds the whole
    batch's values while it selects: one float64 per response token of the step."""
    if policy.world == 1:
        return values.double()
    rank = dist.get_rank(policy.group)
    counts = torch.zeros(policy.world, dtype=torch.float64)
    counts[rank] = values.numel()
    counts = policy.all_reduce(counts).long()
    offset = int(counts[:rank].sum())
    out = torch.zeros(int(counts.sum()), dtype=torch.float64)
    out[offset : offset + values.numel()] = values.double().cpu()
    return policy.all_reduce(out)


def accumulate_gradients(
    policy: Policy,
    batch: dict[str, torch.Tensor],
    plan: list[np.ndarray],
    abandon: bool = False,
    clock: PhaseClock | None = None,
) -> dict[str, torch.Tensor]:
    """Zero the gradients, then backward every micro-batch of one mini-batch (``batch``: rows
    with their reference quantities). Returns this rank's shares of the statistics.
    ``abandon``: raise ``StepAbandoned`` before a micro-batch once a stop is agreed on.
    ``clock``: takes the forward and backward laps."""
    policy.optimizer.zero_grad(set_to_none=True)
    rows = np.concatenate(plan) if plan else np.zeros(0, dtype=np.int64)
    index = torch.as_tensor(rows, dtype=torch.long, device=batch["response_mask"].device)
    counts = policy.all_reduce(algos.loss_normalisers(loss_mask(batch)[index]))
    normalisers = (float(counts[0]), float(counts[1]))
    totals: dict[str, torch.Tensor] = {}
    for mb_rows in plan:
        if abandon and stop_agreed(policy):
            raise StepAbandoned
        empty = mb_rows.size == 0
        mb = trim(batch, np.zeros(1, dtype=np.int64) if empty else mb_rows)
        if empty:  # joins the collectives, contributes nothing
            mb["response_mask"] = torch.zeros_like(mb["response_mask"])
        loss, stats = micro_batch_loss(policy, mb, normalisers)
        if clock:
            clock.lap("forward")
        loss.backward()
        if clock:
            clock.lap("backward")
        _combine(totals, stats)
    return totals


def micro_batch_loss(
    policy: Policy, mb: dict[str, torch.Tensor], normalisers: tuple[float, float]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the mini-batch's PPO loss (``mb``: batch rows with their
    ``reference_quantities`` merged in), and its shares of the logged statistics."""
    cfg, actor = policy.cfg, policy.cfg.actor
    m = loss_mask(mb)
    # seq-mean-token-sum-norm's constant: the longest response, not this micro-batch's width
    norm_length = cfg.rollout.response_length
    # the entropy is always computed (logged even when it is not in the loss): the chunked
    # head's logits are there anyway, its gradient only flows with entropy_coeff > 0
    log_probs, entropy, values = policy.forward(
        mb, with_entropy=True, with_values=policy.value_head is not None
    )
    if "old_log_probs" not in mb:  # this forward runs on the weights before the update
        mb = {**mb, "old_log_probs": log_probs.detach()}
        if cfg.algorithm.rollout_is != "none":
            mb["is_weights"] = importance_weights(cfg, mb["old_log_probs"], mb, m)
    if actor.policy_loss.loss_mode == "gspo":
        loss, pg_stats = algos.gspo_policy_loss(
            log_probs, mb["old_log_probs"], mb["advantages"], m,
            actor.clip_ratio_low, actor.clip_ratio_high,
            is_weights=mb.get("is_weights"), normalisers=normalisers,
        )  # fmt: skip
    else:
        loss, pg_stats = algos.policy_loss(
            log_probs, mb["old_log_probs"], mb["advantages"], m,
            actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c, actor.loss_agg_mode,
            is_weights=mb.get("is_weights"), normalisers=normalisers, norm_length=norm_length,
        )  # fmt: skip
    stats = {"actor/pg_loss": loss.detach(), **{f"actor/{k}": v for k, v in pg_stats.items()}}
    if entropy is not None:
        ent = algos.aggregate(entropy, m, actor.loss_agg_mode, normalisers, norm_length)
        if actor.entropy_coeff > 0:
            loss = loss - actor.entropy_coeff * ent
        stats["actor/entropy"] = ent.detach()
    stats.update(rollout_mismatch(policy, mb, m, normalisers))
    if "ref_log_probs" in mb:
        kl_tokens = algos.kl_penalty(log_probs, mb["ref_log_probs"], actor.kl_loss_type)
        kl = algos.aggregate(kl_tokens, m, actor.loss_agg_mode, normalisers, norm_length)
        loss = loss + actor.kl_loss_coef * kl
        stats["actor/kl_loss"] = kl.detach()
    if values is not None:
        vf_loss, vf_clipfrac = algos.value_loss(
            values, mb["values"], mb["returns"], m,
            cfg.critic.cliprange_value, actor.loss_agg_mode, normalisers, norm_length,
        )  # fmt: skip
        loss = loss + cfg.critic.value_coef * vf_loss
        stats["critic/vf_loss"], stats["critic/vf_clipfrac"] = vf_loss.detach(), vf_clipfrac
    return loss, stats


def loss_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L) the tokens every loss term counts: the response's, less those rejection
    sampling and M2PO masked out (``rs_keep``, ``m2po_keep``, when present)."""
    mask = batch["response_mask"]
    for key in ("rs_keep", "m2po_keep"):
        if key in batch:
            mask = mask * batch[key]
    return mask


def rollout_mismatch(
    policy: Policy, mb: dict[str, torch.Tensor], m: torch.Tensor, normalisers: tuple
) -> dict[str, torch.Tensor]:
    """How far the rollout's log-probs of the sampled tokens are from the trainer's (old)
    ones: the first thing to look at in an async run. Token means over the mini-batch (this
    micro-batch's shares): ``rollout_corr/kl``, the mean of old minus rollout log-probs;
    ``rollout_corr/k3_kl``, its k3 form (r - 1 - log r with r = pi_old / pi_rollout, >= 0);
    the untruncated token importance weights' mean, the share above
    ``algorithm.rollout_is_threshold`` (truncated when rollout_is is on) and their max; in
    ``rollout_is_mode=mask``, ``rollout_corr/is_masked_fraction``: the share outside the
    bounds, which trains nothing."""
    with torch.no_grad():
        bound = algos.LOG_RATIO_BOUND
        log_ratio = (mb["old_log_probs"] - mb["rollout_log_probs"]).clamp(-bound, bound)
        ratio = torch.exp(log_ratio)
        threshold = policy.cfg.algorithm.rollout_is_threshold

        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return algos.aggregate(x, m, "token-mean", normalisers)

        weights = torch.where(m > 0, ratio, 0.0)
        stats = {
            "rollout_corr/kl": token_mean(log_ratio),
            "rollout_corr/k3_kl": token_mean(ratio - 1 - log_ratio),
            "rollout_corr/is_weight_mean": token_mean(ratio),
            "rollout_corr/is_truncated_fraction": token_mean((ratio > threshold).to(ratio.dtype)),
            "rollout_corr/is_weight_max": weights.max(),
        }
        algo = policy.cfg.algorithm
        if algo.rollout_is != "none" and algo.rollout_is_mode == "mask":
            lower = algo.rollout_is_threshold_lower or 0.0
            outside = (ratio > threshold) | (ratio < lower)
            stats["rollout_corr/is_masked_fraction"] = token_mean(outside.to(ratio.dtype))
        return stats


def old_log_probs_from_training(cfg: Config) -> bool:
    """Whether the old log-probs can come from the training forward itself: with one
    optimizer step per trainer step (one epoch, one mini-batch) every micro-batch's forward
    runs on the weights before the update, so a separate no-grad pass would compute the same
    numbers; with a value head that pass runs anyway (the old values), so it is kept, and
    with rejection sampling the pass decides which tokens count in the loss."""
    return (
        cfg.actor.ppo_epochs == 1
        and cfg.async_training.require_batches == 1
        and not cfg.async_training.use_rollout_log_probs
        and cfg.algorithm.adv_estimator != "gae"
        # rejection sampling masks tokens out of the loss by their old log-probs: the loss
        # normalisers of the whole mini-batch must be known before the first micro-batch
        and cfg.algorithm.rollout_rs == "none"
        and cfg.algorithm.m2po_threshold is None  # the same, over the whole batch
        and not cfg.actor.recompute_old_log_probs
    )


def stop_agreed(policy: Policy) -> bool:
    """Whether any trainer rank has a stop signal (``runtime/signals.py``); collective, so
    that every rank abandons a step at the same micro-batch. One float's all-reduce."""
    flag = torch.tensor([1.0 if stop_requested() else 0.0], dtype=torch.float64)
    return bool(policy.all_reduce(flag).item() > 0)


def _pieces(plans: list[list[np.ndarray]]) -> Iterator[np.ndarray]:
    for plan in plans:
        yield from plan


def _combine(totals: dict, stats: dict) -> None:
    """Add ``stats`` into ``totals`` (MAX_STATS: keep the larger)."""
    for k, v in stats.items():
        v = v.double() if isinstance(v, torch.Tensor) else v
        if k in MAX_STATS and k in totals:
            totals[k] = torch.maximum(totals[k], v)
        else:
            totals[k] = totals.get(k, 0.0) + v
