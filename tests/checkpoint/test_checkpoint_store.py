"""hpc_asyncppo.checkpoint.store (one checkpoint file): exact round trips, atomic saves,
corruption detection, model compatibility, RNG states, and no pickle anywhere."""

from __future__ import annotations

import math
import os
import pickle
import random
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from hpc_asyncppo.checkpoint import store
from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    check_compatible,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from tests.harness import REPO


def assert_same(a, b, where="tree"):
    """Equal structure, types, dtypes and bits (NaN included)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(x for x in b if x == k)), f"{where}: key type of {k!r}"
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def every_kind_of_leaf() -> dict:
    g = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=g)
    return {
        "tensors": {
            str(dtype): floats.to(dtype)
            for dtype in (
                torch.float32,
                torch.float16,
                torch.bfloat16,
                torch.float64,
                torch.float8_e4m3fn,
                torch.float8_e5m2,
                torch.complex64,
                torch.complex128,
            )  # fmt: skip
        }
        | {"int64": torch.arange(7), "int8": torch.arange(-3, 3, dtype=torch.int8)}
        | {"uint8": torch.arange(5, dtype=torch.uint8), "bool": floats > 0}
        | {"scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
        | {"strided": floats.t(), "grad": torch.ones(2, requires_grad=True) * 2},
        "numpy": {
            "f32": np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3),
            "big_endian": np.arange(4, dtype=">i4"),
            "bool": np.array([True, False]),
            "complex": np.array([1 + 2j], dtype=np.complex128),
            "scalar": np.float32(2.5),
            "int_scalar": np.int64(-4),
            "zero_d": np.array(7, dtype=np.int16),
        },
        "json": {"none": None, "t": True, "i": -(2**70), "f": 0.1, "nan": float("nan")}
        | {"s": "héllo", "empty_str": "", "list": [1, "a", None, 2.5], "tuple": (0.9, 0.999)}
        | {"empty_list": [], "empty_tuple": (), "empty_dict": {}},
        "keys": {0: "int zero", "0x": 1, 17: {3: "nested int"}, "a/b": 2, ".": 3, "..x": 4}
        | {"%2F": 5, "%empty": 6, "": 7, "ünï": 8},
        "containers": {"mixed": [{"k": 1}, [1, [2]], (torch.ones(1), "x")]},
        "buffers": [np.arange(10, dtype=np.uint8), np.zeros(0, np.uint8), np.ones(3, np.uint8)],
    }


def test_every_kind_of_leaf_round_trips_exactly(tmp_path):
    tree = every_kind_of_leaf()
    meta = {"step": 12, "param_version": 3, "counters": {"trained": 96}}
    save_checkpoint(tmp_path / "c.h5", tree, meta)
    loaded, loaded_meta = load_checkpoint(tmp_path / "c.h5")
    assert loaded_meta == meta
    assert_same(tree, loaded)
    assert loaded["tensors"]["torch.bfloat16"].dtype == torch.bfloat16


def test_bfloat16_is_stored_as_its_uint16_bit_pattern(tmp_path):
    t = torch.tensor([1.5, -0.0, float("inf"), float("nan")], dtype=torch.bfloat16)
    save_checkpoint(tmp_path / "c.h5", {"w": t}, {})
    with h5py.File(tmp_path / "c.h5", "r") as f:
        ds = f["tree/w"]
        assert ds.dtype == np.uint16 and ds.attrs["dtype"] == b"bfloat16"
        assert ds[...].tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()


def test_unsupported_leaf_fails_and_leaves_no_file_nor_litter(tmp_path):
    path = tmp_path / "step" / "c.h5"
    tree = {"model": {"w": torch.ones(1000)}, "bad": object()}
    with pytest.raises(TypeError, match="cannot store tree/bad: object"):
        save_checkpoint(path, tree, {"step": 5})
    assert list(path.parent.iterdir()) == []


def test_failing_save_keeps_the_previous_file_under_the_final_name(tmp_path):
    path = tmp_path / "c.h5"
    save_checkpoint(path, {"w": torch.zeros(3)}, {"step": 1})
    with pytest.raises(TypeError):
        save_checkpoint(path, {"w": torch.ones(3), "bad": {1.5: 2}}, {"step": 2})
    tree, meta = load_checkpoint(path)
    assert meta == {"step": 1} and tree["w"].equal(torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]


def test_save_killed_midway_leaves_the_final_name_untouched(tmp_path):
    path, first = tmp_path / "c2.h5", tmp_path / "c1.h5"
    save_checkpoint(first, {"w": torch.zeros(3)}, {"step": 1})
    script = (
        "import os, torch\n"
        "from hpc_asyncppo.checkpoint import store\n"
        "real = store._Writer.node\n"
        "def node(self, parent, name, value, where):\n"
        "    if where == 'tree/late': os._exit(9)\n"
        "    return real(self, parent, name, value, where)\n"
        "store._Writer.node = node\n"
        f"store.save_checkpoint({str(path)!r}, {{'w': torch.ones(10**5), 'late': 1}}, {{}})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 9, proc.stderr
    assert not path.exists()
    litter = [p for p in tmp_path.iterdir() if p.name.startswith(".c2.h5.tmp-")]
    assert len(litter) == 1  # a checkpoint folder without its manifest is removed whole
    assert load_checkpoint(first)[1] == {"step": 1}


def test_meta_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="meta is not JSON"):
        save_checkpoint(tmp_path / "c.h5", {}, {"step": torch.ones(1)})
    assert list(tmp_path.iterdir()) == []


def test_colliding_keys_are_refused(tmp_path):
    with pytest.raises(TypeError, match="collide"):
        save_checkpoint(tmp_path / "c.h5", {"x": {1: "a", "1": "b"}}, {})


# --- corruption ---------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c7.h5"
    tree = {"model": {"a": torch.randn(64, 64), "b": torch.randn(256).bfloat16()}, "x": [1, 2]}
    save_checkpoint(path, tree, {"step": 7})
    return path


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def data_offset(path, name):
    with h5py.File(path, "r") as f:
        return f[name].id.get_offset()


@pytest.mark.parametrize("name", ["/tree/model/a", "/tree/model/b", "/meta", "/manifest"])
def test_a_flipped_byte_in_a_dataset_names_the_file_and_the_dataset(saved, name):
    flip_byte(saved, data_offset(saved, name) + 3)
    for check in (load_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError) as err:
            check(saved)
        message = str(err.value)
        assert "\n" not in message
        assert str(saved) in message and f"'{name}'" in message and "checksum" in message


def test_large_datasets_are_checksummed_per_block(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "CRC_BLOCK", 1000)
    path = tmp_path / "c.h5"
    save_checkpoint(path, {"w": torch.arange(2600, dtype=torch.int8)}, {})
    with h5py.File(path, "r") as f:
        assert f["tree/w"].attrs["crc32"].shape == (3,) and f["tree/w"].attrs["crc32_block"] == 1000
    monkeypatch.setattr(store, "CRC_BLOCK", 64 << 20)  # the reader follows the file
    assert load_checkpoint(path)[0]["w"].equal(torch.arange(2600, dtype=torch.int8))
    flip_byte(path, data_offset(path, "/tree/w") + 2500)
    with pytest.raises(CheckpointError, match=r"'/tree/w' fails its checksum \(block 2: "):
        load_checkpoint(path)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.3, 0.9])
def test_a_truncated_file_is_detected(saved, keep_fraction):
    size = saved.stat().st_size
    os.truncate(saved, int(size * keep_fraction) if keep_fraction else size - 1)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(saved)
    assert str(saved) in str(err.value) and "\n" not in str(err.value)


def test_random_byte_flips_never_load_wrong_data(saved):
    """Anywhere in the file, a flipped byte is either detected or changes nothing read."""
    original, _ = load_checkpoint(saved)
    clean = saved.read_bytes()
    rng = random.Random(0)
    detected = 0
    for offset in rng.sample(range(len(clean)), 150):
        flip_byte(saved, offset)
        try:
            tree, _ = load_checkpoint(saved)
            assert_same(original, tree)
        except CheckpointError as exc:
            assert str(saved) in str(exc) and "\n" not in str(exc)
            detected += 1
        saved.write_bytes(clean)
    assert detected > 50


def test_a_deleted_dataset_is_reported_missing(saved):
    with h5py.File(saved, "r+") as f:
        del f["tree/model/b"]
    with pytest.raises(CheckpointError, match=r"dataset '/tree/model/b' is missing"):
        verify_checkpoint(saved)


def test_other_files_and_versions_are_refused(tmp_path, saved):
    not_hdf5 = tmp_path / "junk.h5"
    not_hdf5.write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(CheckpointError, match=r"junk.h5: unreadable HDF5"):
        load_checkpoint(not_hdf5)
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "absent.h5")
    with h5py.File(saved, "r+") as f:
        f.attrs["format_version"] = np.int64(99)
    with pytest.raises(CheckpointError, match="format version 99, this code reads 1"):
        load_checkpoint(saved)


def test_the_file_checksum_is_what_verify_recomputes(tmp_path):
    checksum = save_checkpoint(tmp_path / "c.h5", every_kind_of_leaf(), {"step": 1})
    assert verify_checkpoint(tmp_path / "c.h5") == checksum
    other = save_checkpoint(tmp_path / "d.h5", {"w": torch.ones(3)}, {"step": 1})
    assert other != checksum


# --- no pickle ------------------------------------------------------------------------------


def test_file_holds_only_plain_numbers_and_fixed_strings(tmp_path):
    save_checkpoint(tmp_path / "c.h5", every_kind_of_leaf(), {"step": 1})
    kinds: set[str] = set()

    def check(name, obj):
        if isinstance(obj, h5py.Dataset):
            assert obj.dtype.kind in "iuf", f"{name}: {obj.dtype}"
            kinds.add(obj.dtype.kind)
        for attr in obj.attrs:
            dtype = obj.attrs.get_id(attr).dtype  # "S": fixed-length bytes, never vlen/object
            assert dtype.kind in "iuS", f"{name}@{attr}: {dtype}"

    with h5py.File(tmp_path / "c.h5", "r") as f:
        check("/", f)
        f.visititems(check)
    assert kinds == {"i", "u", "f"}


def test_loading_never_unpickles(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "c.h5", every_kind_of_leaf(), {"step": 1})

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for target, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                         (torch, "load"), (np, "load")]:  # fmt: skip
        monkeypatch.setattr(target, name, refuse)
    tree, _ = load_checkpoint(tmp_path / "c.h5")
    assert_same(every_kind_of_leaf(), tree)


# --- compatibility with a model -----------------------------------------------------------


def test_check_compatible_names_the_first_tensor_that_differs():
    model = {"embed": torch.zeros(10, 4), "up": torch.zeros(256, 64), "down": torch.zeros(64, 256)}
    ckpt = {"embed": torch.zeros(10, 4), "up": torch.zeros(128, 64), "down": torch.zeros(64, 128)}
    with pytest.raises(CheckpointError) as err:
        check_compatible(ckpt, model.items(), source="run/ckpt_00000001.h5")
    assert str(err.value) == (
        "checkpoint run/ckpt_00000001.h5: tensor 'up' has shape (128, 64), the model has (256, 64)"
    )
    with pytest.raises(
        CheckpointError, match="tensor 'embed' has dtype bfloat16, the model has float32"
    ):
        check_compatible({**model, "embed": torch.zeros(10, 4, dtype=torch.bfloat16)}, model)
    with pytest.raises(CheckpointError, match="has no tensor 'down', which the model has"):
        check_compatible({"embed": model["embed"], "up": model["up"]}, model)
    with pytest.raises(CheckpointError, match="has tensor 'extra', which the model does not have"):
        check_compatible({**model, "extra": torch.zeros(1)}, model)
    check_compatible({k: v.numpy() for k, v in model.items()}, model)


# --- RNG states -----------------------------------------------------------------------------


def draws() -> list:
    return [
        random.random(), random.gauss(0, 1), random.getrandbits(64),
        np.random.rand(3).tolist(), np.random.normal(size=2).tolist(),
        torch.rand(3).tolist(), torch.randn(2).tolist(),
    ]  # fmt: skip


def test_rng_state_round_trip_reproduces_the_same_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.normal()  # and in NumPy's
    save_checkpoint(tmp_path / "rng.h5", {"rng": rng_state()}, {})
    expected = draws()
    draws()  # move every generator on
    tree, _ = load_checkpoint(tmp_path / "rng.h5")
    set_rng_state(tree["rng"])
    assert draws() == expected


def test_fsync_dir_tolerates_filesystems_that_refuse(monkeypatch, tmp_path):
    def einval(fd):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(store.os, "fsync", einval)
    store.fsync_dir(tmp_path)
