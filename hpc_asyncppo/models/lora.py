"""LoRA: trained adapters on a frozen base, in one module for both ends of the weight sync.

The trainer (``actor.lora_rank`` > 0) injects peft's LoRA layers into its LM on the meta
device, before FSDP2 shards it (``inject``): the base's weights stay in ``model.dtype``
and frozen (no fp32 master, gradient or AdamW state), the adapters get fp32 masters and
AdamW. Parameter names then read ``<module>.base_layer.weight`` (``base_name`` maps them
back to the safetensors files' names) and ``<module>.lora_A.default.weight``.

A sync carries only the adapters (``wire_name``: ``<module>.lora_A.weight`` and
``<module>.lora_B.weight``, fp32, B already multiplied by alpha / rank): a few megabytes
where the model is gigabytes. Every rollout engine applies them the same way
(``merged_weights``): each targeted weight becomes base + B @ A, computed in fp32 from the
base (read from the model's safetensors files at the first sync, then held in host memory:
``BaseWeights``) and cast to ``model.dtype``; the engine then loads those weights as it
loads a full sync, and only them: a vLLM worker reloads the layers the adapters change
(``layer_tensors``), the others keep their weights. Generation therefore runs at the base
model's speed (no adapter kernels), and
the HF and vLLM engines share this code; only the load differs (a parameter's copy, or
vLLM's loader).

The KL reference is the same module with its adapters switched off
(``adapters_disabled``): no second model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from hpc_asyncppo.config import lora_targets

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def target_names(lm: nn.Module, targets: str) -> list[str]:
    """The module names (peft matches their ends) that ``targets`` means in ``lm``: names
    separated by commas, where ``all-linear`` stands for every linear layer but the LM head
    (peft's meaning); ``all-linear,lm_head`` adds the head."""
    names = lora_targets(targets)
    if "all-linear" in names:
        head = lm.get_output_embeddings()
        linear = {
            n.rsplit(".", 1)[-1]
            for n, m in lm.named_modules()
            if isinstance(m, nn.Linear) and m is not head
        }
        names = sorted(linear) + [n for n in names if n != "all-linear"]
    return names


def inject(lm: nn.Module, rank: int, alpha: float, targets: str, dropout: float) -> None:
    """Put peft's LoRA layers into ``lm`` (on the meta device, before sharding): adapters in
    fp32 and trainable, every other parameter frozen. ``targets``: see ``target_names``."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    names = target_names(lm, targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=names, lora_dropout=dropout)
    inject_adapter_in_model(config, lm)
    for module in lm.modules():
        if isinstance(module, LoraLayer):
            module.lora_A.float()
            module.lora_B.float()
    for name, param in lm.named_parameters():
        param.requires_grad_(".lora_" in name)


def lora_layers(lm: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, layer) of every LoRA layer, in the model's order."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in lm.named_modules() if isinstance(m, LoraLayer)]


def base_name(name: str) -> str:
    """The safetensors name of a parameter of an injected model (``q_proj.base_layer.weight``
    is the file's ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_wire_adapter(name: str) -> bool:
    """Whether a sync's tensor is an adapter (a sync of adapters holds nothing else)."""
    return name.endswith((LORA_A, LORA_B))


def base_targets(adapters: Iterable[str]) -> list[str]:
    """The base weights a sync's adapters change (``<module>.weight``), in order."""
    return [n[: -len(LORA_A)] + ".weight" for n in adapters if n.endswith(LORA_A)]


def wire_name(name: str) -> str:
    """``<module>.lora_A.default.weight`` -> ``<module>.lora_A.weight`` (what a sync carries)."""
    return name.replace(".default.", ".")


@contextlib.contextmanager
def adapters_disabled(lm: nn.Module) -> Iterator[None]:
    """The base model alone: every LoRA layer computes its base layer's output only. Sets
    peft's flag directly: its ``enable_adapters`` would also flip ``requires_grad``, which
    FSDP2 must not see change between steps."""
    layers = [m for _, m in lora_layers(lm)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def scaling(lm: nn.Module) -> dict[str, float]:
    """alpha / rank of each LoRA layer (the factor B @ A is multiplied by)."""
    return {name: float(m.scaling["default"]) for name, m in lora_layers(lm)}


def merged_weights(
    adapters: dict[str, torch.Tensor],
    base: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    everything: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the adapters make of the base: for each base tensor (name, tensor, in
    the files' names) that has adapters, base + B @ A in fp32, cast to ``dtype``;
    ``everything``: the other tensors of ``base`` too, as they are (an engine whose loader
    wants whole layers: ``layer_tensors``). Raises ValueError when an adapter has no base
    tensor, or half of one came."""
    modules = {n[: -len(LORA_A)] for n in adapters if n.endswith(LORA_A)}
    halves = {n[: -len(LORA_B)] for n in adapters if n.endswith(LORA_B)}
    if modules != halves or len(adapters) != 2 * len(modules):
        raise ValueError(
            f"a LoRA sync carried unpaired or unknown tensors: {sorted(modules ^ halves)[:3]}"
        )
    merged = set()
    for name, tensor in base:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in modules:
            a, b = adapters[module + LORA_A], adapters[module + LORA_B]
            # one fp32 copy of the base, B @ A added into it (a copy: the base is held
            # for the next sync, and may already be fp32)
            full = tensor.to(a.device, torch.float32, copy=True)
            full.addmm_(b.float(), a.float())
            merged.add(module)
            yield name, full.to(dtype)
        elif everything:
            yield name, tensor.to(dtype)
    if merged != modules:
        raise ValueError(
            f"LoRA adapters for {sorted(modules - merged)[:3]}, which the base model lacks"
        )


def layer_tensors(names: Iterable[str], modules: Iterable[str], packed: dict) -> list[str]:
    """The tensors (of ``names``, the files' names, in their order) of every layer that a
    LoRA module (``<prefix>.q_proj``) belongs to in an engine that fuses modules into one
    layer (``packed``: vLLM's ``packed_modules_mapping``, ``{"qkv_proj": ["q_proj",
    "k_proj", "v_proj"], ...}``): such an engine loads a layer whole or not at all, so a
    targeted ``q_proj`` brings its ``k_proj`` and ``v_proj`` weights and every bias."""
    siblings = {member: group for group in packed.values() for member in group}
    wanted = set()
    for module in modules:
        prefix, _, last = module.rpartition(".")
        for member in siblings.get(last, [last]):
            wanted.add(f"{prefix}.{member}" if prefix else member)
    return [name for name in names if name.rsplit(".", 1)[0] in wanted]


class BaseWeights:
    """The base model's tensors for the rollout side of a LoRA sync: read from its
    safetensors files the first time a sync needs them, then held in this process's host
    memory, so that later syncs merge from here and never read the files again (on a
    cluster they sit on the parallel filesystem, which eight workers a node would read at
    every sync). An engine that restarts reads them once more.

    What it holds: every tensor ``read`` has been asked for, in the files' dtype
    (``held_bytes``): the targeted weights (the transformers engine), or every tensor of the
    layers they belong to (a vLLM worker: ``layer_tensors``), in each process that merges:
    with peft's all-linear, most of the model per worker."""

    def __init__(self, path: str | Path):
        from hpc_asyncppo.models.safetensors_weights import SafetensorsWeights

        self.files = SafetensorsWeights(path)
        self.held: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        """Every tensor of the base, in the files' order."""
        return list(self.files.files)

    def read(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of ``names`` (default: all), from memory, from the files the first
        time. The tensors are the held ones: read them, never write into them."""
        for name in self.files.files if names is None else names:
            tensor = self.held.get(name)
            if tensor is None:
                tensor = self.held[name] = self.files.read(name, None)
            yield name, tensor

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held.values())


def base_identity(path: str | Path) -> str:
    """The base model's identity, checked when a LoRA run resumes: sha256 over each
    safetensors file's name, size and header (every tensor's name, dtype, shape and byte
    range) and, for files of at most 64 MiB, its bytes; JSON text."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}:".encode())
        with file.open("rb") as f:
            if size <= 64 << 20:
                digest.update(f.read())
            else:
                length = int.from_bytes(f.read(8), "little")
                digest.update(f.read(length))
    return json.dumps({"path": str(folder.resolve()), "sha256": digest.hexdigest()})
