"""A real tiny HF Llama and its AdamW state survive a checkpoint bit for bit, and training
continues identically from the loaded copy."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    check_compatible,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

VOCAB = 50


def tiny_llama(dtype: torch.dtype, hidden: int = 32, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).to(dtype)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def train_step(model, optimizer, scheduler) -> None:
    # The batch comes from the global RNG, so a resume must restore it to see the same data.
    ids = torch.randint(0, VOCAB, (3, 12))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()


def make(dtype):
    model = tiny_llama(dtype)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0, end_factor=0.1, total_iters=10
    )
    return model, optimizer, scheduler


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(
            a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)
        ), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_and_adamw_resume_bit_exactly(tmp_path, dtype):
    torch.manual_seed(0)
    model, optimizer, scheduler = make(dtype)
    for _ in range(3):
        train_step(model, optimizer, scheduler)
    tree = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
    }
    save_checkpoint(tmp_path / "ckpt.h5", tree, {"step": 3, "param_version": 1})

    loaded, meta = load_checkpoint(tmp_path / "ckpt.h5")
    assert meta == {"step": 3, "param_version": 1}
    assert_bitwise_equal(model.state_dict(), loaded["model"])
    state = optimizer.state_dict()["state"]
    assert list(loaded["optimizer"]["state"]) == list(state)  # int keys, in order
    for index, entry in state.items():
        assert_bitwise_equal(entry, loaded["optimizer"]["state"][index])
    assert loaded["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]

    # The original run goes on; its RNG continues from the state that was saved.
    for _ in range(2):
        train_step(model, optimizer, scheduler)

    # A fresh process: other initial weights, another RNG state, then the checkpoint.
    resumed, resumed_opt, resumed_sched = make(dtype)
    torch.manual_seed(12345)
    check_compatible(loaded["model"], resumed.named_parameters())
    resumed.load_state_dict(loaded["model"])
    resumed_opt.load_state_dict(loaded["optimizer"])
    resumed_sched.load_state_dict(loaded["scheduler"])
    set_rng_state(loaded["rng"])
    for _ in range(2):
        train_step(resumed, resumed_opt, resumed_sched)
    assert_bitwise_equal(model.state_dict(), resumed.state_dict())
    for index, entry in optimizer.state_dict()["state"].items():
        assert_bitwise_equal(entry, resumed_opt.state_dict()["state"][index])


def test_a_checkpoint_of_another_model_shape_is_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt.h5", {"model": tiny_llama(torch.float32).state_dict()}, {})
    loaded, _ = load_checkpoint(tmp_path / "ckpt.h5")
    wider = tiny_llama(torch.float32, hidden=64)
    with pytest.raises(CheckpointError) as err:
        check_compatible(loaded["model"], wider.named_parameters(), source=tmp_path / "ckpt.h5")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'ckpt.h5'}: tensor 'model.embed_tokens.weight' has shape "
        "(50, 32), the model has (50, 64)"
    )
