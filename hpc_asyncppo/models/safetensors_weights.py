"""A Hugging Face folder's weights read tensor by tensor (and row by row) from its
safetensors files, never the whole model at once: the trainer ranks read their shards'
rows, a rollout worker's LoRA merge and the export one base tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class SafetensorsWeights:
    """Reads rows of tensors from an HF folder's safetensors files (one file or an index)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            mapping = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in mapping.items()}
        elif (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", "pt") as f:
                self.files = {name: folder / "model.safetensors" for name in f.keys()}  # noqa: SIM118
        else:
            raise ValueError(f"model.path={str(folder)!r} has no model.safetensors (or its index)")

    def read(self, name: str, rows: slice | None) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"the model's safetensors files have no tensor {name!r}")
        with safe_open(self.files[name], "pt") as f:
            part = f.get_slice(name)
            return part[rows] if rows is not None and part.get_shape() else part[:]
