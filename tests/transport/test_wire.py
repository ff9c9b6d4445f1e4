import numpy as np
import pytest

from hpc_asyncppo.transport.arrays import WireError, pack_arrays, unpack_arrays
from hpc_asyncppo.transport.samples import SampleGroup, decode_group, encode_group


def make_group(n=3, length=5, prompt=4) -> SampleGroup:
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


def test_group_round_trip_is_exact():
    group = make_group()
    back = decode_group(encode_group(group))
    for name in (
        "seed",
        "epoch",
        "prompt_index",
        "rollout_rank",
        "param_version_start",
        "param_version_end",
    ):
        assert getattr(back, name) == getattr(group, name)
    assert back.rollout_idle_s == 1.5 and back.rollout_elapsed_s == 10.25
    for name in ("prompt_ids", "response_ids", "response_lengths", "rollout_log_probs", "rewards"):
        np.testing.assert_array_equal(getattr(back, name), getattr(group, name))
        assert getattr(back, name).dtype == getattr(group, name).dtype


def test_a_multi_turn_groups_loss_mask_travels_and_single_turn_bytes_do_not_change():
    import dataclasses

    from hpc_asyncppo.trainer.batch import collate

    plain = make_group()
    mask = np.ones((3, 5), dtype=np.int8)
    mask[0, 1:3] = 0  # response 0: tokens 1-2 are a tool's answer
    multi = dataclasses.replace(plain, loss_mask=mask)
    assert decode_group(encode_group(plain)).loss_mask is None
    back = decode_group(encode_group(multi))
    np.testing.assert_array_equal(back.loss_mask, mask)
    assert len(encode_group(multi)) > len(encode_group(plain))
    # collate: the holes leave the trained mask, not the model's attention
    batch = collate([back, plain], np.zeros((2, 3)), pad_id=0)
    lengths = np.array([5, 2, 1] * 2)
    attention = (np.arange(5)[None] < lengths[:, None]).astype(np.int8)
    np.testing.assert_array_equal(batch["response_attention"], attention)
    expected = attention.copy()
    expected[0, 1:3] = 0
    np.testing.assert_array_equal(batch["response_mask"], expected)
    assert "response_attention" not in collate([plain], np.zeros((1, 3)), pad_id=0)


def test_uids_are_unique_per_response_and_deterministic():
    group = make_group()
    assert [group.uid(j) for j in range(3)] == [
        "s7-e2-p1234-r0",
        "s7-e2-p1234-r1",
        "s7-e2-p1234-r2",
    ]


def test_arrays_keep_dtype_shape_and_meta():
    arrays = {
        "a": np.arange(6, dtype=np.int64).reshape(2, 3),
        "b": np.array([1.5], dtype=np.float16),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "flags": np.array([True, False]),
    }
    buf = pack_arrays(arrays, {"step": 3, "stop": False})
    assert buf.dtype == np.uint8
    back, meta = unpack_arrays(buf)
    assert meta == {"step": 3, "stop": False}
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype and back[k].shape == v.shape


def test_object_arrays_never_travel():
    with pytest.raises(TypeError, match="only numeric arrays"):
        pack_arrays({"x": np.array([object()])})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:3], "bad magic"),
        (lambda b: np.concatenate([np.frombuffer(b"XXXX", np.uint8), b[4:]]), "bad magic"),
        (lambda b: b[:-8], "runs past the end"),
    ],
)
def test_malformed_buffers_are_rejected(mutate, message):
    buf = encode_group(make_group())
    with pytest.raises(WireError, match=message):
        decode_group(mutate(buf))


def test_a_senders_reason_to_drop_and_agents_numbers_travel_and_other_groups_bytes_do_not_change():
    import dataclasses

    plain = make_group()
    dropped = dataclasses.replace(plain, dropped="agent failed: session s7-e2-p1234-r0: raised")
    assert decode_group(encode_group(plain)).dropped == ""
    assert decode_group(encode_group(dropped)).dropped == dropped.dropped
    extra = dataclasses.replace(plain, agent_extra={"tool_calls": 1.25, "turns": 3.0})
    assert decode_group(encode_group(extra)).agent_extra == {"tool_calls": 1.25, "turns": 3.0}
    assert decode_group(encode_group(plain)).agent_extra == {}
    unpacked = unpack_arrays(encode_group(plain))[1]
    assert not {"dropped", "tool_calls", "agent_extra"} & set(unpacked)
    assert "engine_restarts" in unpacked  # sent even when 0, as before
