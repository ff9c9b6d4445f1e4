"""Packed rows (``model.use_remove_padding``) on small Llama and Qwen2 models: every output
equals the padded batch's, so no row attends to another and no real token is lost or
moved. The update's gradients with packing are checked against the padded path in
``test_policy.py`` (its packed splits)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hpc_asyncppo.trainer.model import PolicyModule, packed_rows

ARCHITECTURES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"num_key_value_heads": 1}),  # q/k/v biases, GQA
}


def tiny(arch: str, dtype: torch.dtype = torch.float32) -> PolicyModule:
    model_cls, config_cls, extra = ARCHITECTURES[arch]
    config = config_cls(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=128, attn_implementation="sdpa", **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return PolicyModule(model_cls(config), torch.nn.Linear(32, 1)).to(dtype)


def long_tail_batch(holes: bool = False) -> dict[str, torch.Tensor]:
    """Six rows: prompts of 1-6 tokens (left-padded), responses of 1-20 (right-padded), one
    far longer than the rest. ``holes``: tokens 2-4 of the long responses are an
    observation (context, not trained), as multi-turn rows are."""
    prompt_lengths = torch.tensor([3, 6, 1, 4, 5, 2])
    response_lengths = torch.tensor([20, 1, 5, 3, 2, 4])
    width, length = 6, 20
    prompt_mask = (torch.arange(width)[None] >= width - prompt_lengths[:, None]).float()
    response_mask = (torch.arange(length)[None] < response_lengths[:, None]).float()
    gen = torch.Generator().manual_seed(1)
    batch = {
        "prompt_ids": torch.randint(4, 24, (6, width), generator=gen) * prompt_mask.long(),
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(4, 24, (6, length), generator=gen) * response_mask.long(),
        "response_mask": response_mask,
    }
    if holes:
        trained = response_mask.clone()
        trained[response_lengths >= 5, 2:5] = 0
        batch["response_attention"], batch["response_mask"] = response_mask, trained
    return batch


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("holes", [False, True])
def test_packed_rows_give_the_padded_outputs(arch, holes):
    module, batch = tiny(arch), long_tail_batch(holes)
    seen = batch.get("response_attention", batch["response_mask"])
    with torch.no_grad():
        padded = module(batch, 0.7, 16, with_entropy=True, with_values=True)
        packed = module(batch, 0.7, 16, with_entropy=True, with_values=True, packed=True)
    for name, a, b in zip(("log-probs", "entropy", "values"), padded, packed, strict=True):
        torch.testing.assert_close(b * seen, a * seen, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.all(b[seen == 0] == 0), name  # nothing past a response's end


def test_packed_rows_in_bf16_stay_within_bf16_of_the_padded_path():
    module, batch = tiny("qwen2", torch.bfloat16), long_tail_batch()
    mask = batch["response_mask"]
    with torch.no_grad():
        padded = module(batch, 1.0, 16)[0]
        packed = module(batch, 1.0, 16, packed=True)[0]
    assert float(((packed - padded) * mask).abs().max()) < 0.05  # bf16: 8 bits of mantissa


@pytest.mark.parametrize("one_sequence", [False, True])
def test_the_packed_layout_holds_every_real_token_once_and_no_more(one_sequence):
    batch = long_tail_batch(holes=True)
    input_ids, position_ids, before, real = packed_rows(batch, one_sequence)
    rows = batch["prompt_mask"].sum(dim=1) + batch["response_attention"].sum(dim=1)
    if one_sequence:
        assert input_ids.shape == (1, int(rows.sum()))
    else:  # bins as long as the longest row (23), filled first-fit: 23 | 7 7 7 | 6 6
        assert input_ids.shape == (3, int(rows.max()))
    assert int((position_ids == 0).sum()) >= len(rows)  # each row (and filler) restarts
    # the token after each ``before`` position is the response token it predicts
    flat = input_ids.reshape(-1)
    assert torch.equal(flat[before + 1], batch["response_ids"][real])
    assert int(real.sum()) == before.numel() == int(batch["response_attention"].sum())


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_one_packed_sequence_gives_the_padded_hidden_states(arch):
    """The flash-attention form (every row in one sequence) through the same model: the
    state before each response token is the padded batch's."""
    module, batch = tiny(arch), long_tail_batch()
    base = module.lm.model
    input_ids, position_ids, before, real = packed_rows(batch, one_sequence=True)
    attention = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    with torch.no_grad():
        packed = base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        padded = base(
            input_ids=torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1),
            attention_mask=attention,
            position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
            use_cache=False,
        )
    width = batch["prompt_ids"].shape[1]
    expected = padded.last_hidden_state[:, width - 1 : -1][real]
    torch.testing.assert_close(packed.last_hidden_state[0, before], expected, atol=1e-5, rtol=1e-5)
