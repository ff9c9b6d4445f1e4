import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_asyncppo.config import Config, ModelConfig, RolloutConfig
from hpc_asyncppo.models import lora
from hpc_asyncppo.rollout.generation import response_lengths
from hpc_asyncppo.rollout.hf_engine import HFEngine, left_pad
from hpc_asyncppo.rollout.resident_batch import ResidentBatch, filtered, sample_tokens
from hpc_asyncppo.trainer.policy import Policy

CPU = torch.device("cpu")


def test_left_pad_right_aligns_prompts():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_response_length_includes_the_first_eos_only():
    eos = 2
    responses = torch.tensor([[4, 2, 5, 2], [4, 4, 4, 4], [2, 0, 0, 0]])
    assert response_lengths(responses, eos).tolist() == [2, 4, 1]


def engine_and_policy(model_dir, temperature=1.0, response_length=6, **rollout):
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(
            temperature=temperature, response_length=response_length, n=4, **rollout
        ),
    )
    return cfg, HFEngine(cfg.model, cfg.rollout, CPU), Policy(cfg, CPU)


def test_responses_are_padded_after_eos_and_within_length(tiny_model_dir):
    cfg, engine, _ = engine_and_policy(tiny_model_dir)
    torch.manual_seed(0)
    gens = engine.generate([engine.encode("1 2 ="), engine.encode("3 =")], n=4)
    for gen in gens:
        assert gen.response_ids.shape == (4, 6) and gen.log_probs.shape == (4, 6)
        for ids, length, lp in zip(
            gen.response_ids, gen.response_lengths, gen.log_probs, strict=True
        ):
            assert 1 <= length <= 6
            assert (ids[length:] == engine.pad_id).all() and (lp[length:] == 0).all()
            assert (lp[:length] < 0).all()
            eos_positions = np.flatnonzero(ids[:length] == engine.eos_id)
            assert eos_positions.size == 0 or eos_positions.tolist() == [length - 1]


def test_rollout_log_probs_match_the_trainers_recomputation(tiny_model_dir, log_probs_of):
    """Same weights, same tokens: the behaviour log-probs equal the trainer's (fp32, 1e-5)."""
    for temperature in (1.0, 0.7):
        cfg, engine, policy = engine_and_policy(tiny_model_dir, temperature=temperature)
        torch.manual_seed(1)
        prompts = [engine.encode("1 2 3 4 ="), engine.encode("9 ="), engine.encode("5 5 =")]
        gens = engine.generate(prompts, n=4)
        trainer_lp, rollout_lp, mask = log_probs_of(policy, prompts, gens, engine.pad_id)
        diff = (trainer_lp - rollout_lp).abs()[mask]
        assert diff.max().item() < 1e-5, f"temperature {temperature}: max diff {diff.max().item()}"


@pytest.mark.parametrize("step_tokens", [0, 2])
def test_a_calls_top_log_probs_are_the_models_most_likely_tokens_at_each_place(
    tiny_model_dir, alternatives_match, step_tokens
):
    """A gateway call's ``top_logprobs`` (``Response.top``), in one ``generate`` call a
    turn or a few tokens a step: each sampled token's rivals are the model's most likely
    tokens at its place, at the sampled token's log-prob quantity; rows that did not ask
    keep none."""
    _, engine, _ = engine_and_policy(tiny_model_dir, temperature=0.7, hf_step_tokens=step_tokens)
    torch.manual_seed(2)
    prompt = engine.encode("1 2 3 4 =")
    engine.submit("g", prompt, 4)
    responses = engine.groups["g"].responses
    for r in responses[:2]:
        r.top = 3
    while engine.in_flight:
        engine.step()
    assert all(r.alternatives == {} for r in responses[2:])
    for r in responses[:2]:
        alternatives_match(tiny_model_dir, prompt, r, 0.7, 3, 1e-5)


def test_loaded_weights_change_the_engine(tiny_model_dir):
    _, engine, policy = engine_and_policy(tiny_model_dir)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.to_local().add_(0.5)  # the policy's own (one-rank) shard
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()})
    for (name, mine), (_, theirs) in zip(
        engine.named_parameters(), policy.named_weights(), strict=True
    ):
        assert torch.equal(mine, theirs), name


def test_mismatched_weights_are_refused(tiny_model_dir):
    _, engine, policy = engine_and_policy(tiny_model_dir)
    tensors = {n: t.clone() for n, t in policy.named_weights()}
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3)
    try:
        engine.load_weights(tensors)
    except ValueError as exc:
        assert name in str(exc)
    else:
        raise AssertionError("a wrongly shaped tensor was accepted")


