"""A rank's own state as one no-pickle message: its RNGs plus a few JSON fields.

Rollout ranks and trainer followers send it to the trainer leader when a checkpoint is
taken (the leader writes the one file); every rank restores its part on resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hpc_asyncppo.checkpoint.store import rng_state
from hpc_asyncppo.transport.arrays import pack_arrays, unpack_arrays


def encode_rank_state(fields: dict[str, Any]) -> np.ndarray:
    """``fields`` (JSON) and this process's RNG states, packed for the wire."""
    rng = rng_state()
    arrays = {
        "python_mt": np.asarray(rng["python"]["mt"], dtype=np.int64),
        "numpy_keys": np.asarray(rng["numpy"]["keys"]),
        "torch": rng["torch"].numpy(),
    }
    for i, state in enumerate(rng.get("cuda", [])):
        arrays[f"cuda{i}"] = state.cpu().numpy()
    meta = {
        "fields": fields,
        "python": {"version": rng["python"]["version"], "gauss": rng["python"]["gauss"]},
        "numpy": {k: rng["numpy"][k] for k in ("name", "pos", "has_gauss", "cached_gaussian")},
        "cuda_count": len(rng.get("cuda", [])),
    }
    return pack_arrays(arrays, meta)


def decode_rank_state(buf: np.ndarray) -> tuple[dict[str, Any], dict]:
    """(fields, rng tree in ``rng_state``'s layout, ready for a checkpoint)."""
    arrays, meta = unpack_arrays(buf)
    rng = {
        "python": {**meta["python"], "mt": arrays["python_mt"].copy()},
        "numpy": {**meta["numpy"], "keys": arrays["numpy_keys"].copy()},
        "torch": torch.from_numpy(arrays["torch"].copy()),
    }
    if meta["cuda_count"]:
        rng["cuda"] = [
            torch.from_numpy(arrays[f"cuda{i}"].copy()) for i in range(meta["cuda_count"])
        ]
    return meta["fields"], rng
