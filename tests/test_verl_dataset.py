import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks import Prompt, load_task, tokenize_prompt
from hpc_asyncppo.tasks.gsm8k import extract_answer, gsm8k_reward
from hpc_asyncppo.tasks.jsonl import DatasetError

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    'How many clips did Natalia sell altogether in April and May? Let\'s think step by step and output the final answer after "####".'
)


def gsm8k_row(truth="72", **changes):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": QUESTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0},
    }
    row.update(changes)
    return row


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_parquet_gives_chat_prompt_and_ground_truth(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [gsm8k_row(), gsm8k_row("5")])
    task = load_task(DataConfig(task="verl", train=str(path)))
    first = task.prompts()[0]
    assert first.messages == (("user", QUESTION),)
    assert first.ground_truth == "72" and task.prompts()[1].ground_truth == "5"
    assert task.reward(first, "48 / 2 = 24, 48 + 24 = 72\n#### 72") == 1.0
    assert task.reward(first, "#### 71") == 0.0


@pytest.mark.parametrize(
    ("response", "score"),
    [("so #### 72", 1.0), ("#### 72.", 1.0), ("#### 70 wait #### 72", 1.0), ("#### $72", 1.0),
     ("the answer is 72", 0.0), ("#### 71", 0.0), ("", 0.0)],
)  # fmt: skip
def test_gsm8k_reward(response, score):
    assert gsm8k_reward(Prompt(0, "q", "72"), response) == score


def test_gsm8k_answer_normalisation():
    assert extract_answer("#### 1,234") == "1234"
    assert gsm8k_reward(Prompt(0, "q", "1,234"), "#### 1234") == 1.0
    assert extract_answer("no answer") is None


def test_chat_template_is_applied_to_messages(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}={% endif %}"
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    prompt = Prompt(0, "ignored", "4", messages=(("user", "1 2"), ("user", "3")))
    assert (
        tokenize_prompt(reloaded, prompt)
        == reloaded("1 2 3 =", add_special_tokens=False)["input_ids"]
    )
    plain = Prompt(1, "3 4 =", "5")
    assert (
        tokenize_prompt(reloaded, plain) == reloaded("3 4 =", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            gsm8k_row(reward_model=None),
            r"train.parquet: row 1: field 'reward_model.ground_truth' missing",
        ),
        (gsm8k_row(prompt=[{"role": "user"}]), r"row 1: field 'prompt\[0\]' must be"),
        (gsm8k_row(prompt=[]), r"row 1: field 'prompt' must be a non-empty list"),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, row, message):
    path = write_parquet(tmp_path / "train.parquet", [gsm8k_row(), row])
    with pytest.raises(DatasetError, match=message):
        load_task(DataConfig(task="verl", train=str(path)))


def test_unknown_data_source_needs_a_reward_fn(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [gsm8k_row(data_source="my/math")])
    with pytest.raises(ConfigError, match="no reward for data_source 'my/math'"):
        load_task(DataConfig(task="verl", train=str(path)))


def test_verl_jsonl_is_read_too(tmp_path):
    import json

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(gsm8k_row()) + "\n")
    assert load_task(DataConfig(task="verl", train=str(path))).prompts()[0].ground_truth == "72"