def test_greedy_groups_are_the_argmax_and_run_beside_sampled_ones(tiny_model_dir):
    """Validation's greedy groups (temperature 0) share a step with sampled training groups;
    every greedy response is the model's argmax continuation."""
    _, engine, _ = engine_and_policy(tiny_model_dir)
    prompt = engine.encode("4 7 =")
    engine.submit("sampled", prompt, 4)
    engine.submit("greedy", prompt, 3, temperature=0.0)
    done = dict(engine.step())
    assert done["sampled"].response_ids.shape == (4, 6)
    greedy = done["greedy"]
    assert (greedy.response_ids == greedy.response_ids[0]).all()
    length = int(greedy.response_lengths[0])
    response = greedy.response_ids[0, :length].tolist()
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0]
    assert logits[len(prompt) - 1 : len(prompt) - 1 + length].argmax(-1).tolist() == response


def test_steps_of_a_few_tokens_let_groups_join_and_continue_as_one_call_would(
    tiny_model_dir, log_probs_of
):
    """rollout.hf_step_tokens=2: a step samples two tokens of every response in flight; a
    group submitted between steps joins the next; the responses continued over three steps
    are, greedy, token for token what one call to their end samples, with its log-probs.
    New weights loaded between two steps take over at once: the tokens after the load carry
    the new version and are the trainer's under the new weights (the continuation reads its
    context again; nothing of the old weights' is kept)."""
    _, whole, _ = engine_and_policy(tiny_model_dir, 0.0, ignore_eos=True)
    policy = engine_and_policy(tiny_model_dir)[2]  # temperature 1: a greedy token's log-prob's
    _, engine, _ = engine_and_policy(tiny_model_dir, 0.0, ignore_eos=True, hf_step_tokens=2)
    prompts = {"a": engine.encode("1 2 3 ="), "b": engine.encode("9 =")}
    engine.submit("a", prompts["a"], 4)
    assert engine.step() == [] and engine.in_flight == 1
    assert [len(r.tokens) for r in engine.groups["a"].responses] == [2] * 4
    engine.submit("b", prompts["b"], 4)  # joins a's second step, as its own first
    assert engine.step() == [] and engine.in_flight == 2
    assert [len(r.tokens) for g in engine.groups.values() for r in g.responses] == [4] * 4 + [2] * 4
    done = dict(engine.step())
    assert list(done) == ["a"] and engine.in_flight == 1
    expected = dict(zip(prompts, whole.generate(list(prompts.values()), n=4), strict=True))
    np.testing.assert_array_equal(done["a"].response_ids, expected["a"].response_ids)
    np.testing.assert_allclose(done["a"].log_probs, expected["a"].log_probs, atol=1e-5)

    with torch.no_grad():  # new weights between b's second and third steps
        for p in policy.model.parameters():
            p.to_local().mul_(1.5)
    engine.load_weights({n: t.clone() for n, t in policy.named_weights()}, version=3)
    while "b" not in done:
        done.update(engine.step())
    gen = done["b"]
    assert (gen.versions[:, :4] == -1).all() and (gen.versions[:, 4:] == 3).all(), gen.versions
    trainer_lp, rollout_lp, mask = log_probs_of(policy, [prompts["b"]], [gen], engine.pad_id)
    diff = (trainer_lp - rollout_lp).abs()[:, 4:][mask[:, 4:]]
    assert diff.max().item() < 1e-5, diff.max().item()


def random_adapters(engine: HFEngine, modules: tuple[str, ...], seed: int) -> dict:
    """LoRA adapters as a sync carries them (fp32, B scaled), for the engine's weights whose
    module name ends in one of ``modules``."""
    g = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, p in engine.named_parameters():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in modules:
            adapters[module + lora.LORA_A] = torch.randn((4, p.shape[1]), generator=g)
            adapters[module + lora.LORA_B] = torch.randn((p.shape[0], 4), generator=g) / 10
    return adapters


def test_lora_syncs_merge_from_a_base_read_once_and_a_narrower_one_restores_the_rest(
    tiny_model_dir, tmp_path
):
    """After a full sync, the first LoRA sync reads the base from the model's files and
    holds it (every weight: the full sync changed them all, each gets its base back); the
    next merges from memory: the files are gone by then. Its adapters target fewer modules
    than the first's, and the weights only the first changed get their base back: the
    engine holds base + B @ A of the last sync exactly."""
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    cfg = dataclasses.replace(Config(), model=ModelConfig(path=str(folder)))
    engine = HFEngine(cfg.model, cfg.rollout, CPU)
    base = {name: p.detach().clone() for name, p in engine.named_parameters()}
    engine.load_weights({name: t + 0.5 for name, t in base.items()}, version=0)  # a full sync
    wide = random_adapters(engine, ("q_proj", "v_proj", "down_proj"), seed=1)
    engine.load_weights(wide, version=1)
    assert engine.base.held_bytes == sum(t.numel() * t.element_size() for t in base.values())
    for path in folder.glob("*.safetensors"):
        path.unlink()
    narrow = random_adapters(engine, ("q_proj",), seed=2)
    engine.load_weights(narrow, version=2)
    expected = dict(lora.merged_weights(narrow, base.items(), torch.float32))
    assert set(expected) < set(lora.base_targets(wide))
    for name, param in engine.named_parameters():
        assert torch.equal(param, expected.get(name, base[name])), name


