"""The checkpoint protocol: parts committed by a manifest, listing and pruning, broken parts
named in one line, and a sharded trainer state written by 2 ranks and read back by 1 and 3
(real gloo processes, real HDF5 parts), bit for bit."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import CheckpointError
from hpc_asyncppo.config import Config
from hpc_asyncppo.trainer.batch import shard_rows, to_tensors
from tests.conftest import end_spawned_rank, free_port

# --- committing, listing, pruning ----------------------------------------------------------


def write_step(run_dir: Path, step: int, commit: bool = True) -> Path:
    folder = protocol.step_dir(run_dir, step)
    parts = [
        protocol.write_part(folder, protocol.trainer_part(0), {"w": torch.full((4,), step)}),
        protocol.write_part(folder, protocol.rollout_part(0), {"cursor": {"epoch": 0}}),
    ]
    if commit:
        protocol.commit(folder, parts, {"step": step, "train_ranks": 1, "rollout_ranks": 1})
    return folder


def test_a_checkpoint_exists_once_its_manifest_does(tmp_path):
    write_step(tmp_path, 1)
    write_step(tmp_path, 100_000_000)
    write_step(tmp_path, 5, commit=False)  # killed before the commit
    names = [p.name for p in protocol.list_checkpoints(tmp_path)]
    assert names == ["step_100000000", "step_00000001"]
    assert protocol.list_checkpoints(tmp_path / "nowhere") == []
    manifest = protocol.verify_all(protocol.step_dir(tmp_path, 1))
    assert set(manifest["parts"]) == {"trainer0.h5", "rollout0.h5"} and manifest["step"] == 1


def test_prune_keeps_the_newest_and_removes_uncommitted_folders(tmp_path):
    for step in (1, 2, 3):
        write_step(tmp_path, step)
    write_step(tmp_path, 4, commit=False)
    removed = protocol.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000004"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_00000002", "step_00000003"]
    with pytest.raises(ValueError):
        protocol.prune(tmp_path, keep=0)


def test_a_missing_short_or_corrupt_part_is_named_in_one_line(tmp_path):
    folder = write_step(tmp_path, 1)
    part = folder / "trainer0.h5"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    part.write_bytes(bytes(raw))
    protocol.check_manifest(folder)  # sizes only: still fine
    with pytest.raises(CheckpointError, match="trainer0.h5") as bad:
        protocol.verify_all(folder)
    assert "\n" not in str(bad.value)
    os.truncate(part, 100)
    with pytest.raises(CheckpointError, match="part trainer0.h5 has 100 bytes"):
        protocol.check_manifest(folder)
    (folder / "rollout0.h5").unlink()
    with pytest.raises(CheckpointError, match="part rollout0.h5 is missing"):
        protocol.check_parts(folder, protocol.read_manifest(folder), ["rollout0.h5"], False)


def test_a_single_file_checkpoint_of_the_old_format_says_what_to_do(tmp_path):
    legacy = tmp_path / "checkpoints" / "ckpt_00000007.h5"
    legacy.parent.mkdir()
    legacy.write_bytes(b"old")
    assert protocol.list_checkpoints(tmp_path) == [legacy]
    with pytest.raises(CheckpointError, match="earlier format: resume it with"):
        protocol.check_manifest(legacy)


@pytest.mark.parametrize(("old", "new"), [(2, 1), (2, 3), (3, 2), (4, 4), (1, 4)])
def test_overlapping_parts_cover_every_row(old, new):
    for rows in range(1, 40):
        per_old, per_new = -(-rows // old), -(-rows // new)
        for rank in range(new):
            start, stop = min(rank * per_new, rows), min((rank + 1) * per_new, rows)
            needed = {r // per_old for r in range(start, stop)}
            assert needed <= set(protocol.overlapping_parts(rank, new, old)), (rows, rank)


# --- a sharded state, written by 2 ranks, read by 1 and 3 ---------------------------------


def make_batch(rows: int = 24, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, rows)
    return {
        "prompt_ids": rng.integers(4, 15, (rows, 3)).astype(np.int32),
        "prompt_mask": np.ones((rows, 3), dtype=np.int8),
        "response_ids": rng.integers(4, 15, (rows, 6)).astype(np.int32),
        "response_mask": (np.arange(6)[None] < lengths[:, None]).astype(np.int8),
        "rollout_log_probs": -rng.random((rows, 6)).astype(np.float32),
        "rewards": rng.random(rows).astype(np.float32),
        "advantages": rng.normal(size=rows).astype(np.float32),
    }


def full_state(policy) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state tensor, whole (collective)."""
    from hpc_asyncppo.trainer.model import gather_full

    out = {}
    params = list(policy.module.named_parameters())
    for name, p in params:
        out[f"param/{name}"] = gather_full(p.detach()).numpy().copy()
    for index, (_, p) in enumerate(params):
        for key, value in policy.optimizer.state[p].items():
            out[f"optim/{index}/{key}"] = gather_full(value).numpy().copy()
    out["schedule"] = np.array([policy.schedule.updates])
    return out


def _worker(rank: int, world: int, port: int, model_dir: str, folder: str, out: str) -> None:
    from hpc_asyncppo.checkpoint.protocol import restore_trainer_part, write_trainer_part
    from hpc_asyncppo.trainer.policy import Policy, ppo_update, trainer_states

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    torch.set_num_threads(1)
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=model_dir),
        algorithm=dataclasses.replace(cfg.algorithm, adv_estimator="gae"),  # + the value head
    )
    policy = Policy(cfg, torch.device("cpu"))
    folder_path = Path(folder)
    if world == 2:  # the writer: train two steps, write the parts, commit
        for seed in (1, 2):
            ppo_update(policy, to_tensors(shard_rows(make_batch(seed=seed), 2, 1)[rank], "cpu"))
        part = write_trainer_part(folder_path, trainer_states(policy), rank)
        Path(out, f"part{rank}.json").write_text(json.dumps(part.to_json()))
        dist.barrier()
        if rank == 0:
            infos = [
                protocol.PartInfo.from_json(json.loads(Path(out, f"part{r}.json").read_text()))
                for r in range(2)
            ]
            protocol.commit(folder_path, infos, {"step": 2, "train_ranks": 2, "rollout_ranks": 1})
    else:
        restore_trainer_part(folder_path, trainer_states(policy), rank, world)
    state = full_state(policy)
    if rank == 0:
        np.savez(Path(out) / f"state-{world}.npz", **state)
    end_spawned_rank()


def test_two_ranks_state_reads_back_bit_for_bit_on_one_and_three(tiny_model_dir, tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder = tmp_path / "checkpoints" / "step_00000002"
    for world in (2, 1, 3):
        mp.start_processes(
            _worker,
            args=(world, free_port(), str(tiny_model_dir), str(folder), str(tmp_path)),
            nprocs=world,
            start_method="spawn",
        )
    manifest = json.loads((folder / protocol.MANIFEST).read_text())
    assert sorted(manifest["parts"]) == ["trainer0.h5", "trainer1.h5"]
    written = np.load(tmp_path / "state-2.npz")
    assert any(k.startswith("optim/") for k in written.files)
    for world in (1, 3):
        read = np.load(tmp_path / f"state-{world}.npz")
        assert set(read.files) == set(written.files)
        for key in written.files:
            assert np.array_equal(read[key], written[key]), (world, key)
    whole = protocol.read_full(folder, "model")
    assert np.array_equal(
        whole["model.embed_tokens.weight"].numpy(), written["param/lm.model.embed_tokens.weight"]
    )
