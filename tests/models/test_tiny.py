"""The tiny default model: a run directory's copy of a cached build is the build itself,
and making a run directory from the cache needs neither torch nor transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hpc_asyncppo.config import DataConfig, TinyModelConfig, load_config
from hpc_asyncppo.models import tiny
from hpc_asyncppo.models.tiny import TinyTokenizer, build_tiny_model, tiny_model
from hpc_asyncppo.tasks import load_task, tokenize_prompt
from tests.harness import REPO

WORDS = load_task(DataConfig()).vocabulary()


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_copy_from_the_cache_is_byte_for_byte_a_fresh_build(tmp_path: Path) -> None:
    built = build_tiny_model(tmp_path / "built", WORDS, TinyModelConfig(), seed=5)
    first = tiny_model(tmp_path / "first", WORDS, TinyModelConfig(), 5, cache=tmp_path / "c")
    second = tiny_model(tmp_path / "second", WORDS, TinyModelConfig(), 5, cache=tmp_path / "c")
    assert files_of(first) == files_of(built) == files_of(second)
    assert len(list((tmp_path / "c" / "tiny-models").iterdir())) == 1  # no temporary left


def test_the_cache_builds_each_model_once(tmp_path: Path, monkeypatch) -> None:
    builds = []
    real = tiny.build_tiny_model
    monkeypatch.setattr(tiny, "build_tiny_model", lambda *a: builds.append(a) or real(*a))
    for i in range(2):
        tiny_model(tmp_path / f"run{i}", WORDS, TinyModelConfig(), 1, cache=tmp_path / "c")
    assert len(builds) == 1


def test_other_inputs_are_another_model() -> None:
    key = tiny.tiny_model_key(WORDS, TinyModelConfig(), 1)
    assert key == tiny.tiny_model_key(WORDS, TinyModelConfig(), 1)
    assert key != tiny.tiny_model_key(WORDS, TinyModelConfig(), 2)
    assert key != tiny.tiny_model_key(WORDS, TinyModelConfig(num_layers=3), 1)
    assert key != tiny.tiny_model_key([*WORDS, "extra"], TinyModelConfig(), 1)


def test_a_cache_that_cannot_be_written_only_costs_the_build(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    out = tiny_model(tmp_path / "model", WORDS, TinyModelConfig(), 1, cache=blocked)
    built = build_tiny_model(tmp_path / "built", WORDS, TinyModelConfig(), seed=1)
    assert files_of(out) == files_of(built)


def test_the_light_tokenizer_gives_the_ids_of_the_models_own(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "m", WORDS, TinyModelConfig(), seed=1)
    light, full = TinyTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    prompts = list(load_task(DataConfig()).prompts())
    for prompt in prompts:
        assert tokenize_prompt(light, prompt) == tokenize_prompt(full, prompt)
    for text in ("<eos> 3 <pad>  unknown-word 1\n2", "", "  "):
        assert light(text, add_special_tokens=False) == {
            "input_ids": full(text, add_special_tokens=False)["input_ids"]
        }


@pytest.mark.parametrize("cached", [False, True])
def test_a_run_directory_from_the_cache_imports_neither_torch_nor_transformers(
    tmp_path: Path, cached: bool
) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from hpc_asyncppo.config import load_config\n"
        "from hpc_asyncppo.launch.rundir import prepare_run_dir\n"
        f"prepare_run_dir(load_config(), Path({str(tmp_path / 'run')!r}))\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPC_ASYNCPPO_CACHE": str(tmp_path / "cache")}
    if cached:
        cfg = load_config()
        tiny_model(tmp_path / "warm", WORDS, cfg.model.tiny, cfg.trainer.seed, tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    imported = out.stdout.strip().splitlines()[-1]
    assert imported == ("[]" if cached else "['torch', 'transformers']")
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