def test_steps_keep_the_rows_in_flight_and_prefill_only_those_that_join(
    tiny_model_dir, log_probs_of
):
    """rollout.hf_step_tokens=3, sampled at temperature 0.7 with top-k and top-p, groups
    joining between steps and leaving at their EOS: a step continues the rows it held by
    decoding alone (every model call but a joining group's prefill takes one token per
    row), and every sampled token's log-prob is the trainer's for its context."""
    _, engine, policy = engine_and_policy(
        tiny_model_dir, 0.7, response_length=12, hf_step_tokens=3, top_k=8, top_p=0.9
    )
    widths = []
    engine.model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    torch.manual_seed(3)
    prompts = {key: engine.encode(text) for key, text in [("a", "1 2 3 ="), ("b", "9 ="),
                                                          ("c", "5 5 5 5 5 =")]}  # fmt: skip
    done = {}
    engine.submit("a", prompts["a"], 4)
    done.update(engine.step())
    assert widths[0] == (4, len(prompts["a"])) and all(w[1] == 1 for w in widths[1:])
    engine.submit("b", prompts["b"], 4)
    engine.submit("c", prompts["c"], 4)
    widths.clear()
    done.update(engine.step())
    assert widths[0] == (8, len(prompts["c"]))  # b and c join in one prefill, a continues
    assert all(w[1] == 1 for w in widths[1:]) and widths[1][0] > 4
    widths.clear()
    while len(done) < 3:
        done.update(engine.step())
    assert all(w[1] == 1 for w in widths), widths  # nothing joined: decoding alone
    lengths = np.concatenate([g.response_lengths for g in done.values()])
    assert len(set(lengths.tolist())) > 1  # rows left at different steps
    keys = list(prompts)
    trainer_lp, rollout_lp, mask = log_probs_of(
        policy, [prompts[k] for k in keys], [done[k] for k in keys], engine.pad_id
    )
    diff = (trainer_lp - rollout_lp).abs()[mask]
    assert diff.max().item() < 1e-5, diff.max().item()


def test_a_row_whose_context_grew_is_prefilled_again(tiny_model_dir):
    """A held row whose context changed outside the engine (a multi-turn observation) is
    dropped and prefilled from its new context: its logits are then a fresh forward's."""
    _, engine, _ = engine_and_policy(tiny_model_dir)
    held = ResidentBatch(engine.model, CPU)
    first, second = object(), object()
    contexts = {first: engine.encode("1 2 ="), second: engine.encode("3 4 5 6 =")}
    with torch.no_grad():
        held.hold([(o, c) for o, c in contexts.items()])
        held.advance(torch.tensor([5, 6]))
        contexts[first] = contexts[first] + [5] + engine.encode("7 7")  # an observation
        contexts[second] = contexts[second] + [6]
        held.hold([(second, contexts[second]), (first, contexts[first])])
        assert held.owners == [second, first] and held.lengths == [6, 6]
        for row, owner in enumerate(held.owners):
            fresh = engine.model(torch.tensor([contexts[owner]])).logits[0, -1]
            torch.testing.assert_close(held.logits[row], fresh, atol=1e-5, rtol=0)


def test_top_k_and_top_p_keep_the_tokens_transformers_keeps():
    """The continued steps sample among the tokens that transformers' top-k and top-p
    warpers (``generate``'s) leave, and never outside them; the log-prob is the unfiltered
    distribution's at the temperature."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    for top_k, top_p in [(5, 1.0), (0, 0.8), (10, 0.6), (0, 0.05), (0, 0.999)]:
        scaled = logits / 0.7
        theirs = TopKLogitsWarper(top_k)(None, scaled.clone()) if top_k else scaled.clone()
        theirs = TopPLogitsWarper(top_p)(None, theirs) if top_p < 1 else theirs
        allowed = torch.isfinite(theirs)
        assert torch.equal(torch.isfinite(filtered(scaled, top_p, top_k)), allowed)
        assert 1 <= allowed.sum(-1).min() and allowed.sum(-1).max() < 40
        for _ in range(50):
            tokens, log_probs = sample_tokens(logits, 0.7, top_p, top_k)
            assert allowed[torch.arange(6), tokens].all(), (top_k, top_p)
            expected = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0]
            torch.testing.assert_close(log_probs, expected)
