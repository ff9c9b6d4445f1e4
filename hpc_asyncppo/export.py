"""A trained policy as a Hugging Face folder: ``python -m hpc_asyncppo.export RUN_DIR OUT_DIR
[--step N] [--dtype bf16|fp32|fp16] [--max-shard-mb MB]``.

OUT_DIR gets ``config.json`` (the run's ``model.path`` config, its ``dtype`` set to the
export's), ``model-0000k-of-0000K.safetensors`` and ``model.safetensors.index.json``, the
tokenizer files and ``generation_config.json``: ``AutoModelForCausalLM.from_pretrained``
and vLLM load it as they load the model the run started from. The checkpoint is the one of
step N, or the newest whose parts are all present (an older one when the newest turns out
corrupt while it is read). The tensors are the policy's parameters under the HF model's own
names (a tied LM head is the embedding, saved once, as ``save_pretrained`` does); the value
head of a GAE run is not part of the model and is left out.

Memory: the tensors are gathered one at a time from the trainer parts (each part's rows of
it, checksums verified, joined and cast) and written straight into their safetensors shard,
whose header is laid out beforehand from the shapes in the parts' layout. So the process
holds at most one tensor at a time: its rows as read (fp32), the joined tensor and its cast
copy, about 3x the largest tensor's fp32 bytes, never the model.

A LoRA run (``actor.lora_rank`` > 0) checkpoints its adapters only: ``--lora-format
merged`` (the default) writes the same HF folder with each targeted weight made base +
(alpha / rank) B @ A, the base read from the run's ``model.path`` (whose checksum must be
the one the checkpoint names); ``--lora-format adapter`` writes a PEFT adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``) that ``PeftModel.from_pretrained``
loads onto that base.

Everything is written into a temporary folder beside OUT_DIR, fsynced, then renamed to
OUT_DIR: an export that fails or is interrupted leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import CheckpointError, fsync_dir, fsync_file
from hpc_asyncppo.config import Config, load_resolved
from hpc_asyncppo.models.dtypes import DTYPES
from hpc_asyncppo.paths import CONFIG, MODEL

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_MB = 5000  # transformers' long-standing max_shard_size default ("5GB")
DTYPE_NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
LORA_FORMATS = ("merged", "adapter")
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class ExportError(RuntimeError):
    """The export cannot be made from this input; the message is one line naming the fix."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    def nbytes(self, dtype: torch.dtype) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * dtype.itemsize


# --- the plan: which tensors, in which shard -----------------------------------------------


def plan_shards(
    specs: list[TensorSpec], dtype: torch.dtype, max_bytes: int
) -> list[list[TensorSpec]]:
    """Tensors in order, cut into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.nbytes(dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def safetensors_header(specs: list[TensorSpec], dtype: torch.dtype) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``specs`` in order
    (padded with spaces to a multiple of 8, as the safetensors library writes it)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        end = offset + spec.nbytes(dtype)
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


# --- finding the checkpoint -----------------------------------------------------------------


def run_config(run_dir: Path) -> Config:
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist; give the RUN_DIR of a run")
    path = run_dir / CONFIG
    if not path.is_file():
        raise ExportError(f"{run_dir} is not a run directory (no {CONFIG}); give a run's RUN_DIR")
    try:
        return load_resolved(path)
    except Exception as exc:  # noqa: BLE001 - omegaconf and yaml raise many types
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ExportError(f"{path} cannot be read ({type(exc).__name__}: {first[:200]})") from None


def model_source(cfg: Config, run_dir: Path) -> Path:
    """The HF folder the run started from (its config and tokenizer); a run directory that
    was moved still finds its own tiny model in RUN_DIR/model."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return path
    if (run_dir / MODEL / "config.json").is_file():
        return run_dir / MODEL
    raise ExportError(
        f"the run's model.path={cfg.model.path!r} has no config.json (the export takes the "
        "model's config and tokenizer from it); restore that folder"
    )


def candidate_checkpoints(run_dir: Path, step: int | None) -> list[Path]:
    """Step N's checkpoint, or every committed one newest first."""
    found = [p for p in protocol.list_checkpoints(run_dir) if p.is_dir()]
    if step is None:
        if not found:
            raise ExportError(
                f"{run_dir} has no checkpoint (checkpoints/step_*/manifest.json); train with "
                "checkpoint.save_every or checkpoint.save_final=true, or --resume it to write one"
            )
        return found
    folder = protocol.step_dir(run_dir, step)
    if folder not in found:
        steps = ", ".join(str(n) for n in sorted(int(p.name[5:]) for p in found)) or "none"
        raise ExportError(
            f"{run_dir} has no checkpoint of step {step} (committed steps: {steps}); "
            "pick one of those with --step, or leave --step out for the newest"
        )
    return [folder]


# --- writing ---------------------------------------------------------------------------------


