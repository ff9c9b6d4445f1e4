import numpy as np
import pytest

from hpc_asyncppo.transport.arrays import WireError, pack_arrays, unpack_arrays
from hpc_asyncppo.transport.samples import decode_group, encode_group
from tests.conftest import branched_group, make_group


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


def test_a_session_in_several_sequences_trains_each_with_its_sessions_reward_and_advantage():
    from hpc_asyncppo.trainer.batch import collate

    group = branched_group()
    back = decode_group(encode_group(group))
    np.testing.assert_array_equal(back.row_sessions, group.row_sessions)
    np.testing.assert_array_equal(back.row_prompts, group.row_prompts)
    assert decode_group(encode_group(make_group())).row_sessions is None
    assert back.n == 3 and back.rows == 6 and back.last_rows().tolist() == [4, 1, 5]
    assert [back.uid(r) for r in range(6)] == [
        "s7-e2-p1234-r0", "s7-e2-p1234-r1", "s7-e2-p1234-r2",
        "s7-e2-p1234-r0.s1", "s7-e2-p1234-r0.s2", "s7-e2-p1234-r2.s1",
    ]  # fmt: skip
    advantages = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    rewards = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    # 6 + 3 rows, padded to 12 (a multiple of 4) with 3 empty rows
    batch = collate([back, make_group()], advantages, pad_id=0, rewards=rewards, multiple=4)
    assert batch["advantages"].tolist() == [1, 2, 3, 1, 1, 3, 4, 5, 6, 0, 0, 0]
    np.testing.assert_allclose(batch["rewards"], [0.1, 0.2, 0.3, 0.1, 0.1, 0.3, 0.4, 0.5,
                                                   0.6, 0, 0, 0])  # fmt: skip
    # each row its own prompt, left-padded to the longest (6)
    sizes = [4, 4, 4, 2, 6, 3, 4, 4, 4, 4, 4, 4]
    assert batch["prompt_mask"].sum(axis=1).tolist() == sizes
    assert batch["prompt_ids"][4].tolist() == group.row_prompts[4].tolist()
    assert batch["prompt_ids"][3, 4:].tolist() == group.row_prompts[3, :2].tolist()
    # the empty rows train nothing and are attended as a real row (no all-masked softmax)
    assert batch["response_mask"][9:].sum() == 0
    assert batch["response_mask"][:9].sum(axis=1).tolist() == [5, 2, 1, 3, 4, 5, 5, 2, 1]
    assert batch["response_attention"][9:].sum(axis=1).tolist() == [1, 1, 1]
    assert "response_attention" not in collate([back], advantages[:1], pad_id=0)


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
