"""The sharded model a trainer rank runs: an HF causal LM and its optional value head as one
module (``PolicyModule``), sharded with FSDP2 the same way for any number of trainer ranks
T, one included (``shard_model``: ``fully_shard`` on every decoder layer, then on the root
holding the embeddings, final norm, LM head and value head), built on the meta device with
each rank reading only its own rows of every tensor from the safetensors files
(``build_sharded``).

Log-probs: only the final hidden states of the response positions go through the LM head,
``actor.log_prob_chunk_tokens`` tokens at a time, each chunk recomputed in the backward
(activation checkpointing), so the full-vocabulary logits of one chunk (fp32) are the only
vocabulary-sized tensor alive at any time (``token_log_probs``).

Packed rows (``model.use_remove_padding``, the default): the rows' real tokens only, laid
into bins (``packed_rows``), so a micro-batch's activations scale with its real tokens,
not with its rows times its longest row, and its attention costs at most the padded
batch's; the outputs equal the padded path's.

Gradients are reduce-scattered in fp32 and summed over the ranks (not averaged): the
update normalises every loss over the whole mini-batch itself (``policy.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from hpc_asyncppo.config import Config
from hpc_asyncppo.models import lora as lora_lib
from hpc_asyncppo.models.dtypes import DTYPES
from hpc_asyncppo.models.safetensors_weights import SafetensorsWeights


class PolicyModule(nn.Module):
    """The LM and its optional value head as one root module: FSDP gathers the root unit's
    weights (embeddings, LM head, value head) around this forward."""

    def __init__(self, lm: nn.Module, value_head: nn.Linear | None):
        super().__init__()
        self.lm, self.value_head = lm, value_head

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        temperature: float,
        chunk_tokens: int,
        with_entropy: bool = False,
        with_values: bool = False,
        packed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sampled-token log-probs (B, L) of log_softmax(logits / temperature), entropy
        (B, L) or None, values (B, L) or None, for a batch of left-padded prompts followed
        by right-padded responses.

        ``packed``: the rows' real tokens only, laid into bins (``packed_rows``) whose
        positions restart at each row, with no attention mask, which transformers turns
        into attention that never crosses rows; positions past a response's end are 0 in
        every output. Otherwise the padded (B, P + L) batch runs whole, padding included."""
        if packed and batch["response_ids"].shape[0]:
            return self._packed_forward(batch, temperature, chunk_tokens, with_entropy, with_values)
        prompt_width = batch["prompt_ids"].shape[1]
        input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
        # every response token is context, observations included (response_mask: trained)
        response = batch.get("response_attention", batch["response_mask"])
        attention = torch.cat([batch["prompt_mask"], response], dim=1).long()
        position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
        base = getattr(self.lm, self.lm.base_model_prefix)
        hidden = base(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        # The state at position t predicts token t + 1: responses start after the prompt.
        hidden = hidden[:, prompt_width - 1 : -1]
        log_probs, entropy = token_log_probs(
            self.lm.get_output_embeddings(),
            hidden,
            batch["response_ids"],
            temperature,
            chunk_tokens,
            with_entropy,
        )
        values = None
        if with_values and self.value_head is not None:
            values = self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)
        return log_probs, entropy, values

    def _packed_forward(
        self,
        batch: dict[str, torch.Tensor],
        temperature: float,
        chunk_tokens: int,
        with_entropy: bool,
        with_values: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        one_sequence = self.lm.config._attn_implementation == "flash_attention_2"
        input_ids, position_ids, before, real = packed_rows(batch, one_sequence)
        base = getattr(self.lm, self.lm.base_model_prefix)
        # No attention mask and no cache: transformers finds the rows from the restarts of
        # position_ids and masks across them. With a cache it would not look, and rows
        # would silently attend to the rows before them.
        hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        # (M, H): the states that predict the real response tokens
        hidden = hidden.last_hidden_state.reshape(-1, hidden.last_hidden_state.shape[-1])[before]
        log_probs, entropy = token_log_probs(
            self.lm.get_output_embeddings(),
            hidden[None],
            batch["response_ids"][real][None],
            temperature,
            chunk_tokens,
            with_entropy,
        )
        values = None
        if with_values and self.value_head is not None:
            values = self.value_head(hidden).squeeze(-1).to(torch.float32)
        rows, cols = real.nonzero(as_tuple=True)

        def unpacked(flat: torch.Tensor | None) -> torch.Tensor | None:
            if flat is None:
                return None
            return flat.new_zeros(real.shape).index_put((rows, cols), flat.reshape(-1))

        return unpacked(log_probs), unpacked(entropy), unpacked(values)


def packed_rows(
    batch: dict[str, torch.Tensor], one_sequence: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's rows without padding, packed into K bins of C tokens: (input_ids (K, C),
    position_ids (K, C) restarting at 0 on each row, ``before`` (M,) the flat position in
    (K * C) of the token before each real response token (whose state predicts it),
    ``real`` (B, L) the real response tokens, M of them).

    C is the longest row (prompt + response tokens), and rows go to bins first-fit by
    decreasing length, so attention over a bin (quadratic in C where the attention builds
    a dense mask: sdpa, eager) costs no more than the padded batch's row. A bin's unused
    tail is one more sequence of filler (positions from 0), attended by nothing real.
    ``one_sequence``: a single bin of every row, flash-attention's varlen form (it takes
    packed rows in a batch of one only)."""
    response = batch.get("response_attention", batch["response_mask"]).bool()
    kept = torch.cat([batch["prompt_mask"].bool(), response], dim=1)
    tokens = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    positions = kept.long().cumsum(dim=1) - 1
    lengths = kept.sum(dim=1).tolist()
    capacity = sum(lengths) if one_sequence else max(lengths)
    used: list[int] = []  # tokens in each bin
    start = [0] * len(lengths)  # flat position of each row's first token
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        k = next((k for k, n in enumerate(used) if n + lengths[row] <= capacity), len(used))
        if k == len(used):
            used.append(0)
        start[row] = k * capacity + used[k]
        used[k] += lengths[row]
    dest = torch.as_tensor(start, device=tokens.device)[:, None] + positions
    slot = torch.arange(capacity, device=tokens.device)
    # filler: each bin's tail counts from 0 again, a sequence of its own
    position_ids = (slot[None] - torch.as_tensor(used, device=tokens.device)[:, None]).clamp(min=0)
    position_ids = position_ids.reshape(-1)
    input_ids = torch.zeros_like(position_ids)
    input_ids[dest[kept]] = tokens[kept]
    position_ids[dest[kept]] = positions[kept]
    prompt_width = batch["prompt_ids"].shape[1]
    # a row's prompt ends right before its response: the state before response token j is
    # the packed token just before it in the same row
    before = (dest[:, prompt_width:] - 1)[response]
    shape = (len(used), capacity)
    return input_ids.reshape(shape), position_ids.reshape(shape), before, response


def token_log_probs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(head(hidden) / temperature) at ``targets``, (B, L), and the entropy.

    The logits exist ``chunk_tokens`` rows at a time, in fp32; under autograd each chunk is
    recomputed in the backward, so only the hidden states are kept between the two.
    """
    width = hidden.shape[-1]
    flat_hidden, flat_targets = hidden.reshape(-1, width), targets.reshape(-1)

    def chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h).float() / temperature
        log_z = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - log_z
        if not with_entropy:
            return picked, picked.new_zeros(0)
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
        return picked, entropy

    picked, entropies = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        h, t = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(chunk, h, t, use_reentrant=False)
        else:
            lp, ent = chunk(h, t)
        picked.append(lp)
        entropies.append(ent)
    # reshape(...).clone(): a module's output must not be a view (FSDP's backward hook)
    log_probs = torch.cat(picked).reshape(targets.shape).clone()
    entropy = torch.cat(entropies).reshape(targets.shape).clone() if with_entropy else None
    return log_probs, entropy


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks (the classes HF never splits across devices)."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(lm).__name__}: cannot find its decoder layers to shard")
    return layers


