"""Turn verl's GSM8K data (``examples/data_preprocess/gsm8k.py``'s parquet: a user message,
``reward_model.ground_truth``, ``data_source`` openai/gsm8k) into the tool-prompt form of
``configs/gsm8k-python-tool-qwen2.5-7b.yaml``: a system message that offers the Python tool
and asks for the answer after ``####``, and the question as the user's message. The reward
and the data source are kept (the GSM8K reward reads ``####``); the tool's schema itself
reaches the model through its chat template (``rollout.multi_turn.tool_config_path``).

    python scripts/prepare_gsm8k_tool.py IN.parquet OUT.parquet     # or .jsonl, either side

A row without a question or a ground truth is an error naming the row; nothing is written
then.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SYSTEM = (
    "You are a careful math solver. You may run Python programs with the code_interpreter "
    "tool to compute what you need: call it, read its output, and go on. Reason step by "
    "step, then give the final answer as a number after '####'."
)
VERL_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)  # whole, or not at all


def question_of(row: dict, where: str) -> str:
    extra = row.get("extra_info") or {}
    if isinstance(extra.get("question"), str):
        return extra["question"].strip()
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt.replace(VERL_SUFFIX, "").strip()
    users = [
        m.get("content") for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"
    ]
    if not users or not isinstance(users[-1], str):
        raise ValueError(f"{where}: no question (extra_info.question or a user message)")
    return users[-1].replace(VERL_SUFFIX, "").strip()


def convert(row: dict, where: str) -> dict:
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if truth is None:
        raise ValueError(f"{where}: no reward_model.ground_truth")
    return {
        "data_source": row.get("data_source") or "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question_of(row, where)},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(truth)},
        "extra_info": {**(row.get("extra_info") or {}), "tool": "code_interpreter"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="verl's GSM8K parquet (or .jsonl)")
    parser.add_argument("out", type=Path, help="where to write the tool-prompt rows")
    args = parser.parse_args(argv)
    try:
        rows = [convert(r, f"{args.source}: row {i}") for i, r in enumerate(read_rows(args.source))]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