def parameter_specs(
    folder: Path, manifest: dict, source: Path, lora: bool = False
) -> list[TensorSpec]:
    """The checkpoint's model tensors in the HF model's own order, checked against the
    model built (on the meta device) from ``source``'s config. ``lora``: the checkpoint
    holds adapters; each must belong to a weight of that model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied: once
    with protocol.ShardedReader(folder, manifest, [0]) as reader:
        names = reader.keys("model") or []
        stored = {n: reader.shape(("model", n)) for n in names}
        if lora:
            check_lora_base(folder, reader.get("lora_base"), source)
    if lora:
        strays = [n for n in stored if adapted_weight(n) not in expected]
        if strays or not stored:
            raise ExportError(
                f"checkpoint {folder} holds LoRA adapters {strays[:3]} that {source}'s model "
                "has no weight for; was model.path changed?"
            )
        return [TensorSpec(n, s) for n, s in expected.items()]
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    if missing or extra:
        raise ExportError(
            f"checkpoint {folder} does not hold the parameters of {source}'s model "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); was model.path changed?"
        )
    for name, shape in expected.items():
        if stored[name] != shape:
            raise ExportError(
                f"checkpoint {folder}: {name} has shape {stored[name]}, {source}'s model "
                f"{shape}; was model.path changed?"
            )
    return [TensorSpec(n, s) for n, s in expected.items()]


def adapted_weight(adapter: str) -> str:
    """``<module>.lora_A.default.weight`` -> ``<module>.weight``."""
    return adapter.split(".lora_")[0] + ".weight"


def check_lora_base(folder: Path, saved: object, source: Path) -> None:
    from hpc_asyncppo.models.lora import base_identity

    if saved is None:
        raise ExportError(f"checkpoint {folder} has no lora_base: it was not written with LoRA")
    theirs, mine = json.loads(str(saved)), json.loads(base_identity(source))
    if theirs["sha256"] != mine["sha256"]:
        raise ExportError(
            f"checkpoint {folder} holds LoRA adapters of the base model at {theirs['path']}, "
            f"but {source} has other files: restore that model.path"
        )


class MergedWeights:
    """A LoRA checkpoint's weights: each base weight from the model's files, plus
    ``scale`` B @ A where the checkpoint has adapters for it (fp32)."""

    def __init__(self, reader: protocol.ShardedReader, source: Path, scale: float):
        from hpc_asyncppo.models.safetensors_weights import SafetensorsWeights

        self.reader, self.base, self.scale = reader, SafetensorsWeights(source), scale
        self.adapters = set(reader.keys("model") or [])

    def whole(self, name: str) -> torch.Tensor:
        shape = self.reader.shape(("model", name))
        return self.reader.rows(("model", name), slice(0, shape[0])).float()

    def __call__(self, spec: TensorSpec) -> torch.Tensor:
        tensor = self.base.read(spec.name, None).float()
        module = spec.name[: -len(".weight")]
        a, b = f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight"
        if a in self.adapters:
            tensor += self.scale * (self.whole(b) @ self.whole(a))
        return tensor


def write_weights(
    folder: Path, manifest: dict, specs: list[TensorSpec], dtype: torch.dtype, out: Path,
    max_bytes: int, merge: tuple[Path, float] | None = None,
) -> None:  # fmt: skip
    """Each tensor gathered from the trainer parts and written into its shard, in order
    (``merge``: (base folder, alpha / rank), a LoRA checkpoint's adapters merged into it)."""
    shards = plan_shards(specs, dtype, max_bytes)
    parts = [int(n[len("trainer") : -3]) for n in manifest["parts"] if n.startswith("trainer")]
    weight_map: dict[str, str] = {}
    total = 0
    with protocol.ShardedReader(folder, manifest, parts) as reader:
        merged = MergedWeights(reader, *merge) if merge else None
        for index, shard in enumerate(shards):
            name = shard_name(index, len(shards))
            path = out / name
            with path.open("wb") as f:
                f.write(safetensors_header(shard, dtype))
                for spec in shard:
                    if merged is not None:
                        tensor = merged(spec)
                    elif spec.shape:
                        tensor = reader.rows(("model", spec.name), slice(0, spec.shape[0]))
                    else:  # a scalar is whole in every part
                        tensor = reader.get("model", spec.name)
                    tensor = tensor.reshape(-1).to(dtype).contiguous()
                    f.write(tensor.view(torch.uint8).numpy())
                    weight_map[spec.name] = name
                    total += spec.nbytes(dtype)
                    del tensor
            fsync_file(path)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")


def write_metadata(source: Path, dtype: torch.dtype, out: Path) -> None:
    """config.json (with the export's dtype), generation_config.json, the tokenizer files."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(source)
    config.dtype = dtype
    config.save_pretrained(out)
    try:
        generation = GenerationConfig.from_pretrained(source)
    except OSError:  # the folder has none: the defaults from the model's config
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def export_checkpoint(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_mb: float = DEFAULT_SHARD_MB,
    lora_format: str = "merged",
) -> Path:
    """Write the policy at checkpoint ``step`` (None: the newest valid) of ``run_dir`` to
    ``out_dir`` as a Hugging Face folder in ``dtype`` (None: the run's model.dtype); of a
    LoRA run, ``lora_format`` ``merged`` or ``adapter`` (a PEFT adapter folder).
    Returns the checkpoint folder used. ExportError (one line) on bad input."""
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    cfg = run_config(run_dir)
    if lora_format not in LORA_FORMATS:
        raise ExportError(f"--lora-format {lora_format!r} is not one of: {', '.join(LORA_FORMATS)}")
    if lora_format == "adapter" and cfg.actor.lora_rank == 0:
        raise ExportError(
            f"--lora-format adapter: {run_dir} trained every weight (actor.lora_rank=0), it has "
            "no adapters; leave --lora-format out"
        )
    name = DTYPE_NAMES.get(dtype or cfg.model.dtype)
    if name is None:
        raise ExportError(f"--dtype {dtype!r} is not one of: {', '.join(DTYPE_NAMES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(
            f"{out_dir} already exists and is not an empty folder; give a new OUT_DIR "
            "(or remove that one)"
        )
    source = model_source(cfg, run_dir)
    candidates = candidate_checkpoints(run_dir, step)
    for i, folder in enumerate(candidates):
        try:
            if lora_format == "adapter":
                write_adapter_folder(folder, source, cfg, out_dir)
            else:
                write_folder(folder, source, DTYPES[name], out_dir, int(max_shard_mb * 2**20), cfg)
            return folder
        except CheckpointError as exc:
            if i + 1 == len(candidates):
                hint = "" if step is not None else "; export an older checkpoint with --step"
                raise ExportError(f"{exc}{hint}") from None
            log.warning("%s; trying an older checkpoint", exc)
            print(f"warning: {exc}; trying an older checkpoint", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def write_folder(
    folder: Path, source: Path, dtype: torch.dtype, out: Path, max_bytes: int, cfg: Config
) -> None:
    """The whole export of checkpoint ``folder`` into a temporary folder, renamed to ``out``."""
    manifest = protocol.check_manifest(folder)
    lora = cfg.actor.lora_rank > 0
    specs = parameter_specs(folder, manifest, source, lora)
    merge = (source, cfg.actor.lora_alpha / cfg.actor.lora_rank) if lora else None

    def write(tmp: Path) -> None:
        write_weights(folder, manifest, specs, dtype, tmp, max_bytes, merge)
        write_metadata(source, dtype, tmp)

    write_atomically(out, write)
    log.info("exported %s to %s (%s)", folder, out, dtype)


def write_adapter_folder(folder: Path, source: Path, cfg: Config, out: Path) -> None:
    """A LoRA checkpoint's adapters as a PEFT adapter folder for the base at ``source``:
    ``adapter_config.json`` and ``adapter_model.safetensors`` (fp32, peft's key names)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    manifest = protocol.check_manifest(folder)
    parameter_specs(folder, manifest, source, lora=True)  # the base checked, names too
    parts = [int(n[len("trainer") : -3]) for n in manifest["parts"] if n.startswith("trainer")]
    tensors = {}
    with protocol.ShardedReader(folder, manifest, parts) as reader:
        for name in reader.keys("model") or []:
            shape = reader.shape(("model", name))
            whole = reader.rows(("model", name), slice(0, shape[0])).float().contiguous()
            tensors["base_model.model." + name.replace(".default.", ".")] = whole
    a = cfg.actor
    # the modules that have adapters, by the last part of their names (as training chose them)
    targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
    config = LoraConfig(
        r=a.lora_rank,
        lora_alpha=a.lora_alpha,
        lora_dropout=a.lora_dropout,
        target_modules=targets,
        base_model_name_or_path=str(source),
        task_type="CAUSAL_LM",
    )

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))

    write_atomically(out, write)
    log.info("exported the LoRA adapters of %s to %s", folder, out)


def write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a temporary folder beside ``out``, fsynced, renamed to ``out``;
    nothing is left behind when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.iterdir():
            fsync_file(path)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty (checked first): rename cannot replace a folder otherwise
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None, prog: str = "python -m hpc_asyncppo.export") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write the policy of a run's checkpoint as a Hugging Face model folder.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (RUN_DIR)")
    parser.add_argument("out_dir", type=Path, help="a new (or empty) folder to write")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: newest valid)"
    )
    parser.add_argument(
        "--dtype", default=None, choices=sorted(DTYPE_NAMES), help="default: the run's model.dtype"
    )
    parser.add_argument(
        "--max-shard-mb", type=float, default=DEFAULT_SHARD_MB, help="largest safetensors file"
    )
    parser.add_argument(
        "--lora-format",
        default="merged",
        choices=LORA_FORMATS,
        help="a LoRA run: the merged model (default) or a PEFT adapter folder",
    )
    args = parser.parse_args(argv)
    if args.max_shard_mb <= 0:
        parser.error(f"--max-shard-mb={args.max_shard_mb} must be > 0")
    try:
        folder = export_checkpoint(
            args.run_dir, args.out_dir, args.step, args.dtype, args.max_shard_mb, args.lora_format
        )
    except (ExportError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"exported {folder} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