def shard_model(module: PolicyModule, mesh: DeviceMesh, compute: torch.dtype | None) -> None:
    """FSDP2: one unit per decoder layer, then the root; compute in ``compute``, gradients
    reduced in fp32 and summed over the ranks (the loss is normalised globally)."""
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    layers = decoder_layers(module.lm)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for unit in [*layers, module]:
        unit.set_gradient_divide_factor(1.0)
        # plain SUM (gloo has no PREMUL_SUM; with a factor of 1 nothing is scaled anyway)
        unit.set_force_sum_reduction_for_comms(True)


def shard_rows_of(tensor: torch.Tensor, full_rows: int) -> slice:
    """Rows of the full tensor that this rank's local shard of ``tensor`` holds (FSDP2
    shards dim 0 like ``torch.chunk``: ceil(rows / T) per rank, the last ones shorter)."""
    if not isinstance(tensor, DTensor):
        return slice(0, full_rows)
    mesh = tensor.device_mesh
    per_rank = -(-full_rows // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, full_rows)
    return slice(start, min(start + per_rank, full_rows))


@torch.no_grad()
def set_full(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of ``full`` (the whole tensor) into ``tensor`` (sharded or not)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if full.dim() == 0:
        local.copy_(full)
        return
    rows = shard_rows_of(tensor, full.shape[0])
    local.copy_(full[rows].to(local.dtype))


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every trainer rank (collective for a sharded one)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def build_sharded(
    cfg: Config,
    mesh: DeviceMesh,
    device: torch.device,
    master: torch.dtype,
    compute: torch.dtype | None,
    with_value_head: bool,
) -> PolicyModule:
    """The LM (and value head) on the meta device, sharded, then each rank's rows read in.

    With ``actor.lora_rank`` > 0 the LM's own weights are frozen in ``model.dtype`` (not
    ``master``) and peft's adapters (``models/lora.py``) are injected before sharding, in
    fp32, A drawn whole from ``trainer.seed`` (the same whatever T) and B zero."""
    config = AutoConfig.from_pretrained(cfg.model.path)
    config.use_cache = False
    lora = cfg.actor.lora_rank > 0
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(
            config,
            dtype=DTYPES[cfg.model.dtype] if lora else master,
            attn_implementation=cfg.model.attn_implementation,
        )
        value_head = nn.Linear(config.hidden_size, 1, dtype=master) if with_value_head else None
    if lora:
        a = cfg.actor
        try:
            lora_lib.inject(lm, a.lora_rank, a.lora_alpha, a.target_modules, a.lora_dropout)
        except ValueError as exc:  # peft: no module matched
            raise ValueError(f"actor.target_modules={a.target_modules!r}: {exc}") from None
    if cfg.actor.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = PolicyModule(lm, value_head)
    shard_model(module, mesh, compute)
    module.to_empty(device=device)
    weights = SafetensorsWeights(cfg.model.path)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    for name, param in lm.named_parameters():
        if lora_lib.is_adapter(name):
            _init_adapter(param, name, gen)
        else:
            _load_rows(param, weights, lora_lib.base_name(name))
    for sub in lm.modules():  # non-persistent buffers (rotary frequencies) are not in the files
        if list(sub.buffers(recurse=False)) and not list(sub.parameters(recurse=False)):
            lm._init_weights(sub)
    if value_head is not None:
        # The same initial value head on every rank, whatever T: drawn whole, then sliced.
        gen = torch.Generator().manual_seed(cfg.trainer.seed)
        bound = config.hidden_size**-0.5
        full_w = (torch.rand(1, config.hidden_size, generator=gen) * 2 - 1) * bound
        set_full(value_head.weight, full_w)
        set_full(value_head.bias, torch.zeros(1))
    return module


@torch.no_grad()
def _init_adapter(param: torch.Tensor, name: str, gen: torch.Generator) -> None:
    """peft's initialisation, drawn whole on every rank then sliced: A uniform in
    +-1/sqrt(in_features) (kaiming-uniform with a=sqrt(5)), B zero, so that the adapted
    model starts as the base."""
    if ".lora_B." in name:
        set_full(param, torch.zeros(param.shape))
        return
    bound = param.shape[1] ** -0.5
    set_full(param, (torch.rand(param.shape, generator=gen) * 2 - 1) * bound)


@torch.no_grad()
def _load_rows(param: torch.Tensor, weights: SafetensorsWeights, name: str) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if param.dim() == 0:
        local.copy_(weights.read(name, None))
        return
    rows = shard_rows_of(param, param.shape[0])
    part = weights.read(name, rows)
    if tuple(part.shape) != tuple(local.shape):
        raise ValueError(
            f"tensor {name!r} in {weights.files[name]}: rows {rows.start}:{rows.stop} have shape "
            f"{tuple(part.shape)}, this rank's shard {tuple(local.shape)}"
        )
    local.copy_(part.to(local.dtype))
