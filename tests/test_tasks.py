import dataclasses

import pytest

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks import Prompt, load_task, long_tail
from hpc_asyncppo.tasks.jsonl import DatasetError
from hpc_asyncppo.tasks.next_digit import NextDigitTask


def test_next_digit_prompts_are_deterministic_and_answer_the_last_digit():
    a, b = NextDigitTask(DataConfig(num_prompts=50)), NextDigitTask(DataConfig(num_prompts=50))
    assert a.prompts() == b.prompts()
    for p in a.prompts():
        digits = p.text.split()
        assert digits[-1] == "=" and 2 <= len(digits) - 1 <= 5
        assert p.ground_truth == str((int(digits[-2]) + 1) % 10)


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("5 5 5 5", 1.0),
        ("5 5 5 5 5 5", 1.0),
        ("5 5", 0.5),
        ("4 5 4 5", 0.5),
        ("", 0.0),
        ("1 2 3 4", 0.0),
    ],
)
def test_next_digit_reward(response, reward):
    task = NextDigitTask(DataConfig(num_prompts=1))
    assert task.reward(Prompt(0, "3 4 =", "5"), response) == reward


def test_long_tail_asks_a_quarter_of_its_prompts_for_answers_twelve_times_longer():
    task = load_task(DataConfig(task="long_tail", num_prompts=2000))
    prompts = task.prompts()
    long = [p for p in prompts if long_tail.need(p) == long_tail.LONG]
    assert 0.2 < len(long) / len(prompts) < 0.3
    for p in prompts:
        words = p.text.split()
        last_digit = words[-3] if long_tail.MARKER in words else words[-2]
        assert words[-1] == "=" and p.ground_truth == str((int(last_digit) + 1) % 10)
    assert long_tail.LONG >= 10 * long_tail.SHORT
    assert task.min_response_length == long_tail.LONG + 1


@pytest.mark.parametrize(
    ("text", "response", "reward"),
    [
        ("3 4 =", "5 5 5 5", 1.0),
        ("3 4 =", "5 5", 0.5),
        ("3 4 =", "5 5 5 5 5 5 5 5", 0.5),  # ran on: 4 right of 8 written
        ("3 4 =", "5 5 5 5 " + "5 " * 44, 4 / 48),  # the long answer to a short prompt
        ("3 4 long =", "5 5 5 5", 4 / 48),  # stopped early
        ("3 4 long =", "5 " * 48, 1.0),
        ("3 4 long =", "5 " * 24 + "1 " * 24, 0.5),
        ("3 4 long =", "", 0.0),
    ],
)
def test_long_tail_reward_needs_the_right_length(text, response, reward):
    task = load_task(DataConfig(task="long_tail", num_prompts=1))
    assert task.reward(Prompt(0, text, "5"), response) == pytest.approx(reward)


def test_long_tail_held_out_prompts_are_half_long_and_unseen():
    held = long_tail.held_out_prompts(64)
    train = {p.text for p in long_tail.generate_prompts(DataConfig().num_prompts)}
    assert not train & {p.text for p in held}
    assert [p.data_source for p in held].count("long") == 32
    assert all((p.data_source == "long") == ("long" in p.text.split()) for p in held)


def reward_exact(prompt: Prompt, response_text: str) -> float:
    return float(response_text.strip() == prompt.ground_truth)


def test_jsonl_task_with_a_user_reward(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"prompt": "1 =", "ground_truth": "2"}\n\n{"prompt": "8 =", "ground_truth": "9"}\n'
    )
    task = load_task(
        DataConfig(task="jsonl", train=str(path), reward_fn=f"{__name__}:reward_exact")
    )
    assert [p.text for p in task.prompts()] == ["1 =", "8 ="]
    assert task.reward(task.prompts()[1], " 9 ") == 1.0
    assert sorted(task.vocabulary()) == ["1", "2", "8", "9", "="]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"data.jsonl:2: not valid JSON"),
        ('{"prompt": "x"}', r"data.jsonl:2: field 'ground_truth' missing or not a string"),
        (
            '{"prompt": 3, "ground_truth": "1"}',
            r"data.jsonl:2: field 'prompt' missing or not a string",
        ),
        ("[1, 2]", r"data.jsonl:2: a row must be a JSON object"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1 =", "ground_truth": "2"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message):
        load_task(DataConfig(task="jsonl", train=str(path), reward_fn=f"{__name__}:reward_exact"))


def test_unknown_task_and_bad_import_paths_are_config_errors():
    with pytest.raises(ConfigError, match="not a registered task"):
        load_task(DataConfig(task="nope"))
    with pytest.raises(ConfigError, match="data.reward_fn='no.such.module:f' cannot be imported"):
        load_task(DataConfig(reward_fn="no.such.module:f"))


def test_next_digit_reads_data_train_and_a_held_out_data_val(tmp_path):
    """The default task takes its prompts from a JSONL file when one is given (how data.val
    is given), scored by its own reward, each prompt with its data_source."""
    from hpc_asyncppo.tasks import load_val_task
    from hpc_asyncppo.tasks.next_digit import generate_prompts, write_prompts

    held = [
        dataclasses.replace(p, data_source="a" if p.index % 2 else "")
        for p in generate_prompts(6, seed=5)
    ]
    write_prompts(tmp_path / "val.jsonl", held)
    task = load_val_task(DataConfig(val=str(tmp_path / "val.jsonl")))
    assert list(task.prompts()) == held
    answer = held[1].ground_truth
    assert task.reward(task.prompts()[1], " ".join([answer] * 4)) == 1.0
    assert load_task(DataConfig(train=str(tmp_path / "val.jsonl"))).prompts() == held


def test_a_bad_data_val_is_named(tmp_path):
    from hpc_asyncppo.tasks import load_val_task

    with pytest.raises(ConfigError, match=r"data.val='nope.jsonl': no such file"):
        load_val_task(DataConfig(val="nope.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1 ="}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:1: field 'ground_truth'"):
        load_val_task(DataConfig(val=str(tmp_path / "bad.jsonl")))
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1 =", "ground_truth": "2"}\n')
    with pytest.raises(ConfigError, match="data.task=jsonl needs data.reward_fn"):
        load_val_task(DataConfig(task="jsonl", val=str(tmp_path / "ok.jsonl")))
